"""The gateway's episodes and their journal.

An `Episode` is a list of `Segment`s: each one prompt and the turns fed after it, with what
the engine sampled (tokens, behaviour log-probs, versions) and, for chat, the last call's
messages, tools, marked rendering and reply (what the next call must extend).

`Journal`: open episodes (as their JSON state), rewarded records not yet acknowledged by the
learner (`transport.codec` records) and the ids of the last `REWARDED_KEPT` rewarded episodes
(so that a reward posted again after a restart is refused as a repeat), in an SQLite file in
WAL mode with synchronous FULL, so a committed write survives a crash. `path=None` keeps them
in memory only.

`Delivery`: the rewarded records, sent to the learner in order by one thread; each leaves the
journal when the learner acknowledges it (at once from the push, or later by callback).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import queue
import sqlite3
import threading

import numpy as np

from fr_jax.trajectory import RETRY_REASONS, Trajectory
from fr_jax.transport import codec

log = logging.getLogger("fr_jax.gateway")

REWARDED_KEPT = 65536  # rewarded episode ids remembered (in memory and in the journal)


@dataclasses.dataclass
class Segment:
  kind: str  # chat | text
  prompt_ids: list[int]
  tokens: list[int] = dataclasses.field(default_factory=list)
  mask: list[bool] = dataclasses.field(default_factory=list)
  logp: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  turns: int = 0
  tool_calls: int = 0
  finish_reason: str = "stop"
  stop_text: str = ""  # the end-of-turn token the last turn sampled, as text
  # chat: the last call's messages and tools, its rendering, the replies it marks, the reply
  msgs: list = dataclasses.field(default_factory=list)
  tools: list | None = None
  rendered: str = ""
  replies: list[int] = dataclasses.field(default_factory=list)
  last_reply: dict | None = None
  # text (/v1/completions with a string prompt): prompt and sampled text so far
  text: str = ""

  @property
  def seq(self) -> list[int]:
    return self.prompt_ids + self.tokens

  def extend(self, ids, *, action: bool, version: int, logp=None, versions=None) -> None:
    self.tokens += list(ids)
    self.mask += [action] * len(ids)
    self.logp += [float(x) for x in logp] if action else [0.0] * len(ids)
    self.versions += ([int(v) for v in versions] if versions is not None
                      else [version] * len(ids))

  def copy(self) -> Segment:
    return Segment(**json.loads(json.dumps(dataclasses.asdict(self))))


@dataclasses.dataclass
class Episode:
  id: str
  segments: list[Segment] = dataclasses.field(default_factory=list)
  touched: float = 0.0
  drift_tokens: int = 0

  @property
  def last(self) -> Segment | None:
    """The segment a call may continue."""
    return self.segments[-1] if self.segments else None

  def records(self, reward: float, prompt_id: str, producer: str,
              seq0: int) -> list[tuple[int, Trajectory]]:
    """(number, record) of each segment that sampled anything, numbered from `seq0`, ids
    `producer/number`, every one with the episode's reward."""
    out = []
    for seg in self.segments:
      if not any(seg.mask):
        continue
      n = seq0 + len(out)
      out.append((n, Trajectory(
          prompt_id=prompt_id, prompt_tokens=np.asarray(seg.prompt_ids, np.int32),
          completion_tokens=np.asarray(seg.tokens, np.int32),
          action_mask=np.asarray(seg.mask, bool),
          behavior_logp=np.asarray(seg.logp, np.float32), reward=reward,
          policy_version=np.asarray(seg.versions, np.int32), finish_reason=seg.finish_reason,
          num_tool_calls=seg.tool_calls, num_turns=seg.turns, env="gateway",
          traj_id=f"{producer}/{n}")))
    return out

  def state(self) -> str:
    return json.dumps(dataclasses.asdict(self))

  @classmethod
  def from_state(cls, text: str) -> Episode:
    d = json.loads(text)
    d["segments"] = [Segment(**s) for s in d["segments"]]
    return cls(**d)


class Journal:
  """Open episodes and unacknowledged records (see the module docstring)."""

  def __init__(self, path: str | None):
    self.path = path or ":memory:"
    self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
    self.lock = threading.Lock()
    with self.lock:
      if path:
        self.db.execute("PRAGMA journal_mode=WAL")
      self.db.execute("PRAGMA synchronous=FULL")
      self.db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT)")
      self.db.execute("CREATE TABLE IF NOT EXISTS episodes (id TEXT PRIMARY KEY, state TEXT)")
      self.db.execute("CREATE TABLE IF NOT EXISTS records "
                      "(seq INTEGER PRIMARY KEY, traj_id TEXT UNIQUE, record BLOB)")
      self.db.execute("CREATE TABLE IF NOT EXISTS rewarded "
                      "(n INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE)")

  def _tx(self, statements):
    with self.lock:
      self.db.execute("BEGIN IMMEDIATE")
      try:
        for sql, args in statements:
          self.db.execute(sql, args)
        self.db.execute("COMMIT")
      except BaseException:
        self.db.execute("ROLLBACK")
        raise

  def meta(self, key: str, default: str) -> str:
    with self.lock:
      row = self.db.execute("SELECT v FROM meta WHERE k=?", (key,)).fetchone()
    if row is None:
      self._tx([("INSERT INTO meta VALUES (?, ?)", (key, default))])
      return default
    return row[0]

  def episodes(self) -> list[Episode]:
    with self.lock:
      rows = self.db.execute("SELECT state FROM episodes").fetchall()
    return [Episode.from_state(r[0]) for r in rows]

  def records(self) -> list[Trajectory]:
    """The unacknowledged records, in order."""
    with self.lock:
      rows = self.db.execute("SELECT record FROM records ORDER BY seq").fetchall()
    return [codec.decode_record(r[0]) for r in rows]

  def rewarded(self) -> list[str]:
    """The ids of the last REWARDED_KEPT rewarded episodes, oldest first."""
    with self.lock:
      rows = self.db.execute("SELECT id FROM rewarded ORDER BY n DESC LIMIT ?",
                             (REWARDED_KEPT,)).fetchall()
    return [r[0] for r in reversed(rows)]

  def save(self, ep: Episode) -> None:
    self._tx([("INSERT OR REPLACE INTO episodes VALUES (?, ?)", (ep.id, ep.state()))])

  def drop(self, episode_id: str) -> None:
    self._tx([("DELETE FROM episodes WHERE id=?", (episode_id,))])

  def finish(self, episode_id: str, records: list[tuple[int, Trajectory]],
             next_seq: int) -> None:
    """Ends an episode and keeps its records ((seq, record) pairs) and its id among the
    rewarded ones (the oldest beyond REWARDED_KEPT forgotten), in one transaction."""
    self._tx([("DELETE FROM episodes WHERE id=?", (episode_id,)),
              *[("INSERT INTO records VALUES (?, ?, ?)", (q, t.traj_id, codec.encode_record(t)))
                for q, t in records],
              ("INSERT OR REPLACE INTO meta VALUES ('next_seq', ?)", (str(next_seq),)),
              ("INSERT OR REPLACE INTO rewarded (id) VALUES (?)", (episode_id,)),
              ("DELETE FROM rewarded WHERE n <= (SELECT MAX(n) FROM rewarded) - ?",
               (REWARDED_KEPT,))])

  def count(self) -> int:
    with self.lock:
      return self.db.execute("SELECT COUNT(*) FROM records").fetchone()[0]

  def acknowledged(self, traj_id: str) -> None:
    self._tx([("DELETE FROM records WHERE traj_id=?", (traj_id,))])

  def close(self):
    with self.lock:
      self.db.close()


class Delivery:
  """Sends `journal`'s records to the learner through `client` (its `push`), one at a time in
  the order they are put, from the journal's unacknowledged ones on. With `acks="sync"` a
  push's answer acknowledges the record (unless the refusal is one to retry); with
  `acks="callback"` the client calls `acknowledged`. Counts the answers in `counts`."""

  def __init__(self, journal: Journal, client, acks: str, stop: threading.Event):
    self.journal, self.client, self.acks, self.stop = journal, client, acks, stop
    self.lock = threading.Lock()
    self.counts = collections.Counter()
    self.queue: queue.Queue = queue.Queue()
    self.resent = journal.records()
    for t in self.resent:
      self.queue.put(t)
    self.thread = threading.Thread(target=self._send, daemon=True, name="gateway-send")

  def put(self, t: Trajectory) -> None:
    self.queue.put(t)

  def answers(self) -> dict:
    with self.lock:
      return dict(self.counts)

  def acknowledged(self, traj_id: str, admitted: bool = True, reason: str = "") -> None:
    """The learner holds (or refused, for good) record `traj_id`: it leaves the journal."""
    with self.lock:
      self.counts["acked_admitted" if admitted else f"acked_{reason or 'refused'}"] += 1
    try:
      self.journal.acknowledged(traj_id)
    except sqlite3.Error as e:  # sent again after a restart; the learner drops the copy
      log.warning("gateway: could not clear acknowledged record %s (%s)", traj_id, e)

  def _send(self):
    while not self.stop.is_set():
      try:
        t = self.queue.get(timeout=0.5)
      except queue.Empty:
        continue
      got = self.client.push(t, self.stop)
      if self.acks == "sync" and got is not None and (got[0] or got[1] not in RETRY_REASONS):
        self.acknowledged(t.traj_id, *got)
