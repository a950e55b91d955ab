"""Attention for the decoder: which keys each query sees, and the paths that compute it.

`Visibility` describes the mask without materialising it: key j (at index j of the keys) is
visible to query i iff `j <= q_idx[i]` and `q_seg[i] == kv_seg[j]`. Packed rows (causal within
a segment, blocked across segments) and KV caches (slots up to the query's position) are both
this one rule. `attend` picks the path:

* "naive": scores and the [L, S] mask in full (the reference; fine for short rows);
* "flash": the blockwise online-softmax kernel of `fr_jax.models.flash`, O(L) memory;
* "auto": naive where the query length fits one block, flash above it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fr_jax.models.config import ATTENTION_IMPLS as IMPLS
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


def resolve(impl: str, query_len: int) -> str:
  """The path `impl` means for queries of `query_len` tokens."""
  if impl not in IMPLS:
    raise ValueError(f"attention={impl!r}: choose one of {IMPLS}")
  if impl == "auto":
    return "naive" if query_len <= BLOCK_Q else "flash"
  return impl


def attend(q, k, v, vis: Visibility, cd, impl: str = "auto"):
  """Attention of q [B, L, H, hd] over k/v [B, S, KVH, hd] as `vis` allows, by `impl`."""
  if resolve(impl, q.shape[1]) == "naive":
    return attention(q, k, v, dense_mask(vis), cd)
  return flash_attention(q, k, v, vis.q_idx, vis.q_seg, vis.kv_seg, cd=cd)
