"""Qwen3-MoE's mixture of experts: a sparse layer's feed-forward (`moe_block`: a router, top-k
of E SwiGLU experts, or the replayed ones) and what the routers did (`LayerRouting` per layer,
pooled by `assemble_routing` into one `Routing` with the load-balancing loss).

`ModelConfig.moe_impl` picks how the experts run. Under a device mesh they run per shard,
gathered over the mesh axis the caller names (`ModelConfig.expert_shard_axis`), and with
expert parallelism (`ModelConfig.expert_parallel_axis`) the tokens are sent to the experts;
model code names no mesh axis itself. `fr_jax.models.decoder` holds the weights and calls
this module.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fr_jax.models import gmm
from fr_jax.models.config import ModelConfig

F32 = jnp.float32


def moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """A sparse layer's router and stacked experts."""
  D, E, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  return {"router": (D, E), "experts_gate": (E, D, F), "experts_up": (E, D, F),
          "experts_down": (E, F, D)}


class LayerRouting(NamedTuple):
  """What one sparse layer's router did, over a [B, L] block of positions."""

  experts: jax.Array  # int32 [B, L, k]: the experts each position used
  drift: jax.Array  # bool [B, L]: the router's own top-k is not the replayed set
  counts: jax.Array  # f32 [E]: selections of each expert by valid positions
  prob_sum: jax.Array  # f32 [E]: router probability of each expert summed over valid positions
  dropped: jax.Array  # f32 []: (position, expert) pairs over expert parallelism's capacity
  #                     (`ModelConfig.moe_capacity_factor`; 0 when dropless), whole mesh


def _experts_dense(cfg: ModelConfig, x, mp, idx, w):
  """Every expert on every position, unselected ones weighted by zero: the reference path."""
  cd = jnp.dtype(cfg.compute_dtype)
  xc = x.astype(cd)
  g = jnp.einsum("bld,edf->blef", xc, mp["experts_gate"].astype(cd), preferred_element_type=F32)
  u = jnp.einsum("bld,edf->blef", xc, mp["experts_up"].astype(cd), preferred_element_type=F32)
  y = jnp.einsum("blef,efd->bled", (jax.nn.silu(g) * u).astype(cd),
                 mp["experts_down"].astype(cd), preferred_element_type=F32)
  combine = jnp.sum(jax.nn.one_hot(idx, cfg.num_experts, dtype=F32) * w[..., None], axis=-2)
  return jnp.einsum("ble,bled->bld", combine, y)


def _ragged_dot(lhs, rhs, sizes):
  return jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=F32)


def _auto_dot(lhs, rhs, sizes):
  """The grouped kernel where the program is lowered for a GPU (XLA:GPU expands `ragged_dot`
  densely: docs/scale.md, "GPUs"), `ragged_dot` elsewhere (TPU and CPU lower it grouped)."""
  return jax.lax.platform_dependent(lhs, rhs, sizes, cuda=gmm.gmm, rocm=gmm.gmm,
                                    default=_ragged_dot)


GROUPED = {"ragged": _ragged_dot, "gmm": gmm.gmm, "auto": _auto_dot}


def _swiglu_groups(cfg: ModelConfig, src, src_index, ids, mp, groups: int):
  """SwiGLU expert outputs [M, D] for M rows src[src_index] [M, D] whose experts are ids [M]
  (of `groups` experts in mp; an id >= groups is padding: its output is zero). The rows are
  sorted by expert and every expert multiplies its contiguous group (the grouped matmul
  `cfg.moe_impl` names: `jax.lax.ragged_dot`, or `fr_jax.models.gmm`'s kernels; both leave
  rows past the last group zero), then go back to their places."""
  cd = jnp.dtype(cfg.compute_dtype)
  matmul = GROUPED[cfg.moe_impl]
  order = jnp.argsort(ids, stable=True)
  xs = src[src_index[order]].astype(cd)
  sizes = jnp.bincount(ids, length=groups).astype(jnp.int32)  # padding ids are dropped

  def grouped(lhs, w):
    return matmul(lhs, w.astype(cd), sizes)

  a = jax.nn.silu(grouped(xs, mp["experts_gate"])) * grouped(xs, mp["experts_up"])
  return grouped(a.astype(cd), mp["experts_down"])[jnp.argsort(order)]


def _experts_grouped(cfg: ModelConfig, x, mp, idx, w):
  """Each (position, chosen expert) pair once, through `_swiglu_groups`, then summed per
  position with the gate weights."""
  B, L, D = x.shape
  k = idx.shape[-1]
  pairs = jnp.arange(B * L * k) // k  # pair p is position p // k's slot p % k
  ys = _swiglu_groups(cfg, x.reshape(-1, D), pairs, idx.reshape(-1), mp, cfg.num_experts)
  return jnp.einsum("blkd,blk->bld", ys.reshape(B, L, k, D), w)


def ep_capacity(cfg: ModelConfig, pairs: int, ep: int) -> int:
  """Slots per rank in expert parallelism's buffers for a device's `pairs` pairs: all of
  them (dropless) unless `cfg.moe_capacity_factor` c > 0 asks for ceil(c * pairs / ep)."""
  if cfg.moe_capacity_factor <= 0:
    return pairs
  return min(pairs, math.ceil(cfg.moe_capacity_factor * pairs / ep))


def _experts_dispatched(cfg: ModelConfig, x, mp, idx, w, axis: str, ep: int):
  """Expert parallelism, per device under shard_map: this device holds the local experts
  [E / ep, ...] of its rank r on mesh axis `axis` (experts r * E / ep onward) and its own
  rows x [B, L, D]. Each of its N = B * L * k (position, expert) pairs goes to the rank that
  owns the expert, is run there, and comes back.

  The all-to-alls move fixed-size buffers: [ep, C, D] out (slot [r, j]: the j-th pair bound
  for rank r) and [ep, C, D] in (slot [s, j]: rank s's j-th pair for this rank). C = N slots
  per rank (the default) is the bound that no routing can overflow (every pair to one rank),
  so nothing is dropped; the price is ep * N rows of buffer and of grouped-matmul rows (the
  padding runs as an empty tail, zero in and out). With `cfg.moe_capacity_factor` c > 0,
  C = ceil(c * N / ep): a pair past its rank's C slots is dropped (it contributes zero, as an
  unselected expert does) and counted. `jax.lax.all_to_all` has CPU, GPU and TPU lowerings;
  its transpose is the reverse all-to-all, so gradients travel back the same way. Returns
  (y [B, L, D], pairs dropped on this device)."""
  cd = jnp.dtype(cfg.compute_dtype)
  B, L, D = x.shape
  k = idx.shape[-1]
  local = cfg.num_experts // ep
  flat = idx.reshape(-1)
  N = flat.shape[0]
  dest = flat // local
  order = jnp.argsort(dest, stable=True)  # pairs grouped by destination rank
  to = dest[order]
  counts = jnp.bincount(dest, length=ep)
  slot = jnp.arange(N) - (jnp.cumsum(counts) - counts)[to]
  C = ep_capacity(cfg, N, ep)
  kept = slot < C  # a slot past C is out of bounds: the scatters drop it
  send = jnp.zeros((ep, C, D), cd).at[to, slot].set(x.reshape(-1, D)[order // k].astype(cd),
                                                     mode="drop")
  send_ids = jnp.full((ep, C), local, jnp.int32).at[to, slot].set(flat[order] % local,
                                                                  mode="drop")
  recv = jax.lax.all_to_all(send, axis, 0, 0)  # [source rank, C, D]
  recv_ids = jax.lax.all_to_all(send_ids, axis, 0, 0)
  ys = _swiglu_groups(cfg, recv.reshape(-1, D), jnp.arange(ep * C), recv_ids.reshape(-1), mp,
                      local)
  back = jax.lax.all_to_all(ys.astype(cd).reshape(ep, C, D), axis, 0, 0)  # [dest rank, C, D]
  y = jnp.where(kept[:, None], back[to, jnp.minimum(slot, C - 1)].astype(F32), 0.0)
  y = y[jnp.argsort(order)]  # pair order
  dropped = jnp.sum(~kept).astype(F32)
  return jnp.einsum("blkd,blk->bld", y.reshape(B, L, k, D), w), dropped


def _experts(cfg: ModelConfig, x, mp, idx, w):
  """The experts' weighted output [B, L, D] for positions x [B, L, D] choosing idx [B, L, k]
  with gate weights w [B, L, k], on the path `cfg.moe_impl` picks.

  Under a device mesh (the learner traces inside `jax.set_mesh`) the grouped path runs under
  `jax.shard_map` over the rows, split over every mesh axis as the learner's batches are: each
  device sorts and runs only its own rows' tokens, with the layer's experts all-gathered onto
  it over `cfg.expert_shard_axis` when the caller splits them there on the expert axis (their
  gradient comes back reduce-scattered). Left to GSPMD, the sort over all positions would
  gather every device's tokens onto every device (docs/scale.md, "Experts on the mesh").
  With `cfg.expert_parallel_axis` in the mesh the experts are split over that axis too and
  gathered over the other only; the tokens go to them (`_experts_dispatched`). Returns
  (y, the pairs dropped over expert parallelism's capacity across the mesh: 0 elsewhere)."""
  grouped = cfg.moe_impl != "dense"
  fn = _experts_grouped if grouped else _experts_dense
  mesh = jax.sharding.get_abstract_mesh()
  none = jnp.zeros((), F32)
  if not grouped or mesh.empty or mesh.size == 1 or x.shape[0] % mesh.size:
    return fn(cfg, x, mp, idx, w), none
  P = jax.sharding.PartitionSpec
  rows = P(tuple(mesh.axis_names))
  experts = {k: mp[k] for k in ("experts_gate", "experts_up", "experts_down")}
  axis, ep_axis = cfg.expert_shard_axis, cfg.expert_parallel_axis
  ep = mesh.shape[ep_axis] if ep_axis in mesh.axis_names else 1
  if ep > 1 and cfg.num_experts % ep:
    raise ValueError(f"{cfg.num_experts} experts do not split over the {ep} ranks of mesh "
                     f"axis {ep_axis!r}")
  split = axis in mesh.axis_names and (cfg.num_experts // ep) % mesh.shape[axis] == 0
  spec = tuple(a for a, on in ((ep_axis, ep > 1), (axis, split)) if on)

  def local(x, idx, w, experts):
    if split:
      cd = jnp.dtype(cfg.compute_dtype)  # gathered in the matmuls' dtype: half the bytes in bf16
      experts = {k: jax.lax.all_gather(v.astype(cd), axis, axis=0, tiled=True)
                 for k, v in experts.items()}
    if ep > 1:
      y, dropped = _experts_dispatched(cfg, x, experts, idx, w, ep_axis, ep)
      return y, jax.lax.psum(dropped, tuple(mesh.axis_names))
    return fn(cfg, x, experts, idx, w), none

  return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, P(spec) if spec else P()),
                       out_specs=(rows, P()), check_vma=False)(x, idx, w, experts)


def moe_block(cfg: ModelConfig, x, mp, routes=None, valid=None):
  """A sparse layer's feed-forward on normed inputs x [B, L, D] -> (y [B, L, D],
  LayerRouting).

  The router's probabilities are softmax(x @ router) over all E experts (float32). Without
  `routes` each position takes its top-k experts, weighted by their probabilities; with
  `routes` [B, L, k] (rollout routing replay) it takes exactly those experts, weighted by the
  current router's probabilities of them. With `norm_topk_prob` the k weights are
  renormalised to sum to 1 either way. `valid` [B, L] (default all) marks the positions the
  load-balancing statistics count.
  """
  cd = jnp.dtype(cfg.compute_dtype)
  k = cfg.num_experts_per_tok
  z = jnp.einsum("...d,de->...e", x.astype(cd), mp["router"].astype(cd),
                 preferred_element_type=F32)
  probs = jax.nn.softmax(z, axis=-1)
  own_w, own = jax.lax.top_k(probs, k)
  if routes is None:
    idx, w = own, own_w
    drift = jnp.zeros(x.shape[:2], bool)
  else:
    idx = routes.astype(jnp.int32)
    w = jnp.take_along_axis(probs, idx, axis=-1)
    drift = jnp.any(jnp.sort(own, axis=-1) != jnp.sort(idx, axis=-1), axis=-1)
  if cfg.norm_topk_prob:
    w = w / jnp.sum(w, axis=-1, keepdims=True)
  y, dropped = _experts(cfg, x, mp, idx, w)
  vf = jnp.ones(x.shape[:2], F32) if valid is None else valid.astype(F32)
  counts = jnp.zeros((cfg.num_experts,), F32).at[idx.reshape(-1)].add(
      jnp.repeat(vf.reshape(-1), k))
  prob_sum = jnp.einsum("ble,bl->e", probs, vf)
  return y, LayerRouting(idx, drift, counts, prob_sum, dropped)


class Routing(NamedTuple):
  """What the routers of all sparse layers did in one forward (`forward(routing_out=True)`)."""

  experts: jax.Array  # int32 [B, L, sparse layers, k]: the experts each position used
  drift: jax.Array  # bool [B, L]: in some sparse layer, the router's own top-k differs from
  #                   the replayed experts (all False without replay)
  balance: jax.Array  # f32 []: the load-balancing loss over valid positions (below)
  dropped: jax.Array  # f32 []: pairs over expert parallelism's capacity, all sparse layers


def assemble_routing(cfg: ModelConfig, per_layer: list, shape) -> Routing:
  """Assembles per-run LayerRouting (each stacked over its layers, leading axis) into one
  Routing. balance is HF Qwen3-MoE's (Switch Transformer's) auxiliary loss, with all sparse
  layers' positions pooled: E * sum_e f_e * P_e, f_e the fraction of (position, layer, slot)
  selections that went to expert e (times k), P_e the mean router probability of e."""
  B, L = shape
  if not per_layer:
    return Routing(jnp.zeros((B, L, 0, 0), jnp.int32), jnp.zeros((B, L), bool),
                   jnp.zeros((), F32), jnp.zeros((), F32))
  experts = jnp.concatenate([r.experts for r in per_layer], axis=0)  # [n, B, L, k]
  drift = jnp.any(jnp.concatenate([r.drift for r in per_layer], axis=0), axis=0)
  counts = sum(r.counts.sum(0) for r in per_layer)
  prob_sum = sum(r.prob_sum.sum(0) for r in per_layer)
  rows = jnp.maximum(prob_sum.sum(), 1e-9)  # = valid positions x sparse layers
  balance = cfg.num_experts * jnp.sum(counts * prob_sum) / (rows * rows)
  dropped = sum(r.dropped.sum() for r in per_layer)
  return Routing(jnp.moveaxis(experts, 0, 2), drift, balance, dropped)


def stack_layer(r: LayerRouting | None):
  """One layer's routing with a leading axis of 1 (the unrolled paths)."""
  return None if r is None else jax.tree.map(lambda a: a[None], r)
