"""GGUF import with the `gguf` package: metadata -> ModelConfig, tensors dequantized to
float32, and the rope permutation that llama.cpp's converter applies to Llama Q/K undone.

llama.cpp stores Llama q/k rows interleaved for its rope kernel: per head, HF row
(j, half h) goes to row 2j + h. Qwen2/Qwen3 GGUFs use the NeoX layout and are not permuted.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from fr_jax.models.config import ModelConfig
from fr_jax.models.hf_io import CheckpointError, params_from_hf_tensors

_ARCH_FAMILY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# GGUF tensor name (after "blk.{i}.") -> HF name (after "model.layers.{i}.")
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute` for q/k weights [n_heads * head_dim, in] (or biases)."""
  rows = w.shape[0]
  hd = rows // n_heads
  return (w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's permutation (HF layout -> GGUF layout); for tests and writers."""
  rows = w.shape[0]
  hd = rows // n_heads
  return (w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _f32_decimal(x) -> float:
  """GGUF stores floats as f32: 1e-5 reads back as 9.99999974e-06. Recover the shortest
  decimal that rounds to the same f32 (what the original HF config said)."""
  return float(str(np.float32(x)))


def _field(reader, key, default=None):
  f = reader.fields.get(key)
  return default if f is None else f.contents()


def config_from_gguf(reader, **overrides) -> ModelConfig:
  arch = _field(reader, "general.architecture")
  if arch not in _ARCH_FAMILY:
    raise CheckpointError(f"GGUF architecture {arch!r} is not supported ({sorted(_ARCH_FAMILY)})")
  if any(t.name == "rope_freqs.weight" for t in reader.tensors):
    raise CheckpointError("this GGUF carries rope_freqs (Llama-3.1 rope scaling); import the "
                          "Hugging Face checkpoint instead")
  g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
  H = int(g("attention.head_count"))
  D = int(g("embedding_length"))
  names = {t.name for t in reader.tensors}
  vocab = g("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
  kw = dict(
      family=_ARCH_FAMILY[arch], vocab_size=int(vocab), hidden_size=D,
      intermediate_size=int(g("feed_forward_length")), num_layers=int(g("block_count")),
      num_heads=H, num_kv_heads=int(g("attention.head_count_kv", H)),
      head_dim=int(g("attention.key_length", D // H)),
      rope_theta=_f32_decimal(g("rope.freq_base", 10000.0)),
      rms_norm_eps=_f32_decimal(g("attention.layer_norm_rms_epsilon", 1e-6)),
      tie_embeddings="output.weight" not in names,
      qkv_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
      max_position_embeddings=int(g("context_length", 8192)),
      bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
      eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
  )
  kw.update(overrides)
  return ModelConfig(**kw)


def load_gguf(path, *, param_dtype: str = "float32", compute_dtype: str = "float32"):
  """Reads a GGUF file. Returns (ModelConfig, params of NumPy arrays, reader)."""
  path = Path(path)
  if not path.is_file():
    raise CheckpointError(f"GGUF file {path} not found")
  try:
    reader = gguf.GGUFReader(str(path))
  except Exception as e:  # the gguf package raises assorted errors on a bad file
    raise CheckpointError(f"{path} is not a readable GGUF file: {e}") from e
  cfg = config_from_gguf(reader, param_dtype=param_dtype, compute_dtype=compute_dtype)
  permuted = cfg.family == "llama"
  tensors = {}
  for t in reader.tensors:
    a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    if t.name in _TOP:
      name = _TOP[t.name]
    elif t.name.startswith("blk."):
      _, i, rest = t.name.split(".", 2)
      if rest not in _LAYER:
        raise CheckpointError(f"{path}: unexpected tensor {t.name!r}")
      name = f"model.layers.{i}.{_LAYER[rest]}"
      if permuted and rest.startswith(("attn_q.", "attn_k.")):
        heads = cfg.num_heads if rest.startswith("attn_q.") else cfg.num_kv_heads
        a = unpermute_rope(a, heads)
    else:
      raise CheckpointError(f"{path}: unexpected tensor {t.name!r}")
    tensors[name] = a
  params = params_from_hf_tensors(tensors, cfg, source=str(path))
  return cfg, params, reader
