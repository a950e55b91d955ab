"""The learner's configuration (an ml_collections ConfigDict) and its validation.

Validation has one owner and runs once: `validate` checks every field, derives what is left
unset (`optim.total_steps` from `max_updates`), and remembers the config it passed.
`ensure_valid` (the Learner's constructor, `system.build_service`) validates again only a
config that was never validated or has changed since, so a config loaded by a launch command
(`launch.common.load_config`) is checked exactly once, at load.

Every ablation is one field: `objective.reduction=token_mean`, `objective.trust=token|none`,
`objective.advantage=positive_only`, `objective.delta=inf`, `minibatches=4` (sequential
minibatches), `objective.loss=grpo` (group advantages + PPO-clip). `objective.loss=sft`
is the supervised warm start's (`launch.sft`).
"""

from __future__ import annotations

import math
import weakref

import ml_collections

from fr_jax import objective as obj
from fr_jax.models.config import MOE_IMPLS, ConfigError, check_attention
from fr_jax.packing import PackingError, PackingSpec

__all__ = ["LOSSES", "ConfigError", "check_fields", "default_config", "ensure_valid",
           "remember_valid", "validate"]

LOSSES = ("flash_reinforce", "grpo", "sft")


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = ml_collections.ConfigDict(dict(
      name="smollm2-135m-instruct",  # registry name, hf:DIR or gguf:FILE
      param_dtype="float32",  # master weights
      compute_dtype="float32",  # bfloat16: bf16 matmuls, f32 master weights
      remat=True,  # recompute each layer in the backward pass (less memory, faster on CPU)
      # auto, naive, flash, pallas_gpu or splash_tpu: see fr_jax.models.attention (auto:
      # pallas_gpu on a GPU, splash_tpu on a TPU; elsewhere naive for rows of one block,
      # flash above). Flash kernels keep
      # attention memory linear in the row length.
      attention="auto",
      # MoE models: ragged (grouped experts, jax.lax.ragged_dot), gmm (grouped experts,
      # fr_jax.models.gmm's Pallas-Triton kernels), dense (every expert on every token: the
      # reference) or auto (gmm when compiled for a GPU, else ragged). How, not what.
      moe_impl="auto",
      # MoE with mesh.expert > 1: expert parallelism's slots per rank, 0 = every pair a device
      # has (dropless: memory for mesh.expert x its pairs); c > 0 = c x pairs / mesh.expert,
      # the pairs past them dropped (metric expert_drop_rate).
      moe_capacity_factor=0.0,
      # LoRA (fr_jax.models.lora, docs/lora.md): rank > 0 adds rank-r adapters, scale
      # alpha / rank, on the `targets` projections (wq wk wv wo w_gate w_up w_down, or the HF
      # names q_proj ...; an MoE model's experts take none) and trains only them.
      lora=dict(rank=0, alpha=16.0, targets="wq,wk,wv,wo,w_gate,w_up,w_down"),
      seed=0,  # init seed for random (tiny) models and LoRA's A
      # the registry SHAPES entry of this model's architecture: `launch.compile_check`
      # compiles the update from it, without the checkpoint
      shapes="",
  ))
  c.objective = ml_collections.ConfigDict(dict(
      loss="flash_reinforce",  # grpo, or sft (launch.sft sets it)
      delta=obj.DELTA,  # sequence trust bound; inf disables the gate
      reduction="sample_mean",  # token_mean, or constant_length (1/(B L), L = length_norm)
      # constant_length's L; 0: the run config sets agent.max_new_tokens (the longest reply
      # a turn may sample)
      length_norm=0.0,
      # token, none (ablations), or sequence_negative (a deviation, docs/objective.md: only
      # negative advantages gated)
      trust="sequence",
      advantage="batch_centered",
      clip_eps=0.2,  # grpo only
      clip_eps_high=0.2,  # grpo only
      normalize_std=True,  # grpo only: divide group advantages by the group std
      temperature=1.0,  # the rollouts' sampling temperature, applied when scoring
      # MoE models: weight of the routers' load-balancing loss (HF Qwen3-MoE's, Switch
      # Transformer's) added to the objective. 0 (off) as in the paper's recipe, which adds
      # nothing to the REINFORCE objective; with routing replay it would pull the routers away
      # from the routing the engine sampled with.
      router_aux_loss_coef=0.0,
  ))
  c.optim = ml_collections.ConfigDict(dict(
      lr=1e-6,  # Molt R1 defaults
      weight_decay=0.1,
      b1=0.9,
      b2=0.999,
      eps=1e-8,
      clip_norm=1.0,
      warmup_frac=0.03,
      min_lr_ratio=0.1,
      total_steps=0,  # schedule length in updates; 0: max_updates
  ))
  c.packing = ml_collections.ConfigDict(dict(
      row_len=4096,
      row_buckets=(1, 2, 3, 4, 5, 6, 7, 8),  # rows per micro-batch; multiples of the mesh size
      max_segments_per_row=32,
      # The LM head scores only the action positions (fr_jax.packing): per row, the smallest
      # of these fractions of row_len that holds the row with the most action positions, or
      # every position when none does. Each bucket used compiles once per row bucket; () : the
      # head always scores every position.
      head_buckets=(0.125, 0.25, 0.5),
  ))
  # Rows are split over data x fsdp x expert devices. expert > 1 (MoE models): expert
  # parallelism, each expert-axis rank owning num_experts / expert experts (learner.mesh).
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, expert=1))
  c.max_updates = 100  # total updates (a resumed run counts the restored ones)
  c.batch_size = 128  # B trajectories per update
  c.minibatches = 1  # k > 1: a batch of k*B is split into k consecutive updates (ablation)
  c.max_policy_lag = -1  # drop trajectories older than this many versions; -1 keeps all
  # MoE models: rollout routing replay (docs/learner.md). True: every record must carry the
  # experts the engine routed each position to, and the learner scores with them. False:
  # the learner routes with its own routers (records' routing, if any, only feeds the drift
  # metric). Dense models ignore it.
  c.routing_replay = True
  c.checkpoint = ml_collections.ConfigDict(dict(
      dir="",  # empty: no checkpoints
      every=50,  # updates between saves
      keep=3,
      async_save=True,
  ))
  c.log = ml_collections.ConfigDict(dict(
      dir="",  # metrics.jsonl and TensorBoard events; empty: no files
      peak_flops=0.0,  # for MFU; 0 measures a jitted matmul at start-up
      # MoE models whose records carry routing: also score each batch the other way (without
      # replay when replaying, with it when not) and log both mismatches per lag bucket
      # (`mismatch/lag_*/abs_dlogp_{with,without}_replay`). One more forward pass per update.
      routing_counterfactual=False,
  ))
  return c


# id(config) -> (weak reference, its JSON when it passed `validate`).
_PASSED: dict[int, tuple[weakref.ref, str]] = {}


def _fingerprint(c: ml_collections.ConfigDict) -> str:
  return c.to_json_best_effort(sort_keys=True)


def remember_valid(c: ml_collections.ConfigDict) -> None:
  key = id(c)
  _PASSED[key] = (weakref.ref(c, lambda _: _PASSED.pop(key, None)), _fingerprint(c))


def ensure_valid(c: ml_collections.ConfigDict, validate_fn=None) -> ml_collections.ConfigDict:
  """`c` as it is if it passed validation unchanged, else `validate_fn(c)` (default: this
  module's `validate`; the run config passes `fr_jax.config.validate`)."""
  seen = _PASSED.get(id(c))
  if seen is not None and seen[0]() is c and seen[1] == _fingerprint(c):
    return c
  return (validate_fn or validate)(c)


def validate(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks the learner's fields and fills `optim.total_steps` (0: `max_updates`); raises
  ConfigError naming the field. Returns `c`."""
  check_fields(c)
  remember_valid(c)
  return c


def packing_spec(c: ml_collections.ConfigDict) -> PackingSpec:
  p = c.packing
  return PackingSpec(p.row_len, tuple(p.row_buckets), p.max_segments_per_row,
                     tuple(p.head_buckets))


def mesh_size(c: ml_collections.ConfigDict) -> int:
  """The learner's devices: data x fsdp x expert."""
  return c.mesh.data * c.mesh.fsdp * c.mesh.get("expert", 1)


def check_fields(c: ml_collections.ConfigDict) -> None:
  """The learner's checks and derivations, without marking `c` validated (the run config's
  `validate` adds its own checks first)."""
  o = c.objective
  if o.loss not in LOSSES:
    raise ConfigError(f"objective.loss={o.loss!r}: choose one of {LOSSES}")
  for name, allowed in (("reduction", obj.REDUCTIONS), ("trust", obj.TRUST_MODES),
                        ("advantage", obj.ADVANTAGES)):
    if o[name] not in allowed:
      raise ConfigError(f"objective.{name}={o[name]!r}: choose one of {allowed}")
  if o.reduction == "constant_length" and not o.length_norm > 0:
    raise ConfigError(f"objective.reduction=constant_length needs objective.length_norm > 0 "
                      f"(the constant L in 1/(B L)), got {o.length_norm}")
  if not (o.delta >= 0 or math.isinf(o.delta)):
    raise ConfigError(f"objective.delta={o.delta} must be >= 0 (inf disables the gate)")
  if o.temperature <= 0:
    raise ConfigError(f"objective.temperature={o.temperature} must be > 0")
  if c.batch_size < 1 or c.minibatches < 1:
    raise ConfigError(f"batch_size={c.batch_size} and minibatches={c.minibatches} must be >= 1")
  n_shards = mesh_size(c)
  if c.mesh.data < 1 or c.mesh.fsdp < 1 or c.mesh.expert < 1:
    raise ConfigError(f"mesh=({c.mesh.data}, {c.mesh.fsdp}, {c.mesh.expert}): every axis "
                      "must be >= 1")
  bad = [r for r in c.packing.row_buckets if r % n_shards]
  if bad:
    raise ConfigError(f"packing.row_buckets {bad} are not multiples of the mesh size "
                      f"data*fsdp*expert={n_shards}; rows are split over the mesh")
  try:
    packing_spec(c)
  except PackingError as e:
    raise ConfigError(f"packing: {e}") from None
  if c.max_updates < 1:
    raise ConfigError(f"max_updates={c.max_updates} must be >= 1")
  if c.optim.total_steps == 0:
    c.optim.total_steps = c.max_updates
  if c.optim.lr < 0 or c.optim.total_steps < 1:
    raise ConfigError(f"optim.lr={c.optim.lr} must be >= 0 and optim.total_steps >= 1 "
                      f"(0 derives it from max_updates), got {c.optim.total_steps}")
  if not 0 <= c.optim.min_lr_ratio <= 1 or not 0 <= c.optim.warmup_frac < 1:
    raise ConfigError("optim.min_lr_ratio must be in [0, 1] and optim.warmup_frac in [0, 1)")
  check_attention(c.model.attention, "model.attention")
  if c.model.moe_impl not in MOE_IMPLS:
    raise ConfigError(f"model.moe_impl={c.model.moe_impl!r}: choose one of {MOE_IMPLS}")
  if not o.router_aux_loss_coef >= 0:
    raise ConfigError(f"objective.router_aux_loss_coef={o.router_aux_loss_coef} must be >= 0")
  if c.model.compute_dtype not in ("float32", "bfloat16") or \
     c.model.param_dtype not in ("float32", "bfloat16"):
    raise ConfigError("model.param_dtype and model.compute_dtype must be float32 or bfloat16")
