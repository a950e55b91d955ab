"""The embedded JAX engine: continuous batching over a fixed number of slots.

A preallocated KV cache [layers, slots, max_len, kv_heads, head_dim] holds every live
sequence. A new request is prefilled into a free slot (prompt padded to a power-of-two
bucket, so prefill compiles once per bucket); then one jitted decode step advances all slots
together (static shapes: it compiles once). When a sequence finishes, its slot takes the next
waiting request. Sampling happens inside the decode step with a per-request key folded with
the token index, so a request's tokens do not depend on what else is in the batch.

Weights are arguments of the jitted functions, so `update_weights` swaps them between decode
steps without recompiling; every token records the policy version that sampled it. The engine
holds them in the decode layout (`decoder.decode_layout`: one buffer per layer), which keeps
per-step weight traffic to one read.
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fr_jax.models import decoder, sampling
from fr_jax.models.config import ModelConfig
from fr_jax.rollout.engine import Completion, Request

F32 = jnp.float32


def _keys(seeds, counters):
  return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _prefill_slot(params, cfg: ModelConfig, cache, slot, tokens, length, seed, temp, top_p):
  """Prefills one slot with tokens [1, Pb] (true length `length`) and samples token 0."""
  sub = {k: jax.lax.dynamic_slice_in_dim(v, slot, 1, axis=1) for k, v in cache.items()}
  positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
  h, sub = decoder.forward(params, cfg, tokens, positions, cache=sub)
  last = jax.lax.dynamic_index_in_dim(h[0], length - 1, axis=0, keepdims=True)
  logits = decoder.logits_from_hidden(params, cfg, last)
  tok, lp = sampling.sample(logits, _keys(seed[None], jnp.zeros((1,), jnp.uint32)),
                            temp[None], top_p[None])
  cache = {k: jax.lax.dynamic_update_slice_in_dim(cache[k], sub[k], slot, axis=1)
           for k in cache}
  return tok[0], lp[0], cache


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _decode(params, cfg: ModelConfig, cache, tokens, positions, seeds, counters, temps, top_ps):
  """One token for every slot: tokens [S] at positions [S] -> (next [S], logp [S], cache)."""
  h, cache = decoder.forward(params, cfg, tokens[:, None], positions[:, None], cache=cache)
  logits = decoder.logits_from_hidden(params, cfg, h[:, 0])
  toks, lps = sampling.sample(logits, _keys(seeds, counters), temps, top_ps)
  return toks, lps, cache


class _Slot:
  __slots__ = ("req", "tokens", "logprobs", "versions", "pos", "t0", "ttft", "text_tail")

  def __init__(self, req: Request, t0: float):
    self.req, self.tokens, self.logprobs, self.versions = req, [], [], []
    self.pos, self.t0, self.ttft, self.text_tail = len(req.prompt_ids), t0, 0.0, ""


class EmbeddedEngine:
  """Continuous-batching sampler for one model on this process's devices."""

  def __init__(self, cfg: ModelConfig, params, *, tokenizer=None, num_slots: int = 8,
               max_len: int = 1024, version: int = 0, min_bucket: int = 16):
    if num_slots < 1 or max_len < 2:
      raise ValueError(f"num_slots={num_slots} and max_len={max_len} must be >= 1 and >= 2")
    self.cfg = cfg
    self.params = decoder.decode_layout(params)
    self.tokenizer = tokenizer
    self.num_slots = num_slots
    self.max_len = max_len
    self.version = version
    self.buckets = []
    b = min_bucket
    while b < max_len:
      self.buckets.append(b)
      b *= 2
    self.buckets.append(max_len)
    self.cache = decoder.init_cache(cfg, num_slots, max_len)

  # --- weights ---
  def update_weights(self, params, version: int) -> None:
    """New parameters (same shapes and dtypes) for every token sampled from now on."""
    self.params = decoder.decode_layout(params)
    self.version = int(version)

  @property
  def compile_counts(self) -> dict:
    return {"prefill": _prefill_slot._cache_size(), "decode": _decode._cache_size()}

  # --- generation ---
  def _bucket(self, n: int) -> int:
    for b in self.buckets:
      if b >= n:
        return b
    raise ValueError(f"prompt of {n} tokens does not fit max_len={self.max_len}")

  def _start(self, slot: int, req: Request, t0: float) -> _Slot:
    req.check(self.cfg.vocab_size)
    P = len(req.prompt_ids)
    if P >= self.max_len:
      raise ValueError(f"request {req.request_id!r}: prompt of {P} tokens leaves no room in "
                       f"max_len={self.max_len}")
    Pb = self._bucket(P)
    toks = np.zeros((1, Pb), np.int32)
    toks[0, :P] = req.prompt_ids
    tok, lp, self.cache = _prefill_slot(
        self.params, self.cfg, self.cache, jnp.int32(slot), jnp.asarray(toks), jnp.int32(P),
        jnp.uint32(req.seed), jnp.float32(req.temperature), jnp.float32(req.top_p))
    s = _Slot(req, t0)
    self._append(s, int(tok), float(lp))
    s.ttft = time.perf_counter() - t0
    return s

  def _append(self, s: _Slot, tok: int, lp: float):
    s.tokens.append(tok)
    s.logprobs.append(lp)
    s.versions.append(self.version)

  def _finished(self, s: _Slot) -> Optional[str]:
    r = s.req
    if s.tokens[-1] in r.stop_token_ids:
      return "stop"
    if r.stop_strings and self.tokenizer is not None:
      tail = self.tokenizer.decode(s.tokens[-16:])
      if any(x in tail for x in r.stop_strings):
        return "stop"
    if len(s.tokens) >= r.max_new_tokens or s.pos >= self.max_len:
      return "length"
    return None

  def _done(self, s: _Slot, reason: str) -> Completion:
    return Completion(s.req.request_id, s.tokens, s.logprobs, reason, s.versions,
                      len(s.req.prompt_ids), s.ttft)

  def generate(self, requests: Sequence[Request],
               should_abort: Optional[Callable[[], bool]] = None) -> list[Completion]:
    """Runs every request to completion (or abort), in continuous batches of num_slots.
    Returns completions in request order."""
    for r in requests:
      r.check(self.cfg.vocab_size)
    order = {r.request_id: i for i, r in enumerate(requests)}
    if len(order) != len(requests):
      raise ValueError("request ids must be unique within one generate() call")
    waiting = collections.deque(requests)
    slots: list[Optional[_Slot]] = [None] * self.num_slots
    out: dict[str, Completion] = {}
    t0 = time.perf_counter()
    S = self.num_slots
    while waiting or any(slots):
      if should_abort is not None and should_abort():
        for s in slots:
          if s is not None:
            out[s.req.request_id] = self._done(s, "abort")
        for r in waiting:
          out[r.request_id] = Completion(r.request_id, [], [], "abort", [], len(r.prompt_ids))
        break
      for i in range(S):
        while slots[i] is None and waiting:
          s = self._start(i, waiting.popleft(), t0)
          reason = self._finished(s)
          if reason:
            out[s.req.request_id] = self._done(s, reason)
          else:
            slots[i] = s
      live = [i for i in range(S) if slots[i] is not None]
      if not live:
        continue
      tokens = np.zeros(S, np.int32)
      positions = np.zeros(S, np.int32)
      seeds = np.zeros(S, np.uint32)
      counters = np.zeros(S, np.uint32)
      temps = np.ones(S, np.float32)
      top_ps = np.ones(S, np.float32)
      for i in live:
        s = slots[i]
        tokens[i], positions[i] = s.tokens[-1], s.pos
        seeds[i], counters[i] = s.req.seed, len(s.tokens)
        temps[i], top_ps[i] = s.req.temperature, s.req.top_p
      nxt, lps, self.cache = _decode(self.params, self.cfg, self.cache, tokens, positions, seeds,
                                     counters, temps, top_ps)
      nxt, lps = np.asarray(nxt), np.asarray(lps)
      for i in live:
        s = slots[i]
        s.pos += 1
        self._append(s, int(nxt[i]), float(lps[i]))
        reason = self._finished(s)
        if reason:
          out[s.req.request_id] = self._done(s, reason)
          slots[i] = None
    return sorted(out.values(), key=lambda c: order[c.request_id])
