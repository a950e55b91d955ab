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
import concurrent.futures
import dataclasses
import logging
import math
import queue
import re
import sqlite3
import threading
import time
import uuid

import numpy as np

from fr_jax.rollout import tool_formats
from fr_jax.rollout.chat_render import (
  GatewayError,
  Renderer,
  Sampling,
  bad_request,
  canonical_arguments,
  normalize_messages,
  normalize_tools,
  reply_mark,
  sampling,
)
from fr_jax.rollout.embedded import common_prefix
from fr_jax.rollout.engine import Completion, Request
from fr_jax.rollout.gateway_state import REWARDED_KEPT, Episode, Journal, Segment
from fr_jax.trajectory import RETRY_REASONS, Trajectory

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


# --- the engine side ---

class Batcher:
  """Runs an engine that takes one caller at a time (the embedded one) on its own thread,
  batching the calls that wait: every call waiting when a batch starts joins it. Weight swaps
  run on the same thread, between batches."""

  def __init__(self, engine, max_batch: int):
    self.engine, self.max_batch = engine, max(1, max_batch)
    self.q: queue.Queue = queue.Queue()
    self.thread = threading.Thread(target=self._run, daemon=True, name="gateway-engine")
    self.thread.start()

  def generate(self, req: Request) -> Completion:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    self.q.put((req, fut))
    return fut.result()

  def call(self, fn) -> None:
    """Runs fn() on the engine thread, between batches; returns when it has run."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    self.q.put((fn, fut))
    fut.result()

  def _run(self):
    while True:
      item = self.q.get()
      if item is None:
        return
      items = [item]
      while len(items) < self.max_batch:
        try:
          nxt = self.q.get_nowait()
        except queue.Empty:
          break
        if nxt is None:
          self.q.put(None)
          break
        items.append(nxt)
      reqs = []
      for what, fut in items:
        if callable(what):
          try:
            fut.set_result(what())
          except BaseException as e:  # noqa: BLE001 (handed to the caller)
            fut.set_exception(e)
        else:
          reqs.append((what, fut))
      if not reqs:
        continue
      try:
        outs = self.engine.generate([r for r, _ in reqs])
      except BaseException as e:  # noqa: BLE001 (handed to every caller of the batch)
        for _, fut in reqs:
          fut.set_exception(e)
        continue
      for (_, fut), c in zip(reqs, outs):
        fut.set_result(c)

  def close(self):
    self.q.put(None)
    self.thread.join(timeout=30)


# --- the gateway ---

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
    self.open: dict[str, Episode] = {e.id: e for e in self.journal.episodes()}
    self.busy: set[str] = set()
    # the last REWARDED_KEPT rewarded ids, the journal's across a restart
    self.rewarded = collections.OrderedDict.fromkeys(self.journal.rewarded(), True)
    self.m = collections.Counter()
    self.splits = collections.Counter()
    self.max_drift = 0
    self.calls = 0
    self.stop = threading.Event()
    self.t0 = time.monotonic()
    self.outbox: queue.Queue = queue.Queue()
    pending = self.journal.records()
    for t in pending:
      self.outbox.put(t)
    if pending or self.open:
      log.info("gateway: resumed %d open episode(s) and %d unacknowledged record(s) from %s",
               len(self.open), len(pending), journal)
    self.m["records_resent"] = len(pending)
    self.threads = [threading.Thread(target=self._send, daemon=True, name="gateway-send"),
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

  def _generate(self, seq: list[int], s: Sampling, ep: Episode) -> Completion:
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
                  stop_token_ids=self.stop_ids, stop_strings=s.stop)
    try:
      c = self.batcher.generate(req) if self.batcher else self.engine.generate([req])[0]
    except self.engine_errors as e:
      with self.lock:
        self.m["engine_errors"] += 1
      raise GatewayError(503, "engine_unavailable", f"the engine failed: {e}") from None
    if c.finish_reason == "abort":
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
    text = self.tok.decode([t for t in c.token_ids if t not in self.stop_ids])
    cut = [text.find(x) for x in s.stop if x in text]
    return text[:min(cut)] if cut else text

  def _check_room(self, ep: Episode) -> None:
    if len(ep.segments) >= self.cfg.max_segments:
      raise bad_request(f"episode {ep.id!r} would start segment {len(ep.segments) + 1} (at most "
                        f"{self.cfg.max_segments}); post its reward and start a new one",
                        "too_many_segments")

  def _align_chat(self, ep: Episode, msgs, tools) -> tuple[Segment, str | None]:
    """(the segment this call feeds, why it is a new one): the last segment extended by the
    new turns (a copy; reason None), or a new segment (reason "first" or why the call does
    not continue the last one)."""
    prev = ep.segments[-1] if ep.segments else None
    reason = "first"
    if prev is not None:
      j = len(prev.msgs)
      if prev.kind != "chat":
        reason = "endpoint_changed"
      elif len(msgs) <= j or msgs[:j] != prev.msgs:
        reason = "history_changed"
      elif msgs[j] != prev.last_reply:
        reason = "reply_changed"
      elif tools != prev.tools:
        reason = "tools_changed"
      else:
        r = self.renderer.render(msgs, tools, prev.replies + [j])
        head = prev.rendered + reply_mark(j)
        if r.exact and r.text.startswith(head):
          rest = r.text[len(head):]
          if prev.stop_text and rest.startswith(prev.stop_text):
            rest = rest[len(prev.stop_text):]
          seg = prev.copy()
          seg.extend(self.renderer.encode(rest, r.texts), action=False,
                     version=self.engine.version)
          seg.msgs, seg.rendered, seg.replies = msgs, r.text, prev.replies + [j]
          return seg, None
        reason = "template_not_append_only"
      self._check_room(ep)
    r = self.renderer.render(msgs, tools)
    return Segment("chat", self.renderer.prompt(r), msgs=msgs, tools=tools,
                   rendered=r.text), reason

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
      out = run(seg)
      committed = self._commit(ep, seg, reason)
      return committed, out, seg
    finally:
      self._release(committed or ep, committed is not None)

  def chat(self, body: dict, episode_id: str | None = None) -> dict:
    """One /v1/chat/completions call; returns the response object."""
    msgs = normalize_messages(body.get("messages"), self.cfg.max_messages)
    tools = normalize_tools(body)
    if tools and self.renderer.fmt is None:
      raise bad_request("this model's chat template has no known tool-call format; set "
                        f"gateway.tool_format to one of {tool_formats.FORMATS} to use tools",
                        "tools_unsupported")
    s = sampling(body, self.cfg.max_stop)
    ep = self._take(episode_id or body.get("episode_id"))

    def run(seg):
      c = self._generate(seg.seq, s, ep)
      text = self._sampled(seg, c, s)
      parsed = (tool_formats.parse(self.renderer.fmt, text) if tools
                else tool_formats.Parsed(text))
      seg.tool_calls += len(parsed.calls)
      reply = {"role": "assistant", "content": parsed.content}
      if parsed.calls:
        reply["tool_calls"] = [[t.name, canonical_arguments(t.arguments)] for t in parsed.calls]
      seg.last_reply = reply
      return c, parsed

    ep, (c, parsed), seg = self._call(ep, lambda: self._align_chat(ep, msgs, tools), run)
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

  def complete(self, body: dict, episode_id: str | None = None) -> dict:
    """One /v1/completions call (a string prompt, or token ids kept as sent)."""
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
    ep = self._take(episode_id or body.get("episode_id"))

    def run(seg):
      c = self._generate(seg.seq, s, ep)
      text = self._sampled(seg, c, s)
      if isinstance(prompt, str):
        seg.text = prompt + self.tok.decode(c.token_ids)
      return c, text

    ep, (c, text), seg = self._call(ep, lambda: self._align_text(ep, prompt), run)
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

  def _align_text(self, ep: Episode, prompt) -> tuple[Segment, str | None]:
    """As `_align_chat`, for /v1/completions: a prompt that starts with the segment's whole
    sequence (token ids) or its whole text (a string) continues it."""
    prev = ep.segments[-1] if ep.segments else None
    if isinstance(prompt, list):
      ids, kind = list(prompt), "tokens"
    else:
      ids, kind = self.tok.encode(prompt), "text"
    reason = "first"
    if prev is not None:
      if prev.kind != kind:
        reason = "endpoint_changed"
      elif kind == "tokens" and len(ids) > len(prev.seq) and ids[:len(prev.seq)] == prev.seq:
        seg = prev.copy()
        seg.extend(ids[len(prev.seq):], action=False, version=self.engine.version)
        return seg, None
      elif kind == "text" and len(prompt) > len(prev.text) and prompt.startswith(prev.text):
        seg = prev.copy()
        seg.extend(self.tok.encode(prompt[len(prev.text):], add_bos=False), action=False,
                   version=self.engine.version)
        return seg, None
      else:
        reason = "history_changed"
      self._check_room(ep)
    return Segment(kind, ids), reason

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
      with self.lock:
        seq0 = self.next_seq
      recs = []
      for seg in ep.segments:
        if not any(seg.mask):
          continue
        t = Trajectory(
            prompt_id=prompt_id or ep.id, prompt_tokens=np.asarray(seg.prompt_ids, np.int32),
            completion_tokens=np.asarray(seg.tokens, np.int32),
            action_mask=np.asarray(seg.mask, bool),
            behavior_logp=np.asarray(seg.logp, np.float32), reward=float(r),
            policy_version=np.asarray(seg.versions, np.int32), finish_reason=seg.finish_reason,
            num_tool_calls=seg.tool_calls, num_turns=seg.turns, env="gateway",
            traj_id=f"{self.producer}/{seq0 + len(recs)}")
        recs.append((seq0 + len(recs), t))
      try:
        self.journal.finish(ep.id, recs, seq0 + len(recs))
      except sqlite3.Error as e:
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
    finally:
      with self.lock:
        self.busy.discard(episode_id)
    for _, t in recs:
      self.outbox.put(t)
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

  def acknowledged(self, traj_id: str, admitted: bool = True, reason: str = "") -> None:
    """The learner holds (or refused, for good) record `traj_id`: it leaves the journal."""
    with self.lock:
      self.m["acked_admitted" if admitted else f"acked_{reason or 'refused'}"] += 1
    try:
      self.journal.acknowledged(traj_id)
    except sqlite3.Error as e:  # sent again after a restart; the learner drops the copy
      log.warning("gateway: could not clear acknowledged record %s (%s)", traj_id, e)

  # --- background ---
  def _send(self):
    while not self.stop.is_set():
      try:
        t = self.outbox.get(timeout=0.5)
      except queue.Empty:
        continue
      got = self.client.push(t, self.stop)
      if self.acks == "sync" and got is not None and (got[0] or got[1] not in RETRY_REASONS):
        self.acknowledged(t.traj_id, *got)

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
    """Heartbeats, and loads the learner's newer weights between engine batches."""
    while not self.stop.is_set():
      try:
        hb = self.client.heartbeat(self.stats())
        if hb is not None and hb["version"] != self.engine.version:
          self._load(hb)
      except Exception as e:  # noqa: BLE001 (a failed load is tried again at the next beat)
        log.warning("gateway: weights not loaded (%s)", e)
      self.stop.wait(self.cfg.heartbeat_every_s)

  def _load(self, hb: dict) -> None:
    if self.cfg.weights == "hf":
      if hb.get("hf_dir"):
        self.engine.update_weights(hb["hf_dir"], hb["version"])
      return
    got = self.client.get_weights(hb["version"])
    if got is None:
      return
    v, params, _ = got
    swap = lambda: self.engine.update_weights(params, v)  # noqa: E731
    self.batcher.call(swap) if self.batcher else swap()
    log.info("gateway: weights -> version %d", v)

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
              "tool_format": self.renderer.fmt, **dict(self.m)}

  def close(self):
    self.stop.set()
    for t in self.threads:
      t.join(timeout=10)
    if self.batcher:
      self.batcher.close()
    self.journal.close()
