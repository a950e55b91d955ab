"""Token sampling with exact log-probs, and jitted KV-cache prefill / decode primitives
(the rollout engine, `fr_jax.rollout.embedded`, builds continuous batching on the same model
functions).

Behaviour log-probs describe the distribution that actually sampled: softmax(logits / T),
and with top_p < 1 the renormalised truncated distribution (the nucleus). Greedy decoding
(temperature 0) reports log_softmax(logits) of the chosen token, the model's own
distribution, since the argmax "distribution" would give 0 for every token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fr_jax.models import decoder
from fr_jax.models.config import ModelConfig

F32 = jnp.float32


def sampling_logprobs(logits, temperature, top_p):
  """Log-probs [B, V] of the sampling distribution (and -inf outside the nucleus).

  logits [B, V]; temperature, top_p: [B] or scalars. Temperature <= 0 means greedy and
  returns log_softmax(logits).
  """
  logits = logits.astype(F32)
  B = logits.shape[0]
  temperature = jnp.broadcast_to(jnp.asarray(temperature, F32), (B,))
  top_p = jnp.broadcast_to(jnp.asarray(top_p, F32), (B,))
  t = jnp.where(temperature > 0, temperature, 1.0)
  logp = jax.nn.log_softmax(logits / t[:, None], axis=-1)

  def nucleus(logp):
    srt = -jnp.sort(-logp, axis=-1)
    probs = jnp.exp(srt)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
    keep_sorted = before < top_p[:, None]
    # The smallest kept log-prob is the threshold; ties at it are kept too.
    thresh = jnp.min(jnp.where(keep_sorted, srt, jnp.inf), axis=-1, keepdims=True)
    keep = (logp >= thresh) | (top_p[:, None] >= 1.0)
    kept = jnp.where(keep, logp, -jnp.inf)
    return kept - jax.nn.logsumexp(kept, axis=-1, keepdims=True)

  return jax.lax.cond(jnp.all(top_p >= 1.0), lambda x: x, nucleus, logp)


def _inverse_cdf(key, logq):
  """One draw from exp(logq) [V] with one uniform: the first index whose cumulative mass
  exceeds u (cheaper than Gumbel-max, which needs V random numbers)."""
  cdf = jnp.cumsum(jnp.exp(logq))
  u = jax.random.uniform(key, (), F32) * cdf[-1]
  return jnp.minimum(jnp.sum(cdf <= u), logq.shape[-1] - 1)


def sample(logits, key, temperature, top_p):
  """Samples one token per row. Returns (tokens [B] int32, logp [B] float32).

  `key` is one key for the whole batch, or [B] keys (one per row: a row's draw then does not
  depend on the other rows, which is what the rollout engine needs).
  """
  B = logits.shape[0]
  temperature = jnp.broadcast_to(jnp.asarray(temperature, F32), (B,))
  logq = sampling_logprobs(logits, temperature, top_p)  # batched: one nucleus sort at most
  keys = jax.random.split(key, B) if jnp.ndim(key) == 0 else key
  drawn = jax.vmap(_inverse_cdf)(keys, logq)
  tok = jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
  return tok, jnp.take_along_axis(logq, tok[:, None], axis=-1)[:, 0]


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def prefill(params, cfg: ModelConfig, cache, tokens, lengths):
  """Writes prompts [B, P] (right-padded, true lengths [B]) into the cache from position 0.
  Returns (logits [B, V] at each row's last prompt token, cache)."""
  B, P = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
  h, cache = decoder.forward(params, cfg, tokens, positions, cache=cache)
  last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
  return decoder.logits_from_hidden(params, cfg, last), cache


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def decode_step(params, cfg: ModelConfig, cache, tokens, positions):
  """One token per row: tokens [B] at positions [B]. Returns (logits [B, V], cache)."""
  h, cache = decoder.forward(params, cfg, tokens[:, None], positions[:, None], cache=cache)
  return decoder.logits_from_hidden(params, cfg, h[:, 0]), cache
