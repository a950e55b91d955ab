"""Grouped matrix multiplication for the MoE experts, as Pallas-Triton kernels that never
build an expert-fold operand.

`gmm(lhs, rhs, group_sizes)` is `jax.lax.ragged_dot`'s contract: lhs [M, K] holds G groups of
consecutive rows (group g has `group_sizes[g]` rows, in order), rhs [G, K, N] one matrix per
group, and row r of the result [M, N] is lhs[r] @ rhs[g(r)]; rows past the last group are 0.
jax 0.10.2's XLA:GPU rewrites `ragged_dot` into one dense dot over all groups (a masked
[M, G*K] operand: docs/scale.md, "GPUs"); these kernels touch each row once per output
block instead:

* `gmm` (forward; the input gradient is `gmm` against rhs transposed): the rows are cut into
  tiles of `TM` rows that never cross a group boundary, at most cdiv(M, TM) + G + 1 of them
  (a static bound: each group adds at most one partial tile, and the rows past the groups
  are one more "group" whose tiles store zeros). Program (t, j) multiplies tile t by block
  j of its group's matrix, looping over K in `TK` steps, and stores its rows alone.
* `tgmm` (the weight gradient, [G, K, N] = lhs_g^T @ dy_g for every group): program
  (g, i, j) loops over group g's rows in `TM` steps; an empty group stores zeros.

Both accumulate in float32. Every load and store is masked to its tile's rows and to K and
N, so neither the rows nor the weights need padding. `gmm` is differentiable
(`jax.custom_vjp`) in lhs and rhs, not in the group sizes.

Where it runs: the kernel is picked at lowering by the platform compiled for
(`jax.lax.platform_dependent`), not by the process's default backend: Triton on CUDA and ROCm
(a deviceless compile for GPU nodes from this CPU gets the Triton custom calls), Pallas
interpret mode anywhere else (how it is tested here, against `ragged_dot` and a dense
per-expert reference).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32
TM, TK, TN = 64, 64, 128  # rows, contraction, and output columns per block (upper bounds)
NUM_WARPS = 4
NUM_STAGES = 3


def _block(dim: int, cap: int) -> int:
  """A power of two between 16 (Triton's smallest dot) and `cap`, no larger than needed."""
  return max(16, min(cap, 1 << max(0, dim - 1).bit_length()))


def _cdiv(a, b):
  return (a + b - 1) // b


def num_tiles(m: int, groups: int, tm: int = TM) -> int:
  """The static bound on `gmm`'s row tiles (module doc)."""
  return _cdiv(m, tm) + groups + 1


def tiles(group_sizes, m: int, tm: int):
  """Row tiles for `gmm`: (group, first row, end row) of each of `num_tiles` tiles, int32.
  Group G (one past the last) is the rows past the groups; unused tiles are empty (m, m)."""
  G = group_sizes.shape[0]
  sizes = group_sizes.astype(jnp.int32)
  sizes = jnp.concatenate([sizes, jnp.maximum(m - jnp.sum(sizes), 0)[None]])
  starts, ends = group_bounds(sizes)
  per_group = _cdiv(sizes, tm)
  tile_end = jnp.cumsum(per_group)
  t = jnp.arange(num_tiles(m, G, tm), dtype=jnp.int32)
  g = jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32)
  used = g <= G
  gc = jnp.minimum(g, G)
  first = starts[gc] + (t - (tile_end[gc] - per_group[gc])) * tm
  end = jnp.minimum(first + tm, ends[gc])
  return gc, jnp.where(used, first, m), jnp.where(used, end, m)


def group_bounds(group_sizes):
  """(first row, end row) of each group, int32 [G]."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  return ends - group_sizes.astype(jnp.int32), ends


def _gmm_kernel(group_ref, first_ref, end_ref, lhs_ref, rhs_ref, out_ref, *, tm, tk, tn,
                groups, transpose_rhs):
  t, j = pl.program_id(0), pl.program_id(1)
  g, r0, r1 = group_ref[t], first_ref[t], end_ref[t]
  K = lhs_ref.shape[1]
  N = out_ref.shape[1]
  rows = (r0 + jnp.arange(tm)) < r1
  c0 = j * tn
  cols = (c0 + jnp.arange(tn)) < N
  gw = jnp.minimum(g, groups - 1)  # group G (the rows past the groups) reads no weights

  def body(i, acc):
    k0 = i * tk
    ks = (k0 + jnp.arange(tk)) < K
    x = plgpu.load(lhs_ref.at[pl.ds(r0, tm), pl.ds(k0, tk)], mask=rows[:, None] & ks[None, :],
                   other=0)
    if transpose_rhs:  # rhs [G, N, K]
      w = plgpu.load(rhs_ref.at[gw, pl.ds(c0, tn), pl.ds(k0, tk)],
                     mask=cols[:, None] & ks[None, :], other=0)
      dims = (((1,), (1,)), ((), ()))
    else:  # rhs [G, K, N]
      w = plgpu.load(rhs_ref.at[gw, pl.ds(k0, tk), pl.ds(c0, tn)],
                     mask=ks[:, None] & cols[None, :], other=0)
      dims = (((1,), (0,)), ((), ()))
    return acc + jax.lax.dot_general(x, w, dims, preferred_element_type=F32)

  work = ((g < groups) & (r1 > r0)).astype(jnp.int32)  # int32, as the loop's other bounds
  steps = work * jnp.int32(_cdiv(K, tk))
  acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((tm, tn), F32))
  plgpu.store(out_ref.at[pl.ds(r0, tm), pl.ds(c0, tn)], acc.astype(out_ref.dtype),
              mask=rows[:, None] & cols[None, :])


def _tgmm_kernel(first_ref, end_ref, lhs_ref, dy_ref, out_ref, *, tm, tk, tn):
  g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  r0, r1 = first_ref[g], end_ref[g]
  K, N = lhs_ref.shape[1], dy_ref.shape[1]
  k0, c0 = i * tk, j * tn
  ks = (k0 + jnp.arange(tk)) < K
  cols = (c0 + jnp.arange(tn)) < N

  def body(s, acc):
    start = r0 + s * tm
    rows = (start + jnp.arange(tm)) < r1
    x = plgpu.load(lhs_ref.at[pl.ds(start, tm), pl.ds(k0, tk)],
                   mask=rows[:, None] & ks[None, :], other=0)
    dy = plgpu.load(dy_ref.at[pl.ds(start, tm), pl.ds(c0, tn)],
                    mask=rows[:, None] & cols[None, :], other=0)
    return acc + jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())),
                                     preferred_element_type=F32)

  acc = jax.lax.fori_loop(0, _cdiv(r1 - r0, tm), body, jnp.zeros((tk, tn), F32))
  plgpu.store(out_ref.at[g, pl.ds(k0, tk), pl.ds(c0, tn)], acc.astype(out_ref.dtype),
              mask=ks[:, None] & cols[None, :])


def _on_platform(fn, *args):
  """fn(*args, interpret=...) with Triton where the program is lowered for a GPU, Pallas
  interpret mode elsewhere: decided at lowering (module doc)."""
  triton = functools.partial(fn, interpret=False)
  return jax.lax.platform_dependent(*args, cuda=triton, rocm=triton,
                                    default=functools.partial(fn, interpret=True))


def _gmm_call(lhs, rhs, group_sizes, *, out_dtype, transpose_rhs, interpret):
  M, K = lhs.shape
  G = rhs.shape[0]
  N = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  tm, tk, tn = _block(M, TM), _block(K, TK), _block(N, TN)
  group, first, end = tiles(group_sizes, M, tm)
  kernel = functools.partial(_gmm_kernel, tm=tm, tk=tk, tn=tn, groups=G,
                             transpose_rhs=transpose_rhs)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((M, N), out_dtype),
      grid=(group.shape[0], _cdiv(N, tn)), interpret=interpret, name="fr_jax_gmm",
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
  )(group, first, end, lhs, rhs)


def _tgmm_call(lhs, dy, group_sizes, *, out_dtype, interpret):
  (M, K), N = lhs.shape, dy.shape[1]
  G = group_sizes.shape[0]
  tm, tk, tn = _block(M, TM), _block(K, TK), _block(N, TN)
  first, end = group_bounds(group_sizes)
  kernel = functools.partial(_tgmm_kernel, tm=tm, tk=tk, tn=tn)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((G, K, N), out_dtype),
      grid=(G, _cdiv(K, tk), _cdiv(N, tn)), interpret=interpret, name="fr_jax_tgmm",
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
  )(first, end, lhs, dy)


def tgmm(lhs, dy, group_sizes, out_dtype=F32):
  """[G, K, N]: lhs_g^T @ dy_g for each group g of lhs [M, K] and dy [M, N]."""
  return _on_platform(functools.partial(_tgmm_call, out_dtype=out_dtype), lhs, dy,
                      group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gmm(lhs, rhs, group_sizes, out_dtype=F32):
  """[M, N]: each group of lhs [M, K] times its matrix of rhs [G, K, N] (module doc)."""
  return _on_platform(functools.partial(_gmm_call, out_dtype=out_dtype, transpose_rhs=False),
                      lhs, rhs, group_sizes)


def _gmm_fwd(lhs, rhs, group_sizes, out_dtype):
  return gmm(lhs, rhs, group_sizes, out_dtype), (lhs, rhs, group_sizes)


def _gmm_bwd(out_dtype, res, dy):
  lhs, rhs, group_sizes = res
  dy = dy.astype(lhs.dtype)  # the matmuls' dtype, as the forward's operands
  dlhs = _on_platform(functools.partial(_gmm_call, out_dtype=lhs.dtype, transpose_rhs=True),
                      dy, rhs, group_sizes)
  drhs = tgmm(lhs, dy, group_sizes, out_dtype=rhs.dtype)
  return dlhs, drhs, None


gmm.defvjp(_gmm_fwd, _gmm_bwd)
