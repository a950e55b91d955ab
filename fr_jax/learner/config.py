"""The learner's configuration (an ml_collections ConfigDict) and its validation.

Every ablation is one field: `objective.reduction=token_mean`, `objective.trust=token|none`,
`objective.advantage=positive_only`, `objective.delta=inf`, `minibatches=4` (sequential
minibatches), `objective.loss=grpo` (group advantages + PPO-clip). `objective.loss=sft`
is the supervised warm start's (`launch.sft`).
"""

from __future__ import annotations

import math

import ml_collections

from fr_jax import objective as obj
from fr_jax.models.config import check_attention

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
      seed=0,  # init seed for random (tiny) models
      # the registry SHAPES entry of this model's architecture: `launch.compile_check`
      # compiles the update from it, without the checkpoint
      shapes="",
  ))
  c.objective = ml_collections.ConfigDict(dict(
      loss="flash_reinforce",  # grpo, or sft (launch.sft sets it)
      delta=3e-3,  # sequence trust bound; inf disables the gate
      reduction="sample_mean",
      trust="sequence",
      advantage="batch_centered",
      clip_eps=0.2,  # grpo only
      clip_eps_high=0.2,  # grpo only
      normalize_std=True,  # grpo only: divide group advantages by the group std
      temperature=1.0,  # the rollouts' sampling temperature, applied when scoring
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
      total_steps=1000,  # schedule length in updates
  ))
  c.packing = ml_collections.ConfigDict(dict(
      row_len=4096,
      row_buckets=(1, 2, 3, 4, 5, 6, 7, 8),  # rows per micro-batch; multiples of the mesh size
      max_segments_per_row=32,
  ))
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1))
  c.batch_size = 128  # B trajectories per update
  c.minibatches = 1  # k > 1: a batch of k*B is split into k consecutive updates (ablation)
  c.max_policy_lag = -1  # drop trajectories older than this many versions; -1 keeps all
  c.checkpoint = ml_collections.ConfigDict(dict(
      dir="",  # empty: no checkpoints
      every=50,  # updates between saves
      keep=3,
      async_save=True,
  ))
  c.log = ml_collections.ConfigDict(dict(
      dir="",  # metrics.jsonl and TensorBoard events; empty: no files
      peak_flops=0.0,  # for MFU; 0 measures a jitted matmul at start-up
  ))
  return c


class ConfigError(ValueError):
  """A learner config that cannot run, naming the field and the fix."""


def validate(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  o = c.objective
  if o.loss not in LOSSES:
    raise ConfigError(f"objective.loss={o.loss!r}: choose one of {LOSSES}")
  for name, allowed in (("reduction", obj.REDUCTIONS), ("trust", obj.TRUST_MODES),
                        ("advantage", obj.ADVANTAGES)):
    if o[name] not in allowed:
      raise ConfigError(f"objective.{name}={o[name]!r}: choose one of {allowed}")
  if not (o.delta >= 0 or math.isinf(o.delta)):
    raise ConfigError(f"objective.delta={o.delta} must be >= 0 (inf disables the gate)")
  if o.temperature <= 0:
    raise ConfigError(f"objective.temperature={o.temperature} must be > 0")
  if c.batch_size < 1 or c.minibatches < 1:
    raise ConfigError(f"batch_size={c.batch_size} and minibatches={c.minibatches} must be >= 1")
  n_shards = c.mesh.data * c.mesh.fsdp
  if c.mesh.data < 1 or c.mesh.fsdp < 1:
    raise ConfigError(f"mesh=({c.mesh.data}, {c.mesh.fsdp}): both axes must be >= 1")
  bad = [r for r in c.packing.row_buckets if r % n_shards]
  if bad:
    raise ConfigError(f"packing.row_buckets {bad} are not multiples of the mesh size "
                      f"data*fsdp={n_shards}; rows are split over the mesh")
  if c.optim.lr < 0 or c.optim.total_steps < 1:
    raise ConfigError(f"optim.lr={c.optim.lr} must be >= 0 and optim.total_steps >= 1")
  if not 0 <= c.optim.min_lr_ratio <= 1 or not 0 <= c.optim.warmup_frac < 1:
    raise ConfigError("optim.min_lr_ratio must be in [0, 1] and optim.warmup_frac in [0, 1)")
  try:
    check_attention(c.model.attention, "model.attention")
  except ValueError as e:  # the models' ConfigError: re-raised as this config's
    raise ConfigError(str(e)) from None
  if c.model.compute_dtype not in ("float32", "bfloat16") or \
     c.model.param_dtype not in ("float32", "bfloat16"):
    raise ConfigError("model.param_dtype and model.compute_dtype must be float32 or bfloat16")
  return c
