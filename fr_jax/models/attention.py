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
* "splash_tpu": JAX's Pallas TPU splash attention
  (`jax.experimental.pallas.ops.tpu.splash_attention`, Mosaic) with segment ids and a static
  causal mask, for packed rows; GQA as one multi-query kernel per K/V head (no repetition);
  rows padded to whole 128-token blocks. Caches take the flash path. Off a TPU it runs in
  Pallas interpret mode (how it is tested here);
* "auto": on a GPU pallas_gpu, on a TPU splash_tpu, for packed rows; elsewhere (and for
  caches) naive where the query length fits one block and flash above it.
"""

from __future__ import annotations

from typing import NamedTuple

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
            backend: str | None = None) -> str:
  """The path `impl` means for queries of `query_len` tokens (packed rows, or a cache)."""
  check_attention(impl)
  if impl == "auto":
    kernel = {"gpu": "pallas_gpu", "tpu": "splash_tpu"}.get(backend or jax.default_backend())
    if kernel and packed:
      return kernel
    return "naive" if query_len <= BLOCK_Q else "flash"
  if impl in ("pallas_gpu", "splash_tpu") and not packed:
    return "flash"
  return impl


def attend(q, k, v, vis: Visibility, cd, impl: str = "auto", packed: bool = True):
  """Attention of q [B, L, H, hd] over k/v [B, S, KVH, hd] as `vis` allows, by `impl`.
  `packed`: `vis` is `packed_visibility` (q and k are the same rows). KV caches go through
  `attend_cache`."""
  path = resolve(impl, q.shape[1], packed)
  if path == "naive":
    return attention(q, k, v, dense_mask(vis), cd)
  if path == "pallas_gpu":
    return pallas_gpu_attention(q, k, v, vis.q_seg, cd)
  if path == "splash_tpu":
    return splash_tpu_attention(q, k, v, vis.q_seg, cd)
  return flash_attention(q, k, v, vis.q_idx, vis.q_seg, vis.kv_seg, cd=cd)


def attend_cache(q, k, v, positions, cd, impl: str = "auto", window=None):
  """Queries q [B, T, H, hd] at `positions` [B, T] over one layer's KV cache, keys k
  [B, KVH, hd, S] and values v [B, KVH, S, hd], each query seeing slots <= its position.
  `window` (static): only slots below it are read (every position must be < window).

  Decode (one query per row) is memory-bound on the cache: scores and outputs are fused
  multiply-reduces that read each key and value once, vectorised along the stored minor axis
  (SmolLM2 at batch 16, window 256: 163 ms per decode step, against 296 ms with the two
  attention products as batched matmuls). Short prefills take the naive path, whose matmuls
  take these layouts as stored; longer ones the flash kernel."""
  if window is not None and window < v.shape[2]:
    k, v = k[..., :window], v[:, :, :window]
  B, T, H, hd = q.shape
  kvh, S = v.shape[1], v.shape[2]
  if resolve(impl, T, packed=False) != "naive":
    vis = cache_visibility(positions, S)
    return flash_attention(q, k.transpose(0, 3, 1, 2), v.transpose(0, 2, 1, 3), vis.q_idx,
                           vis.q_seg, vis.kv_seg, cd=cd)
  visible = jnp.arange(S)[None, None, :] <= jnp.asarray(positions)[:, :, None]  # [B, T, S]
  if T == 1:  # decode: fused multiply-reduces, which also absorb the window's slice
    qh = q.reshape(B, kvh, H // kvh, hd, 1).astype(cd)
    scores = jnp.sum(qh * k.astype(cd)[:, :, None], axis=-2, dtype=F32) * (hd ** -0.5)
    scores = jnp.where(visible[:, None], scores, _NEG)  # [B, KVH, G, S]
    e = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    out = jnp.sum(e.astype(cd)[..., None] * v.astype(cd)[:, :, None], axis=-2, dtype=F32)
    return (out / jnp.sum(e, axis=-1)[..., None]).reshape(B, 1, H, hd)
  qh = q.reshape(B, T, kvh, H // kvh, hd)
  scores = jnp.einsum("btkgd,bkds->bkgts", qh.astype(cd), k.astype(cd),
                      preferred_element_type=F32) * (hd ** -0.5)
  scores = jnp.where(visible[:, None, None], scores, _NEG)
  e = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
  out = jnp.einsum("bkgts,bksd->btkgd", e.astype(cd), v.astype(cd),
                   preferred_element_type=F32)
  return out / jnp.moveaxis(jnp.sum(e, axis=-1), (1, 2), (2, 3))[..., None]


PALLAS_BLOCK = 128


def _pad_to_blocks(q, k, v, segment_ids):
  """Pad rows to whole PALLAS_BLOCKs. Padded tokens get segment -1: they see only each other
  (so no query row is empty, which both kernels require), and are cut off after."""
  L = q.shape[1]
  Lp = -(-L // PALLAS_BLOCK) * PALLAS_BLOCK
  if Lp != L:
    widths = ((0, 0), (0, Lp - L), (0, 0), (0, 0))
    q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
    segment_ids = jnp.pad(segment_ids, ((0, 0), (0, Lp - L)), constant_values=-1)
  return q, k, v, segment_ids.astype(jnp.int32)


def pallas_gpu_attention(q, k, v, segment_ids, cd, interpret: bool | None = None):
  """Packed causal attention by the Pallas GPU kernel: q [B, L, H, hd], k/v [B, L, KVH, hd],
  segment_ids [B, L] -> [B, L, H, hd] f32. Interpret mode off a GPU unless told."""
  from jax.experimental.pallas.ops.gpu import attention as pallas_mha
  B, L, H, hd = q.shape
  interpret = jax.default_backend() != "gpu" if interpret is None else interpret
  rep = H // k.shape[2]
  k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
  q, k, v, segment_ids = _pad_to_blocks(q, k, v, segment_ids)
  blocks = pallas_mha.BlockSizes(
      block_q=PALLAS_BLOCK, block_k=PALLAS_BLOCK, block_q_dkv=PALLAS_BLOCK,
      block_kv_dkv=PALLAS_BLOCK, block_q_dq=PALLAS_BLOCK, block_kv_dq=PALLAS_BLOCK)
  out = pallas_mha.mha(q.astype(cd), k.astype(cd), v.astype(cd), segment_ids,
                       sm_scale=hd ** -0.5, causal=True, block_sizes=blocks,
                       interpret=interpret)
  return out[:, :L].astype(F32)


def splash_tpu_attention(q, k, v, segment_ids, cd, interpret: bool | None = None):
  """Packed causal attention by the Pallas TPU splash kernel: q [B, L, H, hd],
  k/v [B, L, KVH, hd], segment_ids [B, L] -> [B, L, H, hd] f32. Each K/V head runs one
  multi-query kernel over its group of query heads. Interpret mode off a TPU unless told."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  B, L, H, hd = q.shape
  kvh = k.shape[2]
  interpret = jax.default_backend() != "tpu" if interpret is None else interpret
  q, k, v, segment_ids = _pad_to_blocks(q * (hd ** -0.5), k, v, segment_ids)
  Lp = q.shape[1]
  block = next(b for b in (512, 256, PALLAS_BLOCK) if Lp % b == 0)
  blocks = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                         block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                         block_q_dq=block, block_kv_dq=block)
  group = H // kvh
  mask = sm.MultiHeadMask([sm.CausalMask((Lp, Lp))] * group)
  kernel = sk.make_splash_mqa_single_device(mask, block_sizes=blocks, interpret=interpret)
  # [B, KVH, group, Lp, hd] queries; [B, KVH, Lp, hd] keys and values
  qh = q.reshape(B, Lp, kvh, group, hd).transpose(0, 2, 3, 1, 4).astype(cd)
  kh, vh = (x.transpose(0, 2, 1, 3).astype(cd) for x in (k, v))
  one = lambda q1, k1, v1, seg: kernel(q1, k1, v1, segment_ids=sk.SegmentIds(seg, seg))  # noqa
  per_head = jax.vmap(one, in_axes=(0, 0, 0, None))
  out = jax.vmap(per_head)(qh, kh, vh, segment_ids)  # [B, KVH, group, Lp, hd]
  out = out.transpose(0, 3, 1, 2, 4).reshape(B, Lp, H, hd)
  return out[:, :L].astype(F32)
