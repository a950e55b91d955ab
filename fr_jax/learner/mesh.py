"""The (data, fsdp) device mesh and the sharding rules for parameters and packed batches.

* Packed rows are split over both axes (data parallelism across the whole mesh).
* Each parameter is split over `fsdp` along its largest dimension that divides evenly
  (never the stacked-layer axis); everything else is replicated. Optimizer state follows
  the parameter it belongs to (jit propagates the parameter shardings into optax's init).
* Per-trajectory slot arrays ([S]) are replicated: they are tiny.

The update is a jitted function with these shardings; XLA inserts the collectives, so global
quantities (B, the reward mean, metric sums) are reduced across the mesh.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")


def make_mesh(data: int = 1, fsdp: int = 1, devices=None) -> jax.sharding.Mesh:
  n = data * fsdp
  devices = list(jax.devices() if devices is None else devices)
  if n > len(devices):
    raise ValueError(f"mesh data={data} x fsdp={fsdp} needs {n} devices; "
                     f"{len(devices)} are available")
  return jax.make_mesh((data, fsdp), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2,
                       devices=devices[:n])


def param_spec(shape, fsdp: int, stacked: bool) -> P:
  """Shard the largest evenly divisible dim over fsdp (skipping a leading layer axis)."""
  if fsdp == 1 or len(shape) == 0:
    return P()
  first = 1 if stacked else 0
  dims = sorted(range(first, len(shape)), key=lambda d: -shape[d])
  for d in dims:
    if shape[d] % fsdp == 0 and shape[d] >= fsdp:
      spec = [None] * len(shape)
      spec[d] = "fsdp"
      return P(*spec)
  return P()


def params_sharding(params, mesh):
  fsdp = mesh.shape["fsdp"]

  def one(path, x):
    stacked = any(getattr(k, "key", None) == "layers" for k in path)
    return NamedSharding(mesh, param_spec(np.shape(x), fsdp, stacked))

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
