"""Decoder configuration for the Llama, Qwen2, Qwen3-dense and Qwen3-MoE families, read from HF
configs."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLS = ("auto", "naive", "flash", "pallas_gpu", "splash_tpu")
# How an MoE layer computes its experts (not what): "ragged" groups the tokens by expert and
# runs `jax.lax.ragged_dot` (each token pays for its k experts only); "gmm" groups them the
# same way and runs fr_jax.models.gmm's Pallas-Triton kernels (Pallas interpret mode off a
# GPU); "dense" runs every expert on every token and weights the unselected ones by zero (E/k
# times the work: tests, tiny models); "auto" is "gmm" where the program is compiled for a GPU
# (XLA:GPU expands ragged_dot densely) and "ragged" elsewhere, decided at lowering.
MOE_IMPLS = ("auto", "ragged", "gmm", "dense")
# The projections LoRA adapters can target (fr_jax.models.lora), by the decoder's names, with
# the HF/PEFT module names they may also be given by.
LORA_TARGETS = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
                "w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
LORA_MLP = ("w_gate", "w_up", "w_down")


class ConfigError(ValueError):
  """A config fr_jax cannot run (a model's, the learner's or the run's), naming the field
  and what to do. The one ConfigError: `fr_jax.learner.config` and `fr_jax.config` export
  this class."""


def check_attention(impl: str, field: str = "attention") -> str:
  """The one check of an attention path's name (ModelConfig, the learner config, attend)."""
  if impl not in ATTENTION_IMPLS:
    raise ConfigError(f"{field}={impl!r}: choose one of {ATTENTION_IMPLS}")
  return impl


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  family: str  # llama | qwen2 | qwen3 | qwen3_moe
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  # Llama-3 rope scaling: (factor, low_freq_factor, high_freq_factor, original_max_positions).
  rope_llama3: tuple[float, float, float, int] | None = None
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = False
  qkv_bias: bool = False  # Qwen2: True
  o_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head, before RoPE
  max_position_embeddings: int = 8192
  bos_token_id: int | None = None
  eos_token_id: int | None = None
  param_dtype: str = "float32"  # storage dtype of parameters
  compute_dtype: str = "float32"  # matmul inputs; accumulation and norms stay f32
  # auto | naive | flash | pallas_gpu | splash_tpu (fr_jax.models.attention): how attention is
  # computed, not what.
  attention: str = "auto"
  # Mixture of experts (qwen3_moe; 0 experts = a dense model). A layer i is sparse when
  # i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (HF's rule); its
  # router picks num_experts_per_tok of num_experts SwiGLU experts of width
  # moe_intermediate_size. Dense layers keep the intermediate_size MLP.
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  moe_impl: str = "auto"  # auto | ragged | gmm | dense (MOE_IMPLS): how, not what
  # The mesh axis the caller splits expert stacks over (None: not split); how, not what.
  expert_shard_axis: str | None = None
  # The mesh axis whose ranks each own num_experts / size experts, the tokens dispatched to
  # them by all-to-all (expert parallelism; None: every device runs every expert).
  expert_parallel_axis: str | None = None
  # Expert parallelism's slots per rank: 0 = a device's every pair (dropless); c > 0 =
  # ceil(c * pairs / ranks), the pairs past them dropped and counted (Routing.dropped).
  moe_capacity_factor: float = 0.0
  # LoRA (fr_jax.models.lora): rank-r adapters with scale alpha / r on `lora_targets` (names
  # from LORA_TARGETS, ours or HF's); rank 0 = none. The learner then trains the adapters
  # only. An MoE model's experts take none (its attention projections can).
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = ()

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ConfigError(f"family={self.family!r}: supported families are {FAMILIES}")
    for f in ("param_dtype", "compute_dtype"):
      if getattr(self, f) not in DTYPES:
        raise ConfigError(f"{f}={getattr(self, f)!r}: choose one of {DTYPES}")
    check_attention(self.attention)
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(f"num_heads={self.num_heads} is not a multiple of "
                        f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
    if self.head_dim % 2:
      raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
    object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
    if self.moe_impl not in MOE_IMPLS:
      raise ConfigError(f"moe_impl={self.moe_impl!r}: choose one of {MOE_IMPLS}")
    if not self.moe_capacity_factor >= 0:
      raise ConfigError(f"moe_capacity_factor={self.moe_capacity_factor} must be >= 0 "
                        "(0: dropless)")
    if (self.family == "qwen3_moe") != (self.num_experts > 0):
      raise ConfigError(f"family={self.family!r} with num_experts={self.num_experts}: "
                        "experts belong to qwen3_moe, and qwen3_moe needs num_experts > 0")
    if self.num_experts:
      if not 0 < self.num_experts_per_tok <= self.num_experts:
        raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                          f"[1, num_experts={self.num_experts}]")
      if self.num_experts > 32767:
        raise ConfigError(f"num_experts={self.num_experts}: expert ids are recorded as int16")
      if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
        raise ConfigError("moe_intermediate_size and decoder_sparse_step must be >= 1")
      bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
      if bad:
        raise ConfigError(f"mlp_only_layers={list(self.mlp_only_layers)}: {bad} are not "
                          f"layers of a {self.num_layers}-layer model")
    self._check_lora()

  def _check_lora(self):
    targets = self.lora_targets  # a tuple or list, or a string "wq,wv" (flags)
    if isinstance(targets, str):
      targets = [t for t in targets.replace(",", " ").split() if t]
    hf = {v: k for k, v in LORA_TARGETS.items()}
    unknown = [t for t in targets if t not in LORA_TARGETS and t not in hf]
    if unknown:
      raise ConfigError(f"lora_targets: {unknown} are not projections; choose from "
                        f"{list(LORA_TARGETS)} (or their HF names {list(hf)})")
    ours = tuple(dict.fromkeys(hf.get(t, t) for t in targets))
    object.__setattr__(self, "lora_targets", tuple(t for t in LORA_TARGETS if t in ours))
    if self.lora_rank < 0:
      raise ConfigError(f"lora_rank={self.lora_rank} must be >= 0 (0: no adapters)")
    if self.lora_rank and not self.lora_targets:
      raise ConfigError(f"lora_rank={self.lora_rank} with no lora_targets: name the "
                        f"projections to adapt, e.g. {list(LORA_TARGETS)}")
    if self.lora_rank and not self.lora_alpha > 0:
      raise ConfigError(f"lora_alpha={self.lora_alpha} must be > 0")
    if self.lora_rank and self.is_moe and set(self.lora_targets) & set(LORA_MLP):
      raise ConfigError(
          f"lora_targets={list(self.lora_targets)} on a qwen3_moe model: adapters on the "
          "experts (experts_gate, experts_up, experts_down) are not supported; target the "
          "attention projections (wq, wk, wv, wo)")

  @property
  def lora_scale(self) -> float:
    """alpha / r, the adapters' scale (PEFT's `scaling`). Asked of a config without LoRA
    (params that carry adapters the config does not describe), a ConfigError."""
    if not self.lora_rank:
      raise ConfigError("these params carry LoRA adapters but the model config has "
                        "lora_rank=0: pass the config they were trained with")
    return self.lora_alpha / self.lora_rank

  # --- mixture of experts ---
  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  @property
  def moe_layers(self) -> tuple[int, ...]:
    """Indices of the sparse (MoE) layers, in order; () for a dense model."""
    if not self.num_experts:
      return ()
    return tuple(i for i in range(self.num_layers) if i not in self.mlp_only_layers
                 and (i + 1) % self.decoder_sparse_step == 0)

  @property
  def dense_layers(self) -> tuple[int, ...]:
    """Indices of the layers with a dense MLP."""
    moe = set(self.moe_layers)
    return tuple(i for i in range(self.num_layers) if i not in moe)

  @property
  def routing_shape(self) -> tuple[int, int]:
    """(sparse layers, k): the trailing shape of a token's recorded expert ids."""
    return (len(self.moe_layers), self.num_experts_per_tok)

  @property
  def routing_dtype(self) -> np.dtype:
    """The smallest signed integer type that holds an expert id (int8 up to 128 experts)."""
    return np.dtype(np.int8 if self.num_experts <= 128 else np.int16)

  def replace(self, **kw) -> ModelConfig:
    return dataclasses.replace(self, **kw)

  @property
  def num_params(self) -> int:
    D, F, V = self.hidden_size, self.intermediate_size, self.vocab_size
    q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
    attn = D * q + 2 * D * kv + q * D
    attn += (q + 2 * kv) * self.qkv_bias + D * self.o_bias + 2 * self.head_dim * self.qk_norm
    mlp = 3 * D * F + (2 * F + D) * self.mlp_bias
    n_moe = len(self.moe_layers)
    moe = self.num_experts * (D + 3 * D * self.moe_intermediate_size)
    layers = self.num_layers * (attn + 2 * D) + (self.num_layers - n_moe) * mlp + n_moe * moe
    return V * D * (1 if self.tie_embeddings else 2) + layers + D

  @property
  def num_active_params(self) -> int:
    """Parameters one token uses: for an MoE model, its k experts (and the router) of each
    sparse layer instead of all of them."""
    unused = self.num_experts - self.num_experts_per_tok
    return self.num_params - len(self.moe_layers) * unused * 3 * self.hidden_size \
        * self.moe_intermediate_size

  def flops_per_token(self, seq_len: int) -> float:
    """Forward FLOPs per token: 2 x matmul params (LM head included) + attention scores.
    An MoE layer counts its router and the k experts a token uses (active parameters).

    Attention counts QK^T and AV for a causal context of average length seq_len/2.
    Forward + backward is 3x this.
    """
    D, F, V = self.hidden_size, self.intermediate_size, self.vocab_size
    q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
    n_moe = len(self.moe_layers)
    moe = self.num_experts * D + self.num_experts_per_tok * 3 * D * self.moe_intermediate_size
    matmul = (self.num_layers * (D * q + 2 * D * kv + q * D) + (self.num_layers - n_moe) * 3 * D * F
              + n_moe * moe + D * V)
    attn = self.num_layers * 2 * q * (seq_len / 2)
    return 2.0 * matmul + 2.0 * attn

  def train_flops(self, rows: int, row_len: int) -> float:
    """Model FLOPs of one training pass (forward + backward, 3x the forward) over `rows`
    packed rows of `row_len` positions: what MFU counts (the learner, `launch.compile_check`).
    Remat's recomputation is hardware work, not model work, and is not counted."""
    return 3.0 * self.flops_per_token(row_len) * rows * row_len

  def inv_freq(self) -> np.ndarray:
    """RoPE inverse frequencies [head_dim/2] (float64), with Llama-3 scaling if configured."""
    d = self.head_dim
    inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if self.rope_llama3 is None:
      return inv
    factor, low, high, old_len = self.rope_llama3
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = old_len / low, old_len / high
    scaled = np.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return np.where(medium, smoothed, scaled)


def _rope(cfg: dict[str, Any]) -> tuple[float, tuple | None]:
  """(rope_theta, llama3 scaling) from either the legacy or the `rope_parameters` format."""
  params = cfg.get("rope_parameters") or {}
  scaling = cfg.get("rope_scaling") or {}
  theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
  spec = {**scaling, **params}
  kind = spec.get("rope_type", spec.get("type", "default"))
  if kind in (None, "default"):
    return theta, None
  if kind == "llama3":
    return theta, (float(spec["factor"]), float(spec["low_freq_factor"]),
                   float(spec["high_freq_factor"]),
                   int(spec["original_max_position_embeddings"]))
  raise ConfigError(f"rope_type={kind!r} is not supported (supported: default, llama3)")


def _first_id(x):
  if isinstance(x, (list, tuple)):
    return int(x[0]) if x else None
  return None if x is None else int(x)


def from_hf_config(cfg: dict[str, Any], **overrides) -> ModelConfig:
  """A ModelConfig from a Hugging Face `config.json` dict (llama, qwen2, qwen3, qwen3_moe)."""
  family = cfg.get("model_type")
  if family not in FAMILIES:
    raise ConfigError(f"model_type={family!r} in config.json: fr_jax supports {FAMILIES}")
  if cfg.get("hidden_act", "silu") != "silu":
    raise ConfigError(f"hidden_act={cfg.get('hidden_act')!r}: only silu (SwiGLU) is supported")
  if family in ("qwen2", "qwen3_moe") and cfg.get("use_sliding_window"):
    raise ConfigError("use_sliding_window=true is not supported; set it to false")
  H = int(cfg["num_attention_heads"])
  theta, llama3 = _rope(cfg)
  attn_bias = bool(cfg.get("attention_bias", False))
  kw = dict(
      family=family,
      vocab_size=int(cfg["vocab_size"]),
      hidden_size=int(cfg["hidden_size"]),
      intermediate_size=int(cfg["intermediate_size"]),
      num_layers=int(cfg["num_hidden_layers"]),
      num_heads=H,
      num_kv_heads=int(cfg.get("num_key_value_heads") or H),
      head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // H),
      rope_theta=theta,
      rope_llama3=llama3,
      rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
      # Qwen2 always has q/k/v biases and no o bias; Llama and Qwen3 follow attention_bias.
      qkv_bias=True if family == "qwen2" else attn_bias,
      o_bias=False if family == "qwen2" else attn_bias,
      mlp_bias=bool(cfg.get("mlp_bias", False)) if family == "llama" else False,
      qk_norm=family in ("qwen3", "qwen3_moe"),
      max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
      bos_token_id=_first_id(cfg.get("bos_token_id")),
      eos_token_id=_first_id(cfg.get("eos_token_id")),
  )
  if family == "qwen3_moe":
    # Released checkpoints say num_experts; transformers >= 5 writes num_local_experts.
    kw.update(num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
              num_experts_per_tok=int(cfg["num_experts_per_tok"]),
              moe_intermediate_size=int(cfg["moe_intermediate_size"]),
              norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
              decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
              mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))
  kw.update(overrides)
  return ModelConfig(**kw)


def to_hf_config(c: ModelConfig) -> dict[str, Any]:
  """The Hugging Face `config.json` dict for `c` (readable by transformers and SGLang)."""
  arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
          "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[c.family]
  rope: dict[str, Any] = {"rope_type": "default"}
  if c.rope_llama3 is not None:
    f, lo, hi, old = c.rope_llama3
    rope = {"rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi,
            "original_max_position_embeddings": old}
  out = {
      "architectures": [arch],
      "model_type": c.family,
      "vocab_size": c.vocab_size,
      "hidden_size": c.hidden_size,
      "intermediate_size": c.intermediate_size,
      "num_hidden_layers": c.num_layers,
      "num_attention_heads": c.num_heads,
      "num_key_value_heads": c.num_kv_heads,
      "head_dim": c.head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": c.rms_norm_eps,
      "rope_theta": c.rope_theta,
      "rope_scaling": None if c.rope_llama3 is None else rope,
      "rope_parameters": {**rope, "rope_theta": c.rope_theta},
      "tie_word_embeddings": c.tie_embeddings,
      "max_position_embeddings": c.max_position_embeddings,
      "bos_token_id": c.bos_token_id,
      "eos_token_id": c.eos_token_id,
      "torch_dtype": c.param_dtype,
      "dtype": c.param_dtype,
  }
  if c.family == "llama":
    out.update(attention_bias=c.qkv_bias, mlp_bias=c.mlp_bias)
  elif c.family == "qwen3":
    out.update(attention_bias=c.qkv_bias)
  elif c.family == "qwen3_moe":
    # The router's load-balancing loss is the learner's (`learner.router_aux_loss_coef`);
    # the exported config leaves it off, as it is at inference.
    out.update(attention_bias=c.qkv_bias, num_experts=c.num_experts,
               num_experts_per_tok=c.num_experts_per_tok,
               moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
               decoder_sparse_step=c.decoder_sparse_step, mlp_only_layers=list(c.mlp_only_layers),
               output_router_logits=False, router_aux_loss_coef=0.0,
               use_sliding_window=False, sliding_window=None)
  else:
    out.update(use_sliding_window=False, sliding_window=None)
  return out
