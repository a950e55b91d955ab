r"""Bring your own agent: an agent's OpenAI-style calls, turned into exact trajectories.

An agent written against the OpenAI chat API talks to `launch.gateway`
(`fr_jax.rollout.openai_http` serves the HTTP side); this module is what it serves. Calls that
carry the same episode id (the `X-Episode-Id` header or an `episode_id` body field) form one
episode; the agent, or a scorer, then posts the episode's reward and the episode goes to the
learner, as a worker's trajectories do.

Token in, token out. The gateway keeps, per episode, the token sequence it fed the engine and
what the engine sampled: its tokens, behaviour log-probs and policy versions. A call that
continues the episode (its messages are the previous call's, then the reply the gateway gave,
then new tool or user turns) is fed as that sequence plus the tokens of the new turns only.
Nothing the model sampled is ever re-tokenised, and the record holds exactly what was sampled
in exactly the context it was sampled in.

The new turns' tokens come from the chat template. The conversation is rendered with every
reply the gateway gave replaced by a sentinel, and every text the agent sent by a marker; the
previous call's rendering, then the newest reply's sentinel, must be a prefix of it. What
follows, less the end-of-turn token the model already sampled, is the new turns' text: the
template's own text is encoded as trusted (its special tokens are tokens), the agent's texts
as untrusted text (a `<|im_start|>` that a tool printed stays characters), as the agent loop
encodes tool results.

Segments. A call that does not continue the episode starts a new segment: a new record with
the freshly rendered prompt, and the sampled tokens of the earlier segments are kept in their
own records. Its reason is counted (`segments_by_reason`):
* `history_changed`: the earlier messages differ (the agent summarised or edited them);
* `reply_changed`: the agent sent back another reply than the one it got;
* `tools_changed`: another tool list;
* `template_not_append_only`: the template renders the earlier turns differently once new ones
  follow, or reads the texts it renders (so markers cannot stand for them);
* `endpoint_changed`: the episode moved between /v1/completions and /v1/chat/completions.
The drift is the number of tokens of the previous segment that the new prompt does not share
as a prefix (`drift_tokens`, in total and per episode). Every segment of an episode gets the
episode's reward.

Durability. With a journal (an SQLite file in WAL mode, synchronous FULL), every answered
call's episode state is committed before the answer goes out, and a posted reward turns the
episode into records, with their ids, in the same transaction as it ends the episode. The
records then go to the learner in order, by one sender, and leave the journal when the learner
acknowledges them. A gateway that restarts on the same journal resumes its open episodes and
sends again what was not acknowledged, under the same ids, so the learner's exactly-once
admission drops any it already holds. Record ids are `PRODUCER/SEQ`, the producer name kept in
the journal, so a restarted gateway continues its own sequence.

Bounds: open episodes (`max_open_episodes`, then 429), an episode's idle time
(`episode_timeout_s`: it is dropped and counted in `episodes_expired`), segments per episode,
messages per call, and tokens per segment (`max_total_tokens`, the learner's record bound:
max_tokens is cut to what is left, and a call with nothing left is refused as
`context_length_exceeded`). Two calls of one episode at once: the second is refused
(`episode_busy`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import re
import sqlite3
import threading
import time
import uuid

from fr_jax.rollout import tool_formats
from fr_jax.rollout.batcher import Batcher, EngineClosed
from fr_jax.rollout.chat_render import (
  GatewayError,
  Renderer,
  Sampling,
  bad_request,
  canonical_arguments,
  normalize_messages,
  normalize_tools,
  sampling,
)
from fr_jax.rollout.embedded import common_prefix
from fr_jax.rollout.engine import Completion, Request
from fr_jax.rollout.follower import WeightFollower
from fr_jax.rollout.gateway_state import REWARDED_KEPT, Delivery, Episode, Journal, Segment
from fr_jax.rollout.gateway_turns import TextStream, align_chat, align_text, reply_text

log = logging.getLogger("fr_jax.gateway")

EPISODE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclasses.dataclass
class GatewayConfig:
  model_name: str = "fr_jax"
  tool_format: str = "auto"  # auto (from the chat template) | none | one of tool_formats.FORMATS
  max_total_tokens: int = 1024  # per segment, prompt and completion (the learner's bound)
  max_new_tokens: int = 256  # max_tokens when a call gives none
  max_open_episodes: int = 1024
  episode_timeout_s: float = 900.0
  max_segments: int = 16
  max_messages: int = 512
  max_stop: int = 8  # stop strings per call
  heartbeat_every_s: float = 1.0
  weights: str = "arrays"  # the engine's weight_format: arrays (embedded) | hf (a server)


def _shutting_down() -> GatewayError:
  return GatewayError(503, "shutting_down", "the gateway is shutting down; the call was not "
                      "kept, send it again to the next one")


class Gateway:
  """Episodes from OpenAI-style calls on `engine`; rewarded ones go to `client` (the worker's
  client interface: push, heartbeat, get_weights).
  * `acks="sync"`: push returns (admitted, reason) once the learner holds the record or has
    refused it for good: LocalClient with `durable=True`, so that what it acknowledges is in
    the learner's admission log;
  * `acks="callback"`: the client calls `acknowledged` (GrpcClient's on_ack)."""

  def __init__(self, engine, tokenizer, client, cfg: GatewayConfig | None = None, *,
               journal: str | None = None, acks: str = "sync", engine_errors: tuple = (),
               serial_engine: bool = True, max_batch: int = 8, follow_weights: bool = True):
    self.cfg = cfg = cfg or GatewayConfig()
    if acks not in ("sync", "callback"):
      raise ValueError(f"acks={acks!r}: sync or callback")
    self.engine, self.tok, self.client, self.acks = engine, tokenizer, client, acks
    self.renderer = Renderer(tokenizer, cfg.tool_format)
    self.stop_ids = tuple(tokenizer.stop_ids())
    self.engine_errors = tuple(engine_errors)
    self.batcher = Batcher(engine, max_batch) if serial_engine else None
    self.journal = Journal(journal)
    self.producer = self.journal.meta("producer", f"gateway-{uuid.uuid4().hex[:8]}")
    self.next_seq = int(self.journal.meta("next_seq", "0"))
    self.lock = threading.Lock()  # guards open, busy, rewarded, next_seq, metrics
    self.reward_lock = threading.Lock()  # rewards one at a time (`reward`)
    self.open: dict[str, Episode] = {e.id: e for e in self.journal.episodes()}
    self.busy: set[str] = set()
    # the last REWARDED_KEPT rewarded ids, the journal's across a restart
    self.rewarded = collections.OrderedDict.fromkeys(self.journal.rewarded(), True)
    self.m = collections.Counter()
    self.splits = collections.Counter()
    self.max_drift = 0
    self.calls = 0
    self.stop = threading.Event()
    self.closing = threading.Event()  # calls are refused and the ones in flight aborted
    self.follower = WeightFollower(client, engine, cfg.weights, "gateway",
                                   swap=self.batcher.call if self.batcher else None)
    self.t0 = time.monotonic()
    self.delivery = Delivery(self.journal, client, acks, self.stop)
    self.acknowledged = self.delivery.acknowledged  # the client's on_ack with acks="callback"
    pending = len(self.delivery.resent)
    if pending or self.open:
      log.info("gateway: resumed %d open episode(s) and %d unacknowledged record(s) from %s",
               len(self.open), pending, journal)
    self.m["records_resent"] = pending
    self.threads = [self.delivery.thread,
                    threading.Thread(target=self._reap, daemon=True, name="gateway-reap")]
    if follow_weights:
      self.threads.append(threading.Thread(target=self._follow, daemon=True,
                                           name="gateway-weights"))
    for t in self.threads:
      t.start()

  # --- calls ---
  def _take(self, episode_id: str | None) -> Episode:
    """The open episode `episode_id` (a new one if unknown, or a fresh id if None), marked
    busy."""
    if episode_id is None:
      episode_id = uuid.uuid4().hex
    elif not isinstance(episode_id, str) or not EPISODE_ID.match(episode_id):
      raise bad_request("episode id must be 1-128 characters of [A-Za-z0-9._:-]")
    if self.closing.is_set():
      raise _shutting_down()
    with self.lock:
      if episode_id in self.rewarded:
        raise GatewayError(409, "episode_finished",
                           f"episode {episode_id!r} already has its reward; start a new one")
      if episode_id in self.busy:
        raise GatewayError(409, "episode_busy",
                           f"episode {episode_id!r} has a call in progress")
      ep = self.open.get(episode_id)
      if ep is None:
        if len(self.open) >= self.cfg.max_open_episodes:
          raise GatewayError(429, "too_many_open_episodes",
                             f"{len(self.open)} episodes are open (gateway.max_open_episodes); "
                             "post rewards or wait for idle ones to expire")
        ep = Episode(episode_id, touched=time.time())
      self.busy.add(episode_id)
      return ep

  def _release(self, ep: Episode, commit: bool) -> None:
    with self.lock:
      self.busy.discard(ep.id)
      if commit:
        self.open[ep.id] = ep

  def _generate(self, seq: list[int], s: Sampling, ep: Episode,
                stream: TextStream) -> Completion:
    budget = self.cfg.max_total_tokens - len(seq)
    if budget < 1:
      raise bad_request(f"the episode's segment holds {len(seq)} tokens, the most a record may "
                        f"hold is {self.cfg.max_total_tokens} (agent.max_total_tokens)",
                        "context_length_exceeded")
    with self.lock:
      self.calls += 1
      n = self.calls
    seed = s.seed if s.seed is not None else (hash((self.producer, n)) % 2**32)
    req = Request(f"{self.producer}-{n}-{ep.id}", list(seq),
                  max_new_tokens=min(s.max_tokens or self.cfg.max_new_tokens, budget),
                  temperature=s.temperature, top_p=s.top_p, seed=seed,
                  stop_token_ids=self.stop_ids, stop_strings=s.stop, on_token=stream.on_token)
    try:
      c = (self.batcher.generate(req) if self.batcher else
           self.engine.generate([req], should_abort=stream.cancelled)[0])
    except EngineClosed:
      raise _shutting_down() from None
    except self.engine_errors as e:
      self.follower.engine_failed()
      with self.lock:
        self.m["engine_errors"] += 1
      raise GatewayError(503, "engine_unavailable", f"the engine failed: {e}") from None
    if c.finish_reason == "abort":
      if self.closing.is_set():
        raise _shutting_down()
      if stream.cancelled():  # the client went away (a stream it stopped reading)
        with self.lock:
          self.m["calls_cancelled"] += 1
        raise GatewayError(499, "client_closed_request", "the client closed the request; "
                           "its turn was not kept")
      raise GatewayError(503, "engine_unavailable", "the engine aborted the request")
    return c

  def _sampled(self, seg: Segment, c: Completion, s: Sampling) -> str:
    """Appends a completion to `seg`; returns its text (stop token and stop string cut)."""
    seg.extend(c.token_ids, action=True, version=self.engine.version, logp=c.logprobs,
               versions=c.versions)
    seg.turns += 1
    with self.lock:
      self.m["sampled_tokens"] += len(c.token_ids)
    seg.finish_reason = "length" if c.finish_reason == "length" else "stop"
    last = c.token_ids[-1] if c.token_ids else None
    seg.stop_text = (self.tok.decode([last]) if c.finish_reason == "stop"
                     and last in self.stop_ids else "")
    return reply_text(self.tok, self.stop_ids, c.token_ids, s.stop)[0]

  def _check_room(self, ep: Episode, reason: str | None) -> None:
    if reason not in (None, "first") and len(ep.segments) >= self.cfg.max_segments:
      raise bad_request(f"episode {ep.id!r} would start segment {len(ep.segments) + 1} (at most "
                        f"{self.cfg.max_segments}); post its reward and start a new one",
                        "too_many_segments")

  def _commit(self, ep: Episode, seg: Segment, reason: str | None) -> Episode:
    """The episode with `seg` fed and answered, committed to the journal (the open episode
    is replaced only if that succeeds)."""
    drift = 0
    if reason is None:
      segments = ep.segments[:-1] + [seg]
    else:
      segments = ep.segments + [seg]
      if ep.segments:
        prev = ep.segments[-1].seq
        drift = len(prev) - common_prefix(prev, seg.prompt_ids)
    new = Episode(ep.id, segments, time.time(), ep.drift_tokens + drift)
    try:
      self.journal.save(new)
    except sqlite3.Error as e:
      with self.lock:
        self.m["journal_errors"] += 1
      raise GatewayError(503, "journal_unavailable",
                         f"could not record the call ({e}); nothing was kept, try again") from None
    if reason not in (None, "first"):
      with self.lock:
        self.splits[reason] += 1
        self.m["drift_tokens"] += drift
        self.max_drift = max(self.max_drift, drift)
      log.info("episode %s: new segment (%s), drift %d tokens", ep.id, reason, drift)
    return new

  def _call(self, ep: Episode, align, run):
    """Aligns, generates and commits one call of `ep` (busy): (the committed episode, what
    `run` returned, the segment). The open episode stays as it was if anything fails."""
    committed = None
    try:
      seg, reason = align()
      self._check_room(ep, reason)
      out = run(seg)
      committed = self._commit(ep, seg, reason)
      return committed, out, seg
    finally:
      self._release(committed or ep, committed is not None)

  def _stream(self, s: Sampling, on_text, cancel: threading.Event | None) -> TextStream:
    cancel = cancel or threading.Event()
    return TextStream(self.tok, self.stop_ids, s.stop, on_text,
                      lambda: cancel.is_set() or self.closing.is_set())

  def chat(self, body: dict, episode_id: str | None = None, on_text=None,
           cancel: threading.Event | None = None) -> dict:
    """One /v1/chat/completions call; returns the response object. `on_text` hears the
    reply's text as it is sampled (`gateway_turns.TextStream`; not when the call offers
    tools: the reply may turn out to be a tool call); `cancel` set aborts the call."""
    msgs = normalize_messages(body.get("messages"), self.cfg.max_messages)
    tools = normalize_tools(body)
    if tools and self.renderer.fmt is None:
      raise bad_request("this model's chat template has no known tool-call format; set "
                        f"gateway.tool_format to one of {tool_formats.FORMATS} to use tools",
                        "tools_unsupported")
    s = sampling(body, self.cfg.max_stop)
    stream = self._stream(s, None if tools else on_text, cancel)
    ep = self._take(episode_id or body.get("episode_id"))

    def run(seg):
      c = self._generate(seg.seq, s, ep, stream)
      text = self._sampled(seg, c, s)
      parsed = (tool_formats.parse(self.renderer.fmt, text) if tools
                else tool_formats.Parsed(text))
      seg.tool_calls += len(parsed.calls)
      reply = {"role": "assistant", "content": parsed.content}
      if parsed.calls:
        reply["tool_calls"] = [[t.name, canonical_arguments(t.arguments)] for t in parsed.calls]
      seg.last_reply = reply
      return c, parsed

    align = lambda: align_chat(self.renderer, ep.last, msgs, tools, self.engine.version)  # noqa: E731
    ep, (c, parsed), seg = self._call(ep, align, run)
    with self.lock:
      self.m["chat_calls"] += 1
      self.m["tool_parse_errors"] += parsed.error is not None
    calls = [{"id": f"call_{seg.turns}_{i}_{ep.id}"[:64], "type": "function",
              "function": {"name": t.name, "arguments": t.arguments}}
             for i, t in enumerate(parsed.calls)]
    message = {"role": "assistant",
               "content": parsed.content if (parsed.content or not calls) else None}
    if calls:
      message["tool_calls"] = calls
    finish = "tool_calls" if calls else ("length" if c.finish_reason == "length" else "stop")
    choice = {"index": 0, "message": message, "finish_reason": finish,
              "logprobs": self._logprobs(c) if s.logprobs else None}
    return self._response("chat.completion", choice, ep, seg, c)

  def _logprobs(self, c: Completion) -> dict:
    return {"content": [{"token": self.tok.decode([t]), "logprob": float(lp), "top_logprobs": []}
                        for t, lp in zip(c.token_ids, c.logprobs)]}

  def _response(self, kind: str, choice: dict, ep: Episode, seg: Segment, c: Completion) -> dict:
    n = len(c.token_ids)
    return {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind, "created": int(time.time()), "model": self.cfg.model_name,
            "choices": [choice],
            "usage": {"prompt_tokens": len(seg.seq) - n, "completion_tokens": n,
                      "total_tokens": len(seg.seq)},
            "episode_id": ep.id, "segment": len(ep.segments) - 1,
            "policy_version": int(c.versions[-1]) if c.versions else self.engine.version}

  def complete(self, body: dict, episode_id: str | None = None, on_text=None,
               cancel: threading.Event | None = None) -> dict:
    """One /v1/completions call (a string prompt, or token ids kept as sent); `on_text` and
    `cancel` as for `chat`."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
      prompt = prompt[0]
    if isinstance(prompt, list):
      vocab = self.tok.vocab_size
      if not prompt or not all(isinstance(t, int) and not isinstance(t, bool)
                               and 0 <= t < vocab for t in prompt):
        raise bad_request(f"prompt token ids must be a non-empty list of integers in [0, {vocab})")
    elif not isinstance(prompt, str) or not prompt:
      raise bad_request("prompt must be a non-empty string or a list of token ids")
    s = sampling(body, self.cfg.max_stop)
    stream = self._stream(s, on_text, cancel)
    ep = self._take(episode_id or body.get("episode_id"))

    def run(seg):
      c = self._generate(seg.seq, s, ep, stream)
      text = self._sampled(seg, c, s)
      if isinstance(prompt, str):
        seg.text = prompt + self.tok.decode(c.token_ids)
      return c, text

    align = lambda: align_text(self.tok, ep.last, prompt, self.engine.version)  # noqa: E731
    ep, (c, text), seg = self._call(ep, align, run)
    with self.lock:
      self.m["completion_calls"] += 1
    choice = {"index": 0, "text": text, "logprobs": None,
              "finish_reason": "length" if c.finish_reason == "length" else "stop"}
    if s.logprobs:
      choice["logprobs"] = {"tokens": [self.tok.decode([t]) for t in c.token_ids],
                            "token_logprobs": [float(x) for x in c.logprobs]}
    out = self._response("text_completion", choice, ep, seg, c)
    out["choices"][0]["token_ids"] = list(c.token_ids)
    return out

  # --- rewards ---
  def reward(self, episode_id: str, body: dict) -> dict:
    """Ends an episode with its reward: its segments become records, kept in the journal
    until the learner acknowledges them."""
    r = body.get("reward") if isinstance(body, dict) else None
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
      raise bad_request("reward must be a finite number")
    prompt_id = body.get("prompt_id", "")
    if not isinstance(prompt_id, str) or len(prompt_id) > 256:
      raise bad_request("prompt_id must be a string of at most 256 characters")
    with self.lock:
      if episode_id in self.rewarded:
        raise GatewayError(409, "episode_finished", f"episode {episode_id!r} already has its "
                           "reward")
      ep = self.open.get(episode_id)
      if ep is None:
        raise GatewayError(404, "unknown_episode", f"no open episode {episode_id!r} (never "
                           "started, or expired after gateway.episode_timeout_s idle)")
      if episode_id in self.busy:
        raise GatewayError(409, "episode_busy", f"episode {episode_id!r} has a call in progress")
      self.busy.add(episode_id)
    try:
      # One reward at a time numbers its records, writes them and queues them: the learner
      # takes a producer's records in number order (a lower one after a higher is a repeat).
      with self.reward_lock:
        seq0 = self.next_seq
        recs = ep.records(float(r), prompt_id or ep.id, self.producer, seq0)
        try:
          self.journal.finish(ep.id, recs, seq0 + len(recs))
        except sqlite3.Error as e:
          with self.lock:
            self.m["journal_errors"] += 1
          raise GatewayError(503, "journal_unavailable", f"could not record the reward ({e}); "
                             "the episode is still open, post it again") from None
        with self.lock:
          self.next_seq = seq0 + len(recs)
          del self.open[ep.id]
          self.rewarded[ep.id] = True
          while len(self.rewarded) > REWARDED_KEPT:
            self.rewarded.popitem(last=False)
          self.m["episodes_rewarded"] += 1
          self.m["records"] += len(recs)
        for _, t in recs:
          self.delivery.put(t)
    finally:
      with self.lock:
        self.busy.discard(episode_id)
    return {"episode_id": ep.id, "records": [t.traj_id for _, t in recs],
            "segments": len(ep.segments), "drift_tokens": ep.drift_tokens}

  def episode(self, episode_id: str) -> dict:
    with self.lock:
      ep = self.open.get(episode_id)
      if ep is None:
        status = "rewarded" if episode_id in self.rewarded else None
        if status is None:
          raise GatewayError(404, "unknown_episode", f"no episode {episode_id!r}")
        return {"episode_id": episode_id, "status": status}
      return {"episode_id": ep.id, "status": "open", "drift_tokens": ep.drift_tokens,
              "segments": [{"tokens": len(s.seq), "sampled": int(sum(s.mask)), "turns": s.turns,
                            "tool_calls": s.tool_calls} for s in ep.segments]}

  # --- background ---
  def _reap(self):
    every = max(0.05, min(30.0, self.cfg.episode_timeout_s / 4))
    while not self.stop.wait(every):
      cutoff = time.time() - self.cfg.episode_timeout_s
      with self.lock:
        old = [e.id for e in self.open.values() if e.touched < cutoff and e.id not in self.busy]
        for i in old:
          del self.open[i]
        self.m["episodes_expired"] += len(old)
      for i in old:
        try:
          self.journal.drop(i)
        except sqlite3.Error as e:
          log.warning("gateway: could not drop expired episode %s (%s)", i, e)

  def _follow(self):
    """Heartbeats, and loads the learner's newer weights (between engine batches)."""
    while not self.stop.is_set():
      try:
        self.follower.follow(self.client.heartbeat(self.stats()))
      except Exception as e:  # noqa: BLE001 (a failed load is tried again at the next beat)
        log.warning("gateway: weights not loaded (%s)", e)
      self.stop.wait(self.cfg.heartbeat_every_s)

  def stats(self) -> dict:
    with self.lock:
      return dict(engine_version=self.engine.version, trajectories=self.m["records"],
                  tokens=self.m["sampled_tokens"], uptime_s=time.monotonic() - self.t0,
                  inflight=len(self.busy))

  def metrics(self) -> dict:
    with self.lock:
      return {"producer": self.producer, "engine_version": self.engine.version,
              "open_episodes": len(self.open), "calls_in_progress": len(self.busy),
              "unacknowledged_records": self.journal.count(),
              "segments_by_reason": dict(self.splits), "max_drift_tokens": self.max_drift,
              "tool_format": self.renderer.fmt, **dict(self.m), **self.delivery.answers()}

  def begin_close(self) -> None:
    """Refuses new calls and aborts the ones in flight: both answer 503 `shutting_down`, and
    an aborted call's turn is not kept. Rewards are still taken (a journal write each)."""
    self.closing.set()

  def drain(self, timeout_s: float = 30.0) -> bool:
    """Waits (up to `timeout_s`) until no call or reward is in progress; True if none is."""
    t_end = time.monotonic() + timeout_s
    while self.busy and time.monotonic() < t_end:
      time.sleep(0.01)
    return not self.busy

  def close(self, timeout_s: float = 30.0) -> None:
    """`begin_close`, `drain`, then stops the background threads and the engine's thread
    and closes the journal. Records not yet acknowledged stay in the journal, sent again by
    the next gateway on it."""
    self.begin_close()
    if not self.drain(timeout_s):
      log.warning("gateway: closing with %d call(s) still in flight", len(self.busy))
    self.stop.set()
    for t in self.threads:
      t.join(timeout=10)
    if self.batcher:
      self.batcher.close()
    self.journal.close()
