"""The (data, fsdp[, expert]) device mesh and the sharding rules for parameters and packed
batches.

* Packed rows are split over every axis (data parallelism across the whole mesh).
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
  the mesh").
* Expert parallelism. With an `expert` axis (`mesh.expert` > 1, for MoE models) the expert
  stacks are split on E over ("expert", "fsdp"): each expert-axis rank owns E / expert
  experts, stored split fsdp ways and gathered over fsdp only, and the rows' tokens travel to
  the rank that owns their experts and back with all-to-alls (`moe._experts_dispatched`).
  Every other parameter is split fsdp x expert ways by the largest-dimension rule (the expert
  axis carries rows as data does, and shares the dense weights' storage as fsdp does).
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

EXPERT_WEIGHTS = ("experts_gate", "experts_up", "experts_down")  # under "moe": [n, E, ...]


def make_mesh(data: int = 1, fsdp: int = 1, devices=None, expert: int = 1) -> jax.sharding.Mesh:
  """A (data, fsdp) mesh, or (data, fsdp, expert) when expert > 1 (the expert axis innermost:
  an expert group is adjacent devices, one node's where it fits)."""
  n = data * fsdp * expert
  devices = list(jax.devices() if devices is None else devices)
  if n > len(devices):
    raise ValueError(f"mesh data={data} x fsdp={fsdp} x expert={expert} needs {n} devices; "
                     f"{len(devices)} are available")
  shape, names = (data, fsdp, expert), ("data", "fsdp", "expert")
  if expert == 1:
    shape, names = shape[:2], names[:2]
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape),
                       devices=devices[:n])


def batch_axes(mesh) -> tuple[str, ...]:
  """The axes packed rows are split over: all of them."""
  return tuple(mesh.axis_names)


def param_spec(shape, fsdp: int, stacked: bool, expert_axis: int | None = None,
               expert: int = 1) -> P:
  """Shard `expert_axis` over ("expert", "fsdp") when given and expert * fsdp divides it
  (over "fsdp" alone without an expert axis); else the largest evenly divisible dim
  (skipping a leading layer axis when `stacked`) over fsdp, and over the expert axis too
  where there is one (fsdp x expert ways, else fsdp alone); else replicate."""
  spec = [None] * len(shape)
  if expert_axis is not None and expert > 1:
    if shape[expert_axis] % (expert * fsdp):
      raise ValueError(f"{shape[expert_axis]} experts do not split over expert={expert} x "
                       f"fsdp={fsdp} devices")
    spec[expert_axis] = ("expert", "fsdp") if fsdp > 1 else "expert"
    return P(*spec)
  if expert_axis is not None and fsdp > 1 and shape[expert_axis] % fsdp == 0:
    spec[expert_axis] = "fsdp"
    return P(*spec)
  first = 1 if stacked else 0
  dims = sorted(range(first, len(shape)), key=lambda d: -shape[d])
  ways = [(fsdp * expert, ("fsdp", "expert"))] if expert > 1 else []
  ways += [(fsdp, "fsdp")]
  for n, axes in ways:
    if n == 1:
      continue
    for d in dims:
      if shape[d] % n == 0 and shape[d] >= n:
        spec[d] = axes[1] if fsdp == 1 and isinstance(axes, tuple) else axes
        return P(*spec)
  return P()


def params_sharding(params, mesh):
  """NamedShardings for a params tree, or any tree that holds one (the train state: its
  optimizer moments sit under the same dict keys)."""
  fsdp = mesh.shape["fsdp"]
  expert = dict(mesh.shape).get("expert", 1)

  def one(path, x):
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    stacked = any(k in decoder.STACKS for k in keys)
    expert_axis = None
    if "moe" in keys and keys[-1] in EXPERT_WEIGHTS:
      expert_axis = 1 if stacked else 0
    return NamedSharding(mesh, param_spec(np.shape(x), fsdp, stacked, expert_axis,
                                                  expert))

  return jax.tree_util.tree_map_with_path(one, params)


def batch_sharding(batch, mesh):
  """[R, L, ...] fields split over rows across the whole mesh; [S] fields replicated; absent
  (None) fields stay None."""
  rows = NamedSharding(mesh, P(batch_axes(mesh)))
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
