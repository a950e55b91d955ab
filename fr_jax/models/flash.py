"""Flash-style attention over packed segments, in plain JAX (any backend).

Queries and keys are processed in blocks with an online softmax, so no [L, S] array (mask,
scores or probabilities) is ever materialised: memory is O(L) per head, not O(L^2). The mask
is computed per block from two integer vectors:

  key j is visible to query i  <=>  j <= q_idx[i]  and  q_seg[i] == kv_seg[j]

where keys sit at indices 0..S-1. Packed rows use q_idx = arange(L) and kv_seg = q_seg (causal
within a segment, blocked across segments); a KV cache uses q_idx = the query's position and
one segment. Key blocks entirely after a query block's last index are skipped, so packed
causal rows do about half the work of full attention.

The backward is a custom VJP that recomputes each block's probabilities from the saved
log-sum-exp (the FlashAttention-2 recurrences): it stores O, the LSE and the inputs, never
the probabilities. Every query row sees at least one key (its own index, for packed rows and
caches alike); a row that sees nothing (padding added here) gets 0 and a zero gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32
_NEG = -1e30
BLOCK_Q = 256
BLOCK_K = 256


def flash_attention(q, k, v, q_idx, q_seg, kv_seg, *, cd=F32, block_q: int = BLOCK_Q,
                    block_k: int = BLOCK_K):
  """q [B, L, H, hd], k/v [B, S, KVH, hd] (H a multiple of KVH), q_idx/q_seg [B, L],
  kv_seg [B, S] (ints) -> [B, L, H, hd] in float32. Matmul inputs are cast to `cd` and
  accumulate in float32; the softmax is float32."""
  B, L, H, hd = q.shape
  S, kvh = k.shape[1], k.shape[2]
  bq, bk = min(block_q, L), min(block_k, S)
  Lp, Sp = -(-L // bq) * bq, -(-S // bk) * bk
  # Pad to whole blocks: padded keys get segment -1 (no query has it) and padded queries
  # segment -2 (no key has it): they see nothing, give 0, and are cut off at the end.
  q = _pad(q, Lp)
  q_idx = _pad(jnp.asarray(q_idx, jnp.int32), Lp, fill=0)
  q_seg = _pad(jnp.asarray(q_seg, jnp.int32), Lp, fill=-2)
  k, v = _pad(k, Sp), _pad(v, Sp)
  kv_seg = _pad(jnp.asarray(kv_seg, jnp.int32), Sp, fill=-1)
  qg = q.reshape(B, Lp, kvh, H // kvh, hd)
  out = _flash(qg, k, v, q_idx, q_seg, kv_seg, cd, bq, bk)
  return out.reshape(B, Lp, H, hd)[:, :L]


def _pad(x, n, fill=0):
  if x.shape[1] == n:
    return x
  widths = [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
  return jnp.pad(x, widths, constant_values=fill)


def _blocks(x, b):
  """[B, N, ...] -> [N // b, B, b, ...] (block-major, for scan)."""
  return jnp.moveaxis(x.reshape(x.shape[0], x.shape[1] // b, b, *x.shape[2:]), 1, 0)


def _unblocks(x):
  """Inverse of _blocks."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _scores(qb, kb, qi, qs, ks, kstart, cd, scale):
  """Masked scores [B, KVH, G, bq, bk] (f32) of one query block against one key block."""
  s = jnp.einsum("bqkgd,bskd->bkgqs", qb.astype(cd), kb.astype(cd),
                 preferred_element_type=F32) * scale
  kidx = kstart + jnp.arange(kb.shape[1])
  vis = (kidx[None, None, :] <= qi[:, :, None]) & (qs[:, :, None] == ks[:, None, :])
  return jnp.where(vis[:, None, None], s, _NEG), vis


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash(q, k, v, q_idx, q_seg, kv_seg, cd, bq, bk):
  return _flash_fwd(q, k, v, q_idx, q_seg, kv_seg, cd, bq, bk)[0]


def _flash_fwd(q, k, v, q_idx, q_seg, kv_seg, cd, bq, bk):
  B, Lp, kvh, G, hd = q.shape
  nk = k.shape[1] // bk
  scale = hd ** -0.5
  kB, vB, ksB = _blocks(k, bk), _blocks(v, bk), _blocks(kv_seg, bk)

  def q_block(_, xs):
    qb, qi, qs = xs
    m0 = jnp.full((B, kvh, G, bq), _NEG, F32)
    acc0 = jnp.zeros((B, kvh, G, bq, hd), F32)

    def k_block(j, c):
      m, denom, acc = c
      s, vis = _scores(qb, kB[j], qi, qs, ksB[j], j * bk, cd, scale)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.where(vis[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
      corr = jnp.exp(m - m_new)
      denom = denom * corr + p.sum(-1)
      acc = acc * corr[..., None] + jnp.einsum("bkgqs,bskd->bkgqd", p.astype(cd),
                                               vB[j].astype(cd), preferred_element_type=F32)
      return m_new, denom, acc

    # The key blocks the query block needs: those starting at or before its largest index.
    n_needed = jnp.minimum(nk, jnp.max(qi) // bk + 1)
    m, denom, acc = jax.lax.fori_loop(0, n_needed, k_block, (m0, jnp.zeros_like(m0), acc0))
    seen = denom > 0  # a query that sees no key (only padding does) gets 0, not NaN
    o = acc / jnp.where(seen, denom, 1.0)[..., None]
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), 0.0)
    return None, (jnp.moveaxis(o, 3, 1), jnp.moveaxis(lse, 3, 1))  # [B, bq, KVH, G, ...]

  _, (o, lse) = jax.lax.scan(q_block, None, (_blocks(q, bq), _blocks(q_idx, bq),
                                             _blocks(q_seg, bq)))
  o, lse = _unblocks(o), _unblocks(lse)  # [B, Lp, KVH, G, hd], [B, Lp, KVH, G]
  return o, (q, k, v, q_idx, q_seg, kv_seg, o, lse)


def _flash_bwd(cd, bq, bk, res, do):
  q, k, v, q_idx, q_seg, kv_seg, o, lse = res
  B, Lp, kvh, G, hd = q.shape
  nq, nk = Lp // bq, k.shape[1] // bk
  scale = hd ** -0.5
  delta = jnp.sum(do * o, axis=-1)  # [B, Lp, KVH, G]
  qB, doB = _blocks(q, bq), _blocks(do, bq)
  qiB, qsB = _blocks(q_idx, bq), _blocks(q_seg, bq)
  lseB, dB = _blocks(lse, bq), _blocks(delta, bq)
  # The first query block that can see key block j: q_idx rises with the query index in
  # packed rows and caches alike, so the blocks before it see none of j's keys.
  q_blk_max = jnp.max(qiB, axis=(1, 2))  # [nq]

  def k_block(dq, xs):
    j, kb, vb, ks = xs
    first = jnp.argmax(q_blk_max >= j * bk)  # no such block: argmax 0, masks do the rest

    def q_block(i, c):
      dq, dk, dv = c
      qb, qi, qs = qB[i], qiB[i], qsB[i]
      s, vis = _scores(qb, kb, qi, qs, ks, j * bk, cd, scale)
      lse_i = jnp.moveaxis(lseB[i], 1, 3)  # [B, KVH, G, bq]
      p = jnp.where(vis[:, None, None], jnp.exp(s - lse_i[..., None]), 0.0)
      do_i = doB[i]
      dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(cd), do_i.astype(cd),
                           preferred_element_type=F32)
      dp = jnp.einsum("bqkgd,bskd->bkgqs", do_i.astype(cd), vb.astype(cd),
                      preferred_element_type=F32)
      ds = p * (dp - jnp.moveaxis(dB[i], 1, 3)[..., None]) * scale
      dq_i = jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(cd), kb.astype(cd),
                        preferred_element_type=F32)
      dq = jax.lax.dynamic_update_index_in_dim(dq, dq[i] + dq_i, i, 0)
      dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(cd), qb.astype(cd),
                           preferred_element_type=F32)
      return dq, dk, dv

    zero = jnp.zeros((B, bk, kvh, hd), F32)
    dq, dk, dv = jax.lax.fori_loop(first, nq, q_block, (dq, zero, zero))
    return dq, (dk, dv)

  dq0 = jnp.zeros((nq, B, bq, kvh, G, hd), F32)
  dq, (dk, dv) = jax.lax.scan(k_block, dq0, (jnp.arange(nk), _blocks(k, bk), _blocks(v, bk),
                                             _blocks(kv_seg, bk)))
  return (_unblocks(dq).astype(q.dtype), _unblocks(dk).astype(k.dtype),
          _unblocks(dv).astype(v.dtype), None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
