"""The (data, fsdp) device mesh and the sharding rules for parameters and packed batches.

* Packed rows are split over both axes (data parallelism across the whole mesh).
* Each parameter is split over `fsdp` along its largest dimension that divides evenly; a leaf
  of a stacked subtree (`decoder.STACKS`: "layers", and an MoE model's "moe" and "mlp") never
  on its leading layer axis. Everything else is replicated. Optimizer state follows the
  parameter it belongs to (jit propagates the parameter shardings into optax's init).
* Experts on the mesh (expert-sharded FSDP). An MoE model's expert stacks (`moe`'s
  experts_gate / experts_up [n, E, D, F], experts_down [n, E, F, D]) are split over `fsdp` on
  the expert axis E when fsdp divides E: each device stores E / fsdp whole experts and their
  Adam moments; otherwise they fall back to the largest-dimension rule. The router [n, D, E]
  follows the general rule (D for Qwen3-30B-A3B: 2048 > 128). This shards storage only:
  each layer's experts are all-gathered onto every device, as any FSDP weight is, and each
  device runs its own rows' tokens through them (the learner traces under `jax.set_mesh`, and
  `moe._experts` runs the grouped dispatch under shard_map, gathering over the axis
  `learner_model_config` names in `ModelConfig.expert_shard_axis`; docs/scale.md, "Experts on
  the mesh"). Expert parallelism proper (all-to-all token dispatch) is not built.
* Per-trajectory slot arrays ([S]) are replicated: they are tiny.

The update is a jitted function with these shardings; XLA inserts the collectives, so global
quantities (B, the reward mean, metric sums) are reduced across the mesh.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from fr_jax.models import decoder

BATCH_AXES = ("data", "fsdp")
EXPERT_WEIGHTS = ("experts_gate", "experts_up", "experts_down")  # under "moe": [n, E, ...]


def make_mesh(data: int = 1, fsdp: int = 1, devices=None) -> jax.sharding.Mesh:
  n = data * fsdp
  devices = list(jax.devices() if devices is None else devices)
  if n > len(devices):
    raise ValueError(f"mesh data={data} x fsdp={fsdp} needs {n} devices; "
                     f"{len(devices)} are available")
  return jax.make_mesh((data, fsdp), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2,
                       devices=devices[:n])


def param_spec(shape, fsdp: int, stacked: bool, expert_axis: int | None = None) -> P:
  """Shard `expert_axis` over fsdp when given and fsdp divides it; else the largest evenly
  divisible dim (skipping a leading layer axis when `stacked`); else replicate."""
  if fsdp == 1 or len(shape) == 0:
    return P()
  spec = [None] * len(shape)
  if expert_axis is not None and shape[expert_axis] % fsdp == 0:
    spec[expert_axis] = "fsdp"
    return P(*spec)
  first = 1 if stacked else 0
  dims = sorted(range(first, len(shape)), key=lambda d: -shape[d])
  for d in dims:
    if shape[d] % fsdp == 0 and shape[d] >= fsdp:
      spec[d] = "fsdp"
      return P(*spec)
  return P()


def params_sharding(params, mesh):
  """NamedShardings for a params tree, or any tree that holds one (the train state: its
  optimizer moments sit under the same dict keys)."""
  fsdp = mesh.shape["fsdp"]

  def one(path, x):
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    stacked = any(k in decoder.STACKS for k in keys)
    expert_axis = None
    if "moe" in keys and keys[-1] in EXPERT_WEIGHTS:
      expert_axis = 1 if stacked else 0
    return NamedSharding(mesh, param_spec(np.shape(x), fsdp, stacked, expert_axis))

  return jax.tree_util.tree_map_with_path(one, params)


def batch_sharding(batch, mesh):
  """[R, L, ...] fields split over rows across the whole mesh; [S] fields replicated; absent
  (None) fields stay None."""
  rows = NamedSharding(mesh, P(BATCH_AXES))
  rep = NamedSharding(mesh, P())
  return type(batch)(*[None if x is None else rows if np.ndim(x) >= 2 else rep for x in batch])


def replicated(mesh):
  return NamedSharding(mesh, P())


def put(tree, shardings):
  """`tree` (the same host values on every process) as global arrays on `shardings` (a tree
  of the same structure, or one sharding for all). Where a sharding spans other processes'
  devices, each process places only the shards of its own devices."""
  def one(x, sharding):
    if sharding.is_fully_addressable:
      return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: one(x, shardings), tree)
  return jax.tree.map(one, tree, shardings)
