"""What the learner owes its workers, kept so that a crash loses none of it: the admission
log, the dead-letter file and the per-producer watermarks.

An acknowledgement means: this record will be used by exactly one update, or dead-lettered
with a reason, whatever crashes in between. Three pieces carry that promise.

* `AdmissionLog` (`run_dir/admission.log`): every admitted record, written and fsynced
  before its acknowledgement. Frames are `<u32 length><u32 crc32><payload>`; a failed append
  is cut off again so the file always ends on a whole frame, and a torn frame (a crash
  mid-write, zeroed blocks) is skipped and counted on reading. Each record is marked settled
  with the version of the update that used or dead-lettered it; `compact(committed)` drops the
  records settled by updates a *committed* checkpoint holds, rewriting the file atomically
  under the same lock appends take.
* `DeadLetters` (`run_dir/dead_letter.jsonl`): admitted records that no update will use, one
  JSON line each with its reason (`stale` when taken, `nonfinite_update` for a quarantined
  offender, `future_version` when a restart went back past the weights that sampled it) and
  the learner version at the time. A line is fsynced before the record leaves the queue, and
  the decision is final: a restart never replays a dead-lettered record, whichever
  checkpoint it restores, so the log may drop it at the next compaction.
* `Producers`: no-reuse in bounded state. A record id is `producer/seq` (see
  `trajectory.record_key`); a producer sends its records in seq order, so the learner keeps
  per producer only the highest admitted seq (anything at or below it is a duplicate) and the
  seqs admitted but not yet settled (at most the queue). A producer that owes nothing is
  evicted once it has been silent for `ttl_versions` updates (a restarted worker's old
  nonce, a worker that left), or, oldest first, while the table holds more than
  `max_producers`. The table saved with each checkpoint is therefore O(live producers +
  queue), not O(records ever used). `floor`, the newest version any evicted producer was
  heard at, refuses records no newer than it from unknown producers (`producer_expired`):
  every record an evicted producer ever had admitted was sampled at or below `floor`, and
  anything else it sends now is at least `ttl_versions` versions old.
"""

from __future__ import annotations

import base64
import collections
import errno
import itertools
import json
import logging
import os
import struct
import threading
import time
import zlib
from pathlib import Path

from fr_jax import durable, faults
from fr_jax.trajectory import record_key

log = logging.getLogger("fr_jax.service")

FRAME = struct.Struct("<II")  # payload length, crc32 of the payload


def _write_all(fd: int, data: bytes) -> None:
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]


def _frame(raw: bytes) -> bytes:
  return FRAME.pack(len(raw), zlib.crc32(raw)) + raw


def _frame_at(data: bytes, i: int) -> tuple[bool, int | None]:
  """(whole and intact, payload length if the header is plausible) for a frame at `i`."""
  if i + FRAME.size > len(data):
    return False, None
  n, crc = FRAME.unpack_from(data, i)
  end = i + FRAME.size + n
  if n == 0 or end > len(data):
    return False, None
  return zlib.crc32(data[i + FRAME.size:end]) == crc, n


class AdmissionLog:
  """Admitted, not-yet-compacted records; see the module docstring."""

  def __init__(self, path, *, fsync: bool = True):
    self.path = Path(path)
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self.fsync = fsync
    self._lock = threading.Lock()
    self._live: dict[str, list] = {}  # traj_id -> [raw, settled version or None], in order
    self.write_failures = 0
    existed = self.path.exists()
    self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    self._size = os.fstat(self._fd).st_size  # bytes of whole frames
    if not existed:
      durable.fsync_path(self.path.parent)

  def __len__(self):
    return len(self._live)

  @property
  def size_bytes(self) -> int:
    return self._size

  def append(self, traj_id: str, raw: bytes) -> None:
    """Durable (fsynced unless `fsync=False`) before it returns; raises OSError otherwise,
    having cut any partial frame off again."""
    frame = _frame(raw)
    with self._lock:
      try:
        if self._fd is None:
          self._reopen()
        if faults.active("admission_log_enospc"):
          _write_all(self._fd, frame[:len(frame) // 2])
          raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        _write_all(self._fd, frame)
        if self.fsync:
          os.fsync(self._fd)
      except OSError:
        self.write_failures += 1
        try:
          self._reopen()  # the file ends on its last whole frame again
        except OSError as e:
          log.error("admission log %s: cannot cut a failed append off yet (%s); retrying "
                    "at the next append", self.path, e)
        raise
      self._size += len(frame)
      self._live[traj_id] = [raw, None]

  def _drop_fd(self):
    if self._fd is not None:
      try:
        os.close(self._fd)
      except OSError:
        pass
      self._fd = None

  def _reopen(self):
    """Closes the current descriptor, if any, and opens the file again cut to `_size`."""
    self._drop_fd()
    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
    try:
      os.ftruncate(fd, self._size)
      if self.fsync:
        os.fsync(fd)
    except OSError:
      os.close(fd)
      raise
    self._fd = fd

  def settle(self, traj_ids, version: int) -> None:
    """Marks records used (or dead-lettered) by the update that made `version`."""
    with self._lock:
      for i in traj_ids:
        e = self._live.get(i)
        if e is not None:
          e[1] = version

  def compact(self, committed: int) -> bool:
    """Drops the records settled at versions <= `committed` (a committed checkpoint's).
    Returns whether it rewrote the file; a failed rewrite keeps the old one."""
    with self._lock:
      keep = {k: e for k, e in self._live.items() if e[1] is None or e[1] > committed}
      if len(keep) == len(self._live):
        return False
      try:
        self._rewrite(keep)
      except OSError as e:
        log.warning("admission log compaction failed (%s); the old log stays", e)
        return False
      return True

  def _rewrite(self, entries: dict) -> None:  # holds the lock
    data = b"".join(_frame(e[0]) for e in entries.values())
    durable.write_file(self.path, data)
    self._size = len(data)
    self._live = entries
    try:
      self._reopen()
    except OSError as e:
      log.error("admission log %s: reopen failed (%s); retrying at the next append",
                self.path, e)

  def reset(self, entries, valid_end: int) -> None:
    """After a restart: the log holds exactly `entries` ((traj_id, raw), in order). If the
    rewrite fails, the old file stays, cut to `valid_end` (the end of its last whole frame);
    its extra records are filtered out again at the next restart."""
    live = {i: [raw, None] for i, raw in entries}
    with self._lock:
      try:
        self._rewrite(live)
      except OSError as e:
        log.error("admission log %s: rewrite at start failed (%s); keeping the old file",
                  self.path, e)
        self._live, self._size = live, valid_end
        self._reopen()

  @staticmethod
  def read(path) -> tuple[list[bytes], int, int]:
    """(whole records in order, torn frames skipped, end of the last whole frame)."""
    path = Path(path)
    data = path.read_bytes() if path.exists() else b""
    out, torn, i, end = [], 0, 0, 0
    while i < len(data):
      ok, n = _frame_at(data, i)
      if ok:
        out.append(data[i + FRAME.size:i + FRAME.size + n])
        i = end = i + FRAME.size + n
        continue
      torn += 1
      if n is not None:  # a whole frame whose bytes are wrong: skip just it
        i += FRAME.size + n
        continue
      # A header that makes no sense (a frame cut short, or garbage): find the next frame.
      i = next((j for j in range(i + 1, len(data) - FRAME.size) if _frame_at(data, j)[0]),
               len(data))
    return out, torn, end

  def close(self):
    with self._lock:
      self._drop_fd()


class DeadLetters:
  """dead_letter.jsonl (or counts only, without a path); see the module docstring."""

  def __init__(self, path: str | None):
    self.path = Path(path) if path else None
    if self.path is not None:
      self.path.parent.mkdir(parents=True, exist_ok=True)
    self.counts = collections.Counter(r["reason"] for r in self.rows())

  def add(self, rows: list[dict]) -> None:
    """Appends and fsyncs the rows; raises OSError if they are not durable."""
    if self.path is not None:
      data = "".join(json.dumps(r) + "\n" for r in rows).encode()
      fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
      try:
        if os.fstat(fd).st_size and not self._ends_whole():
          data = b"\n" + data  # after a line cut short by a crash
        _write_all(fd, data)
        os.fsync(fd)
      finally:
        os.close(fd)
    self.counts.update(r["reason"] for r in rows)

  @staticmethod
  def row(traj, reason: str, version: int, detail: str = "",
          raw: bytes | None = None) -> dict:
    r = dict(traj_id=traj.traj_id, reason=reason, version=version, detail=detail,
             time=time.time(), prompt_id=traj.prompt_id, reward=float(traj.reward))
    if raw is not None:
      r["record"] = base64.b64encode(raw).decode()
    return r

  def rows(self) -> list[dict]:
    if self.path is None or not self.path.exists():
      return []
    out = []
    for line in self.path.read_text().splitlines():
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:  # a line cut short by a crash: its record was not settled
        continue
    return out

  def ids(self) -> set[str]:
    return {r["traj_id"] for r in self.rows()}

  def _ends_whole(self) -> bool:
    with open(self.path, "rb") as f:
      f.seek(-1, os.SEEK_END)
      return f.read(1) == b"\n"


class Producers:
  """Per-producer watermarks (no-reuse in bounded state); see the module docstring."""

  def __init__(self, max_producers: int = 65536, ttl_versions: int = 100):
    if max_producers < 1 or ttl_versions < 1:
      raise ValueError(f"max_producers={max_producers} and ttl_versions={ttl_versions} must "
                       "be >= 1")
    self.max, self.ttl = max_producers, ttl_versions
    # producer -> [highest admitted seq, admitted-unsettled seqs, newest version heard at]
    self._p: collections.OrderedDict = collections.OrderedDict()
    self.floor = -1
    self.evicted = 0

  def __len__(self):
    return len(self._p)

  def is_duplicate(self, producer: str, seq: int) -> bool:
    e = self._p.get(producer)
    return e is not None and seq <= e[0]

  def is_expired(self, producer: str, min_version: int) -> bool:
    return producer not in self._p and min_version <= self.floor

  def admit(self, producer: str, seq: int, version: int, safe_version: int) -> None:
    """Records an admission at learner `version`, then evicts producers that owe nothing and
    were last heard before `safe_version` (the published one): those silent for more than
    `ttl_versions` versions, and the least recent ones while the table is over its size."""
    e = self._p.setdefault(producer, [seq, [], version])
    e[0] = max(e[0], seq)
    e[1].append(seq)
    e[2] = max(e[2], version)
    self._p.move_to_end(producer)
    self._evict(version, safe_version)

  def _evict(self, version: int, safe_version: int) -> None:
    for name in list(itertools.islice(self._p, 64)):  # least recently admitting first
      e = self._p[name]
      if len(self._p) <= self.max and version - e[2] <= self.ttl:
        return  # the rest were heard from more recently still
      if not e[1] and e[2] < safe_version:
        del self._p[name]
        self.floor = max(self.floor, e[2])
        self.evicted += 1

  def settle(self, producer: str, seq: int) -> None:
    e = self._p.get(producer)
    if e is not None and seq in e[1]:
      e[1].remove(seq)

  def replayable(self, producer: str, seq: int, min_version: int) -> bool:
    """Against a restored checkpoint's table: was this logged record still owed (queued at
    the checkpoint, or admitted after it)?"""
    e = self._p.get(producer)
    if e is None:
      return min_version > self.floor
    return seq > e[0] or seq in e[1]

  def forget_unsettled(self) -> None:
    """Before a replay re-admits what the log still holds."""
    for e in self._p.values():
      e[1] = []

  def state(self) -> dict:
    return {"producers": {k: [e[0], list(e[1]), e[2]] for k, e in self._p.items()},
            "floor": self.floor, "evicted": self.evicted}

  def load(self, state: dict) -> None:
    self._p = collections.OrderedDict(
        (k, [int(h), [int(s) for s in u], int(v)])
        for k, (h, u, v) in state.get("producers", {}).items())
    self.floor = int(state.get("floor", -1))
    self.evicted = int(state.get("evicted", 0))


def owed_records(path, decode, producers: Producers, dead_ids: set):
  """After a restart: the logged records a restored producer table still owes (queued at the
  checkpoint, or admitted after it), not dead-lettered, once each, in arrival order.
  Returns ([(trajectory, raw)], frames read, torn frames, end of the last whole frame); a
  frame whose CRC holds but whose bytes do not decode counts as torn."""
  raws, torn, end = AdmissionLog.read(path)
  owed, seen = [], set()
  for raw in raws:
    try:
      traj = decode(raw)
    except Exception:  # its CRC held, its contents do not
      torn += 1
      continue
    key = record_key(traj.traj_id)
    if key in seen or traj.traj_id in dead_ids or not producers.replayable(
        *key, traj.min_policy_version):
      continue
    seen.add(key)
    owed.append((traj, raw))
  return owed, len(raws), torn, end
