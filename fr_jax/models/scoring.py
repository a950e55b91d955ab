"""What the learner needs from the model: log-probs of targets and the entropy of
softmax(logits / temperature), from a packed forward (`score_packed`) or from hidden states
(`score_hidden`, chunked so the [tokens, vocab] logits never exist whole).

`score_packed` with `action_index` [R, K] runs the LM head on those K positions of each row
only (the positions whose log-probs the objective reads: `fr_jax.packing`); the others get 0.
At the named positions the values, and so every gradient through them, are the full head's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fr_jax.models.config import ModelConfig
from fr_jax.models.decoder import F32, Params, forward, unembed


def _score_chunk(w, cd, temperature, h, t):
  z = jnp.einsum("nd,vd->nv", h.astype(cd), w.astype(cd), preferred_element_type=F32)
  z = z / temperature
  lse = jax.nn.logsumexp(z, axis=-1)
  logp = jnp.take_along_axis(z, t[:, None], axis=-1)[:, 0] - lse
  p = jnp.exp(z - lse[:, None])
  entropy = lse - jnp.sum(p * z, axis=-1)
  return logp, entropy


LOGITS_BUDGET = 2**27  # float32 logits held at once by scoring (512 MiB)


def score_hidden(params: Params, cfg: ModelConfig, hidden, targets, temperature=1.0,
                 chunk_size: int | str | None = "auto"):
  """Log-probs of `targets` under softmax(logits / temperature), and the entropy of that
  distribution, from hidden states [..., D] and targets [...]. Returns float32 [...] each.

  With chunking, logits are built `chunk_size` tokens at a time and recomputed in the
  backward pass, so the [tokens, vocab] matrix never exists whole. "auto" chunks only when
  the whole matrix would exceed LOGITS_BUDGET elements; None never chunks.
  """
  if chunk_size == "auto":
    chunk_size = max(256, LOGITS_BUDGET // cfg.vocab_size)
  if not isinstance(temperature, jax.Array) and temperature <= 0:
    raise ValueError(f"temperature={temperature}: scoring needs temperature > 0")
  cd = jnp.dtype(cfg.compute_dtype)
  w = unembed(params)
  lead = targets.shape
  h = hidden.reshape(-1, hidden.shape[-1])
  t = targets.reshape(-1)
  N = h.shape[0]
  if chunk_size is None or N <= chunk_size:
    logp, ent = _score_chunk(w, cd, temperature, h, t)
    return logp.reshape(lead), ent.reshape(lead)
  n_chunks = -(-N // chunk_size)
  pad = n_chunks * chunk_size - N
  h = jnp.pad(h, ((0, pad), (0, 0))).reshape(n_chunks, chunk_size, -1)
  t = jnp.pad(t, (0, pad)).reshape(n_chunks, chunk_size)
  fn = jax.checkpoint(lambda xs: _score_chunk(w, cd, temperature, *xs))
  logp, ent = jax.lax.map(fn, (h, t))
  return logp.reshape(-1)[:N].reshape(lead), ent.reshape(-1)[:N].reshape(lead)


def score_packed(params: Params, cfg: ModelConfig, tokens, targets, positions, segment_ids,
                 temperature=1.0, *, remat=False, chunk_size: int | str | None = "auto",
                 routes=None, routing_out: bool = False, action_index=None):
  """Learner scoring on a packed batch: (logp, entropy), each float32 [R, L]; with
  `routing_out`, (logp, entropy, Routing). `routes`: replayed experts (see `decoder.forward`).
  `action_index` int [R, K], distinct positions per row: only those are scored (0 elsewhere)."""
  h, _, routing = forward(params, cfg, tokens, positions, segment_ids, remat=remat,
                          routes=routes, routing_out=True)
  targets = jnp.asarray(targets)
  if action_index is None:
    logp, ent = score_hidden(params, cfg, h, targets, temperature, chunk_size)
  else:
    idx = jnp.asarray(action_index)
    picked = score_hidden(params, cfg, jnp.take_along_axis(h, idx[..., None], axis=1),
                          jnp.take_along_axis(targets, idx, axis=1), temperature, chunk_size)
    rows = jnp.arange(idx.shape[0])[:, None]
    logp, ent = (jnp.zeros(targets.shape, F32).at[rows, idx].set(x, unique_indices=True)
                 for x in picked)
  return (logp, ent, routing) if routing_out else (logp, ent)
