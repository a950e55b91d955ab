"""The embedded JAX engine: continuous batching over a fixed number of slots.

A preallocated KV cache (`decoder.init_cache`: per layer, keys [slots, kv_heads, head_dim,
max_len] and values [slots, kv_heads, max_len, head_dim]) holds every live sequence. A new
request is prefilled into a free slot (prompt padded to a power-of-two bucket, so prefill
compiles once per bucket); then one jitted decode step advances all slots together. Its
attention reads only the first `window` cache slots, the smallest power of two (from 128, at
most half of max_len; else all of it) past every live position, so a step costs about what
the longest live sequence needs, not max_len; it compiles once per window (`warmup` compiles
them all). When a sequence finishes, its slot takes the next waiting request. Sampling
happens inside the decode step with a per-request key folded with the token index, so a
request's tokens do not depend on what else is in the batch.

Weights are arguments of the jitted functions, so `update_weights` swaps them between decode
steps without recompiling; every token records the policy version that sampled it. The engine
holds them in the decode layout (`decoder.decode_layout`: one buffer per layer), which keeps
per-step weight traffic to one read.

Prefix reuse (multi-turn KV reuse). A slot keeps its KV entries after its request finishes,
with the token ids they hold (the prompt and every generated token but the last, which was
never fed). A new request whose prompt starts with a slot's tokens (the next turn of the same
episode: the earlier turns, then the tool response or observation and the next header)
takes that slot and prefills only the appended tokens, at their true positions. The entries
past the appended ones are stale but invisible: a query sees only cache positions <= its own,
and decoding overwrites them in order. Only entries computed under the current weights are
reused (`update_weights` retires every slot's prefix), so a reused prefix gives the
log-probs a full re-prefill would, up to float rounding.

Routing replay (MoE models). Every forward also returns the experts each fed position was
routed to (prefill and decode alike), and a slot keeps its resident tokens' routing with their
KV entries, so a reused prefix reports the routing its entries were computed with. A request
with `routed_experts_start` gets the rows of its positions from there on
(`Completion.routed_experts`, `ModelConfig.routing_dtype`); tokens decoded after a weight swap
carry the new weights' routing, the ones before it the old: the experts that really ran.

Streaming. A request's `on_token` is called with each token as it is sampled, after the decode
step that sampled it; returning False ends that request alone ("abort", keeping what was
sampled), and its slot goes to the next request.

Eviction is bounded by the slots themselves (num_slots sequences of max_len): a request takes,
in order of preference, (1) the free slot holding the longest prefix of its prompt, (2) an
empty slot, (3) the least recently used free slot, whose common prefix with the prompt (a
shared system prompt, say) is still reused. Give the engine at least as many slots as
episodes in flight, or episodes evict each other between turns. Idle slots' entries are
never written: a decode step aims idle rows past the cache's end, where writes are dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fr_jax.models import decoder, sampling
from fr_jax.models.config import ModelConfig
from fr_jax.rollout.engine import Completion, Request


def _keys(seeds, counters):
  return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _prefill_slot(params, cfg: ModelConfig, cache, slot, tokens, start, length, seed, temp,
                  top_p):
  """Writes tokens [1, Tb] (true length `length`) into one slot at positions start.. and
  samples the token after them (token 0 of the completion). Entries the slot holds below
  `start` are the reused prefix."""
  sub = jax.tree.map(lambda c: jax.lax.dynamic_slice_in_dim(c, slot, 1, axis=0), cache)
  positions = start + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
  h, sub, routing = decoder.forward(params, cfg, tokens, positions, cache=sub, routing_out=True)
  last = jax.lax.dynamic_index_in_dim(h[0], length - 1, axis=0, keepdims=True)
  logits = decoder.logits_from_hidden(params, cfg, last)
  tok, lp = sampling.sample(logits, _keys(seed[None], jnp.zeros((1,), jnp.uint32)),
                            temp[None], top_p[None])
  cache = jax.tree.map(lambda c, u: jax.lax.dynamic_update_slice_in_dim(c, u, slot, axis=0),
                       cache, sub)
  # The fed positions' experts [Tb, sparse layers, k] in the record's dtype; None if dense.
  return tok[0], lp[0], cache, routing.experts[0].astype(cfg.routing_dtype) if cfg.is_moe else None


@functools.partial(jax.jit, static_argnames=("cfg", "window"), donate_argnames=("cache",))
def _decode(params, cfg: ModelConfig, cache, tokens, positions, seeds, counters, temps, top_ps,
            window: int):
  """One token for every slot: tokens [S] at positions [S] -> (next [S], logp [S], cache,
  experts [S, sparse layers, k] in the record's dtype, or None). Attention reads the first
  `window` cache slots (every live position is below it)."""
  h, cache, routing = decoder.forward(params, cfg, tokens[:, None], positions[:, None],
                                      cache=cache, window=window, routing_out=True)
  logits = decoder.logits_from_hidden(params, cfg, h[:, 0])
  toks, lps = sampling.sample(logits, _keys(seeds, counters), temps, top_ps)
  return toks, lps, cache, routing.experts[:, 0].astype(cfg.routing_dtype) if cfg.is_moe else None


@dataclasses.dataclass
class _Resident:
  """What a slot's cache holds: KV entries for `tokens` at positions 0.., computed under
  weights epoch `epoch`, last used at scheduler tick `used`; for an MoE model, the experts
  each of those positions was routed to ([len(tokens), sparse layers, k])."""
  tokens: list = dataclasses.field(default_factory=list)
  epoch: int = -1
  used: int = 0
  routes: np.ndarray | None = None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
  """How many leading ids a and b share."""
  n = min(len(a), len(b))
  if list(a[:n]) == list(b[:n]):  # the usual case (the next turn), at C speed
    return n
  return next(i for i in range(n) if a[i] != b[i])


def _powers_of_two(lo: int, hi: int) -> list[int]:
  out, b = [], lo
  while b < hi:
    out.append(b)
    b *= 2
  return out + [hi]


class _Slot:
  __slots__ = ("req", "tokens", "logprobs", "versions", "pos", "t0", "ttft", "routes",
               "aborted")

  def __init__(self, req: Request, t0: float):
    self.req, self.tokens, self.logprobs, self.versions = req, [], [], []
    self.pos, self.t0, self.ttft = len(req.prompt_ids), t0, 0.0
    self.aborted = False  # its on_token asked to stop
    self.routes = []  # MoE: routing rows of the fed positions 0.., in order (arrays)

  def routing(self) -> np.ndarray | None:
    return np.concatenate(self.routes) if self.routes else None


class EmbeddedEngine:
  """Continuous-batching sampler for one model on this process's devices."""
  weight_format = "arrays"  # update_weights takes the parameters themselves
  errors = ()  # nothing to ride out: a failure here is a bug
  admits_while_running = True  # generate(more=, done=): the gateway's engine thread

  def __init__(self, cfg: ModelConfig, params, *, tokenizer=None, num_slots: int = 8,
               max_len: int = 1024, version: int = 0, min_bucket: int = 16,
               min_window: int = 128, prefix_reuse: bool = True):
    if num_slots < 1 or max_len < 2:
      raise ValueError(f"num_slots={num_slots} and max_len={max_len} must be >= 1 and >= 2")
    self.cfg = cfg
    self._epoch = 0  # bumped by every weight swap: older entries are never reused
    self.params = decoder.decode_layout(params, cfg)
    self.tokenizer = tokenizer
    self.num_slots = num_slots
    self.max_len = max_len
    self.version = version
    self.buckets = _powers_of_two(min_bucket, max_len)  # prefill lengths
    # Decode attention spans. Reading a window copies it out of the cache, so one pays only
    # up to half the cache; past that the step reads the whole cache.
    self.windows = [w for w in _powers_of_two(min_window, max_len)
                    if 2 * w <= max_len or w == max_len]
    self.cache = decoder.init_cache(cfg, num_slots, max_len)
    self.prefix_reuse = prefix_reuse
    self._resident = [_Resident() for _ in range(num_slots)]
    self._tick = 0
    self.stats = collections.Counter()  # prefill_tokens, reused_tokens, evictions, requests

  # --- weights ---
  @property
  def params(self):
    """The weights in the decode layout. Setting them (here or through `update_weights`)
    retires every slot's cached prefix: entries of other weights are never reused."""
    return self._params

  @params.setter
  def params(self, value) -> None:
    self._params = value
    self._epoch += 1

  def update_weights(self, params, version: int) -> None:
    """New parameters (same shapes and dtypes) for every token sampled from now on."""
    self.params = decoder.decode_layout(params, self.cfg)
    self.version = int(version)

  @property
  def compile_counts(self) -> dict:
    return {"prefill": _prefill_slot._cache_size(), "decode": _decode._cache_size()}

  def warmup(self) -> None:
    """Compiles every prefill bucket and decode window now, so that generation never
    compiles. Writes nothing a slot holds (every write lands past the cache's end)."""
    end, one = jnp.int32(self.max_len), jnp.ones((), jnp.float32)
    for b in self.buckets:
      _, _, self.cache, _ = _prefill_slot(self.params, self.cfg, self.cache, jnp.int32(0),
                                       jnp.zeros((1, b), jnp.int32), end, jnp.int32(1),
                                       jnp.uint32(0), one, one)
    for w in self.windows:
      _, _, self.cache, _ = _decode(self.params, self.cfg, self.cache, *self._idle_rows(),
                                    window=w)
    jax.block_until_ready(self.cache)

  def _idle_rows(self) -> tuple[np.ndarray, ...]:
    """`_decode`'s per-slot inputs (tokens, positions, seeds, counters, temps, top_ps) with
    every row idle: aimed past the cache's end, where writes are dropped."""
    S = self.num_slots
    return (np.zeros(S, np.int32), np.full(S, self.max_len, np.int32), np.zeros(S, np.uint32),
            np.zeros(S, np.uint32), np.ones(S, np.float32), np.ones(S, np.float32))

  # --- generation ---
  def _bucket(self, n: int, sizes=None) -> int:
    for b in sizes or self.buckets:
      if b >= n:
        return b
    raise ValueError(f"prompt of {n} tokens does not fit max_len={self.max_len}")

  def _reusable(self, slot: int, prompt: Sequence[int]) -> int:
    """How many leading prompt tokens slot `slot` holds valid entries for."""
    r = self._resident[slot]
    if not self.prefix_reuse or r.epoch != self._epoch or not r.tokens:
      return 0
    return common_prefix(r.tokens, prompt)

  def _pick_slot(self, req: Request, free: Sequence[int]) -> int:
    """The slot for `req` among `free` slots (eviction policy in the module docstring)."""
    if not self.prefix_reuse:
      return free[0]
    # Slots whose whole content is a prefix of the prompt; the longest wins (the first of equals).
    whole = [i for i in free
             if 0 < self._reusable(i, req.prompt_ids) == len(self._resident[i].tokens)]
    if whole:
      return max(whole, key=lambda i: len(self._resident[i].tokens))
    empty = [i for i in free if not self._resident[i].tokens]
    if empty:
      return empty[0]
    self.stats["evictions"] += 1
    return min(free, key=lambda i: self._resident[i].used)

  def _start(self, slot: int, req: Request, t0: float) -> _Slot:
    req.check(self.cfg.vocab_size)
    if req.routed_experts_start is not None and not self.cfg.is_moe:
      raise ValueError(f"request {req.request_id!r} asks for routed experts, but the model is "
                       "dense (routing replay is for mixture-of-experts models)")
    P = len(req.prompt_ids)
    if P >= self.max_len:
      raise ValueError(f"request {req.request_id!r}: prompt of {P} tokens leaves no room in "
                       f"max_len={self.max_len}")
    start = min(self._reusable(slot, req.prompt_ids), P - 1)  # prefill at least one token
    n = P - start
    toks = np.zeros((1, self._bucket(n)), np.int32)
    toks[0, :n] = req.prompt_ids[start:]
    tok, lp, self.cache, experts = _prefill_slot(
        self.params, self.cfg, self.cache, jnp.int32(slot), jnp.asarray(toks),
        jnp.int32(start), jnp.int32(n), jnp.uint32(req.seed), jnp.float32(req.temperature),
        jnp.float32(req.top_p))
    s = _Slot(req, t0)
    if experts is not None:
      if start:
        s.routes.append(self._resident[slot].routes[:start])
      s.routes.append(np.asarray(experts)[:n])
    self.stats.update(requests=1, prefill_tokens=n, reused_tokens=start)
    # From here the slot holds the prompt; entries past it are stale until decoded over.
    self._resident[slot] = _Resident(list(req.prompt_ids), self._epoch, self._tick,
                                     s.routing())
    self._append(s, int(tok), float(lp))
    s.ttft = time.perf_counter() - t0
    return s

  def _append(self, s: _Slot, tok: int, lp: float):
    s.tokens.append(tok)
    s.logprobs.append(lp)
    s.versions.append(self.version)
    if s.req.on_token is not None and s.req.on_token(tok, lp) is False:
      s.aborted = True

  def _finished(self, s: _Slot) -> str | None:
    r = s.req
    if s.tokens[-1] in r.stop_token_ids:
      return "stop"
    if r.stop_strings and self.tokenizer is not None:
      tail = self.tokenizer.decode(s.tokens[-16:])
      if any(x in tail for x in r.stop_strings):
        return "stop"
    if len(s.tokens) >= r.max_new_tokens or s.pos >= self.max_len:
      return "length"
    return "abort" if s.aborted else None

  def _done(self, slot: int, s: _Slot, reason: str) -> Completion:
    """`s`'s completion, once it leaves slot `slot`. The slot then holds its prompt and every
    generated token but the last (never fed); after a swap during the request its epoch is
    stale."""
    r = self._resident[slot]
    r.tokens = list(s.req.prompt_ids) + s.tokens[:-1]
    r.routes = s.routing()
    r.used = self._tick
    c = Completion(s.req.request_id, s.tokens, s.logprobs, reason, s.versions,
                   len(s.req.prompt_ids), s.ttft)
    if s.req.routed_experts_start is not None:
      c.routed_experts = s.routing()[s.req.routed_experts_start:]
    return c

  def generate(self, requests: Sequence[Request],
               should_abort: Callable[[], bool] | None = None,
               more: Callable[[], Sequence[Request]] | None = None,
               done: Callable[[Completion], None] | None = None) -> list[Completion]:
    """Runs every request to completion (or abort), in continuous batches of num_slots.
    Returns completions in request order. A server loop (the gateway's engine thread) passes
    `more`, called before every decode step for requests that have arrived since (they join
    the running batch), and `done`, which gets each completion as soon as it ends; the call
    returns once nothing is waiting or running."""
    for r in requests:
      r.check(self.cfg.vocab_size)
    if len({r.request_id for r in requests}) != len(requests):
      raise ValueError("request ids must be unique within one generate() call")
    waiting = collections.deque(requests)
    slots: list[_Slot | None] = [None] * self.num_slots
    out: dict[str, Completion] = {}
    if done is not None:
      out = _Delivering(done)
    t0 = time.perf_counter()
    S = self.num_slots
    while True:
      if more is not None:
        for r in more():
          r.check(self.cfg.vocab_size)
          waiting.append(r)
      if not (waiting or any(slots)):
        break
      if should_abort is not None and should_abort():
        for i, s in enumerate(slots):
          if s is not None:
            out[s.req.request_id] = self._done(i, s, "abort")
        for r in waiting:
          out[r.request_id] = Completion(r.request_id, [], [], "abort", [], len(r.prompt_ids))
        break
      self._tick += 1
      while waiting and None in slots:
        free = [i for i in range(S) if slots[i] is None]
        req = waiting.popleft()
        i = self._pick_slot(req, free)
        s = self._start(i, req, t0)
        reason = self._finished(s)
        if reason:
          out[s.req.request_id] = self._done(i, s, reason)
        else:
          slots[i] = s
      live = [i for i in range(S) if slots[i] is not None]
      if not live:
        continue
      tokens, positions, seeds, counters, temps, top_ps = self._idle_rows()
      for i in live:
        s = slots[i]
        tokens[i], positions[i] = s.tokens[-1], s.pos
        seeds[i], counters[i] = s.req.seed, len(s.tokens)
        temps[i], top_ps[i] = s.req.temperature, s.req.top_p
      window = self._bucket(int(positions[live].max()) + 1, self.windows)
      nxt, lps, self.cache, experts = _decode(self.params, self.cfg, self.cache, tokens,
                                              positions, seeds, counters, temps, top_ps,
                                              window=window)
      nxt, lps = np.asarray(nxt), np.asarray(lps)
      experts = None if experts is None else np.asarray(experts)
      for i in live:
        s = slots[i]
        s.pos += 1
        if experts is not None:
          s.routes.append(experts[i:i + 1])
        self._append(s, int(nxt[i]), float(lps[i]))
        reason = self._finished(s)
        if reason:
          out[s.req.request_id] = self._done(i, s, reason)
          slots[i] = None
    return [out[r.request_id] for r in requests]


class _Delivering(dict):
  """generate()'s completions, each also handed to `done` as it is stored."""

  def __init__(self, done: Callable[[Completion], None]):
    super().__init__()
    self.done = done

  def __setitem__(self, key, c):
    super().__setitem__(key, c)
    self.done(c)
