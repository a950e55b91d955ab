"""Token sampling with exact log-probs, and a simple KV-cache generation loop.

Behaviour log-probs describe the distribution that actually sampled: softmax(logits / T),
and with top_p < 1 the renormalised truncated distribution (the nucleus). Greedy decoding
(temperature 0) reports log_softmax(logits) of the chosen token, the model's own
distribution, since the argmax "distribution" would give 0 for every token.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

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


def sample(logits, key, temperature, top_p):
  """Samples one token per row. Returns (tokens [B] int32, logp [B] float32)."""
  B = logits.shape[0]
  temperature = jnp.broadcast_to(jnp.asarray(temperature, F32), (B,))
  logq = sampling_logprobs(logits, temperature, top_p)
  drawn = jax.random.categorical(key, logq, axis=-1)
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


_sample = jax.jit(sample)


def generate(params, cfg: ModelConfig, prompt_ids: Sequence[int], *, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
             stop_ids: Sequence[int] = ()) -> tuple[list[int], list[float], str]:
  """Generates from one prompt. Returns (token_ids, logprobs, finish_reason)."""
  P = len(prompt_ids)
  if P == 0:
    raise ValueError("the prompt is empty; give at least one token")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
  total = P + max_new_tokens
  if total > cfg.max_position_embeddings:
    raise ValueError(f"prompt ({P}) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                     f"model's max_position_embeddings={cfg.max_position_embeddings}")
  cache = decoder.init_cache(cfg, 1, total)
  logits, cache = prefill(params, cfg, cache, jnp.asarray([prompt_ids], jnp.int32),
                          jnp.asarray([P], jnp.int32))
  key = jax.random.key(seed)
  temp, tp = jnp.asarray([temperature], F32), jnp.asarray([top_p], F32)
  out, lps, stops = [], [], set(int(s) for s in stop_ids)
  finish = "length"
  for i in range(max_new_tokens):
    key, sub = jax.random.split(key)
    tok, lp = _sample(logits, sub, temp, tp)
    t = int(tok[0])
    out.append(t)
    lps.append(float(lp[0]))
    if t in stops:
      finish = "stop"
      break
    if i + 1 < max_new_tokens:
      logits, cache = decode_step(params, cfg, cache, tok, jnp.asarray([P + i], jnp.int32))
  return out, lps, finish


def greedy_ids(params, cfg: ModelConfig, prompt_ids: Sequence[int], n: int,
               stop_ids: Optional[Sequence[int]] = None) -> list[int]:
  """Convenience: greedy continuation token ids."""
  ids, _, _ = generate(params, cfg, prompt_ids, max_new_tokens=n, temperature=0.0,
                       stop_ids=stop_ids or ())
  return ids

