"""Attention for the decoder: which keys each query sees, and the paths that compute it.

`Visibility` describes the mask without materialising it: key j (at index j of the keys) is
visible to query i iff `j <= q_idx[i]` and `q_seg[i] == kv_seg[j]`. Packed rows (causal within
a segment, blocked across segments) and KV caches (slots up to the query's position) are both
this one rule. `attend` picks the path:

* "naive": scores and the [L, S] mask in full (the reference; fine for short rows);
* "flash": the blockwise online-softmax kernel of `fr_jax.models.flash`, O(L) memory;
* "pallas_gpu": JAX's Pallas GPU flash kernel (`jax.experimental.pallas.ops.gpu.attention.mha`,
  Triton) with segment ids, for packed rows (its mask is causal by index within equal
  segment ids); GQA by repeating K/V heads; rows padded to whole 128-token blocks. Caches
  take the flash path. Off a GPU it runs in Pallas interpret mode (how it is tested here);
* "auto": on a GPU, pallas_gpu for packed rows; elsewhere naive where the query length fits
  one block and flash above it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from fr_jax.models.config import check_attention
from fr_jax.models.flash import BLOCK_Q, flash_attention

F32 = jnp.float32
_NEG = -1e30  # additive mask value (finite, so fully masked rows stay NaN-free)


class Visibility(NamedTuple):
  q_idx: jax.Array  # [B, L] int: the last key index each query may see
  q_seg: jax.Array  # [B, L] int
  kv_seg: jax.Array  # [B, S] int


def packed_visibility(segment_ids) -> Visibility:
  """Packed rows [B, L]: causal by index within a segment (segment 0, padding, included)."""
  seg = jnp.asarray(segment_ids, jnp.int32)
  idx = jnp.broadcast_to(jnp.arange(seg.shape[1], dtype=jnp.int32), seg.shape)
  return Visibility(idx, seg, seg)


def cache_visibility(positions, cache_len: int) -> Visibility:
  """Queries at `positions` [B, T] over a cache of `cache_len` slots: slots <= position."""
  pos = jnp.asarray(positions, jnp.int32)
  return Visibility(pos, jnp.zeros_like(pos), jnp.zeros((pos.shape[0], cache_len), jnp.int32))


def dense_mask(vis: Visibility):
  """[B, L, S] bool, the mask `vis` describes."""
  S = vis.kv_seg.shape[1]
  return ((jnp.arange(S)[None, None, :] <= vis.q_idx[:, :, None])
          & (vis.q_seg[:, :, None] == vis.kv_seg[:, None, :]))


def attention(q, k, v, mask, cd):
  """q [B, L, H, hd], k/v [B, S, KVH, hd], mask [B, L, S] -> [B, L, H, hd] (f32)."""
  B, L, H, hd = q.shape
  kvh = k.shape[2]
  q = q.reshape(B, L, kvh, H // kvh, hd)
  scores = jnp.einsum("blkgd,bskd->bkgls", q.astype(cd), k.astype(cd),
                      preferred_element_type=F32) * (hd ** -0.5)
  scores = jnp.where(mask[:, None, None], scores, _NEG)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgls,bskd->blkgd", probs.astype(cd), v.astype(cd),
                   preferred_element_type=F32)
  return out.reshape(B, L, H, hd)


def resolve(impl: str, query_len: int, packed: bool = True,
            backend: Optional[str] = None) -> str:
  """The path `impl` means for queries of `query_len` tokens (packed rows, or a cache)."""
  check_attention(impl)
  if impl == "auto":
    if (backend or jax.default_backend()) == "gpu" and packed:
      return "pallas_gpu"
    return "naive" if query_len <= BLOCK_Q else "flash"
  if impl == "pallas_gpu" and not packed:
    return "flash"
  return impl


def attend(q, k, v, vis: Visibility, cd, impl: str = "auto", packed: bool = True):
  """Attention of q [B, L, H, hd] over k/v [B, S, KVH, hd] as `vis` allows, by `impl`.
  `packed`: `vis` is `packed_visibility` (q and k are the same rows)."""
  path = resolve(impl, q.shape[1], packed)
  if path == "naive":
    return attention(q, k, v, dense_mask(vis), cd)
  if path == "pallas_gpu":
    return pallas_gpu_attention(q, k, v, vis.q_seg, cd)
  return flash_attention(q, k, v, vis.q_idx, vis.q_seg, vis.kv_seg, cd=cd)


PALLAS_BLOCK = 128


def pallas_gpu_attention(q, k, v, segment_ids, cd, interpret: Optional[bool] = None):
  """Packed causal attention by the Pallas GPU kernel: q [B, L, H, hd], k/v [B, L, KVH, hd],
  segment_ids [B, L] -> [B, L, H, hd] f32. Interpret mode off a GPU unless told."""
  from jax.experimental.pallas.ops.gpu import attention as pallas_mha
  B, L, H, hd = q.shape
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  rep = H // k.shape[2]
  k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
  Lp = -(-L // PALLAS_BLOCK) * PALLAS_BLOCK
  if Lp != L:  # padded tokens get segment -1: they see only each other, and are cut off
    widths = ((0, 0), (0, Lp - L), (0, 0), (0, 0))
    q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
    segment_ids = jnp.pad(segment_ids, ((0, 0), (0, Lp - L)), constant_values=-1)
  blocks = pallas_mha.BlockSizes(
      block_q=PALLAS_BLOCK, block_k=PALLAS_BLOCK, block_q_dkv=PALLAS_BLOCK,
      block_kv_dkv=PALLAS_BLOCK, block_q_dq=PALLAS_BLOCK, block_kv_dq=PALLAS_BLOCK)
  out = pallas_mha.mha(q.astype(cd), k.astype(cd), v.astype(cd), segment_ids.astype(jnp.int32),
                       sm_scale=hd ** -0.5, causal=True, block_sizes=blocks,
                       interpret=interpret)
  return out[:, :L].astype(F32)
