"""The learner service: admission, a bounded trajectory queue, the update loop, weight
publication and the run's system metrics. Transport-agnostic: the gRPC server
(`fr_jax.transport.server`) and in-process workers (`fr_jax.transport.client.LocalClient`)
call the same `offer`, `weights` and `heartbeat`.

Semantics (FlashREINFORCE has no group barrier):

* `offer` validates a record and checks its policy lag (learner version minus the oldest
  behaviour version among its action tokens); a refused record is counted under its named
  reason and never enters the queue. An admitted one waits in a FIFO queue whose capacity
  bounds memory: a full queue blocks `offer`, which stalls the worker's stream
  (backpressure).
* Each update takes the next B admitted trajectories in arrival order, re-checking the lag
  against the version they will train (a record that went stale while queued is dropped as
  `stale`). Nothing is replayed: every trajectory id is used at most once, across restarts
  too (the used ids are saved with each checkpoint).
* New weights are published after every `publish_every` updates.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import struct
import threading
import time
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp

from fr_jax.learner.metrics import read_jsonl
from fr_jax.trajectory import REASONS, Trajectory, TrajectoryError, validate

log = logging.getLogger("fr_jax.service")

# Admission rejection reasons: the validator's, plus the service's own.
SERVICE_REASONS = ("stale", "future_version", "duplicate", "decode", "shutdown")
REJECTION_REASONS = REASONS + SERVICE_REASONS
LAG_BINS = (0, 1, 2, 3, 4, 6, 8, 16, 32)  # histogram lower edges


class TrajectoryQueue:
  """A bounded FIFO: `put` blocks while full (backpressure), `take` blocks until n arrive."""

  def __init__(self, capacity: int):
    if capacity < 1:
      raise ValueError(f"queue capacity={capacity} must be >= 1")
    self.capacity = capacity
    self._items: collections.deque = collections.deque()
    self._cv = threading.Condition()
    self.closed = False

  def __len__(self):
    return len(self._items)

  def put(self, item, timeout: Optional[float] = None, force: bool = False) -> bool:
    """False if still full after `timeout` seconds (None: wait forever) or closed. `force`
    ignores the capacity (records replayed after a restart, which were admitted before)."""
    with self._cv:
      ok = self._cv.wait_for(
          lambda: self.closed or force or len(self._items) < self.capacity, timeout)
      if not ok or self.closed:
        return False
      self._items.append(item)
      self._cv.notify_all()
      return True

  def pop(self, timeout: Optional[float] = None):
    """The oldest item, or None after `timeout` seconds / when closed and empty."""
    with self._cv:
      if not self._cv.wait_for(lambda: self._items or self.closed, timeout) or not self._items:
        return None
      item = self._items.popleft()
      self._cv.notify_all()
      return item

  def close(self):
    with self._cv:
      self.closed = True
      self._cv.notify_all()


class InflightController:
  """Adaptive rollouts-in-flight (off by default): additive increase, multiplicative decrease.

  After each update it sees the trust rejection rate (1 - acceptance rate) and the max policy
  lag. Above the rejection target or the lag bound, in-flight rollouts shrink by `decrease`;
  comfortably below both (rejection < target / 2, lag < bound), they grow by one. Fewer
  rollouts in flight means fresher data: lower lag and fewer trust-gate rejections. Every
  adjustment is logged and kept in `history`.
  """

  def __init__(self, initial: int, *, target_rejection: float = 0.1, max_lag: int = 4,
               minimum: int = 1, maximum: int = 256, decrease: float = 0.75):
    if not minimum <= initial <= maximum:
      raise ValueError(f"in-flight initial={initial} not in [{minimum}, {maximum}]")
    self.value, self.target, self.max_lag = initial, target_rejection, max_lag
    self.minimum, self.maximum, self.decrease = minimum, maximum, decrease
    self.history: list[dict] = []

  def observe(self, version: int, acceptance_rate: float, lag_max: int) -> int:
    rejection = 1.0 - acceptance_rate
    new = self.value
    if rejection > self.target or lag_max > self.max_lag:
      new = max(self.minimum, int(self.value * self.decrease))
      why = (f"rejection {rejection:.3f} > {self.target}" if rejection > self.target else
             f"lag {lag_max} > {self.max_lag}")
    elif rejection < self.target / 2 and lag_max < self.max_lag:
      new = min(self.maximum, self.value + 1)
      why = f"rejection {rejection:.3f} < {self.target / 2:.3f} and lag {lag_max} < {self.max_lag}"
    if new != self.value:
      log.info("in-flight %d -> %d at version %d (%s)", self.value, new, version, why)
      self.history.append(dict(version=version, old=self.value, new=new, reason=why))
      self.value = new
    return self.value


class AdmissionLog:
  """Admitted records (serialised), appended before they are acknowledged, so a learner that
  dies loses none: on restart the ones no checkpointed update used are queued again. It is
  compacted after each committed checkpoint to the records still waiting."""

  def __init__(self, path):
    self.path = Path(path)
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self._lock = threading.Lock()
    self._f = open(self.path, "ab")

  @staticmethod
  def _frame(raw: bytes) -> bytes:
    return struct.pack("<I", len(raw)) + raw

  def append(self, raw: bytes) -> None:
    with self._lock:
      self._f.write(self._frame(raw))
      self._f.flush()

  def rewrite(self, raws) -> None:
    with self._lock:
      self._f.close()
      tmp = self.path.with_suffix(".tmp")
      with open(tmp, "wb") as f:
        for raw in raws:
          f.write(self._frame(raw))
      os.replace(tmp, self.path)
      self._f = open(self.path, "ab")

  @staticmethod
  def read(path) -> list[bytes]:
    """Every whole record (a record cut short by a crash mid-write is ignored)."""
    path = Path(path)
    if not path.exists():
      return []
    data, out, i = path.read_bytes(), [], 0
    while i + 4 <= len(data):
      (n,) = struct.unpack_from("<I", data, i)
      if i + 4 + n > len(data):
        break
      out.append(data[i + 4:i + 4 + n])
      i += 4 + n
    return out

  def close(self):
    with self._lock:
      self._f.close()


class LearnerService:
  """Feeds a `Learner` from workers and publishes its weights."""

  def __init__(self, learner, *, queue_capacity: int = 256, max_lag: int = -1,
               publish_every: int = 1, hf_export_dir: str = "", inflight: int = 0,
               controller: Optional[InflightController] = None, max_length: Optional[int] = None,
               admission_log: str = ""):
    self.learner = learner
    self.B = learner.config.batch_size * learner.config.minibatches
    self.queue = TrajectoryQueue(queue_capacity)
    self.max_lag = int(max_lag)
    self.publish_every = max(1, int(publish_every))
    self.hf_export_dir = hf_export_dir
    self.controller = controller
    self.inflight = controller.value if controller else int(inflight)
    self.max_length = max_length or learner.spec.max_trajectory_length
    self._lock = threading.Lock()
    self.rejected = collections.Counter()
    self.admitted = 0
    self.lag_hist = collections.Counter()
    self.max_lag_seen = 0
    self._seen: set[str] = set()  # ids admitted in this process (queued or used)
    self.used: set[str] = set()  # ids consumed by updates (persisted with checkpoints)
    self.workers: dict[str, dict] = {}
    self.shutdown = threading.Event()
    self.updates = 0
    self.idle_s = 0.0
    self.busy_s = 0.0
    self.startup_wait_s = 0.0
    self.arrivals = 0
    self.arrival_tokens = 0
    self.t_start = time.perf_counter()
    self.hf_dir = ""
    self._published: tuple[int, object] = (-1, None)
    self._version = learner.version
    self.log = AdmissionLog(admission_log) if admission_log else None
    self._raw: dict[str, bytes] = {}  # logged records not yet in a committed checkpoint
    self._used_at: dict[int, list[str]] = {}  # version -> ids its update used
    self.publish()

  # --- weights ---
  @property
  def version(self) -> int:
    """The learner's policy version, cached: other threads must never read the state's
    buffers, which each update donates."""
    return self._version

  def publish(self):
    """Snapshots the current weights (a device copy: updates donate the live buffers)."""
    v = self.version
    params = jax.tree.map(jnp.copy, self.learner.params)
    jax.block_until_ready(params)
    if self.hf_export_dir:
      path = Path(self.hf_export_dir) / f"v{v:08d}"
      self.learner.export_hf(path)
      self.hf_dir = str(path)
      for old in sorted(Path(self.hf_export_dir).glob("v*"))[:-2]:  # keep the last two
        shutil.rmtree(old, ignore_errors=True)
    with self._lock:
      self._published = (v, params)

  def weights(self, min_version: int = 0):
    """(version, params) of the published weights if version >= min_version, else None."""
    with self._lock:
      v, p = self._published
    return (v, p) if v >= min_version else None

  # --- admission ---
  def _reject(self, reason: str, traj_id: str, detail: str = "") -> tuple[bool, str]:
    with self._lock:
      self.rejected[reason] += 1
    log.debug("rejected %s: %s %s", traj_id, reason, detail)
    return False, reason

  def lag(self, traj: Trajectory) -> int:
    return self.version - traj.min_policy_version

  def offer(self, traj, *, timeout: Optional[float] = None,
            raw: Optional[bytes] = None, force: bool = False) -> tuple[bool, str]:
    """Admits or refuses one record: (admitted, reason). Blocks while the queue is full.
    `raw` (the serialised record) goes to the admission log before the record is queued."""
    with self._lock:
      self.arrivals += 1
    if isinstance(traj, TrajectoryError):  # failed to decode on the wire
      return self._reject("decode" if traj.reason == "bad_field" else traj.reason, "?",
                          str(traj))
    try:
      validate(traj, max_length=self.max_length)
    except TrajectoryError as e:
      return self._reject(e.reason, getattr(traj, "traj_id", "?"), str(e))
    with self._lock:
      self.arrival_tokens += traj.length
      dup = traj.traj_id in self._seen or traj.traj_id in self.used
    if dup:
      return self._reject("duplicate", traj.traj_id)
    lag = self.lag(traj)
    if self.max_lag >= 0 and lag > self.max_lag:
      return self._reject("stale", traj.traj_id, f"lag {lag}")
    if lag < 0:  # sampled by weights this learner no longer has (it restarted)
      return self._reject("future_version", traj.traj_id, f"lag {lag}")
    if self.shutdown.is_set():
      return self._reject("shutdown", traj.traj_id)
    with self._lock:
      self._seen.add(traj.traj_id)
      if self.log is not None and raw is not None:
        self._raw[traj.traj_id] = raw
    if self.log is not None and raw is not None:
      self.log.append(raw)  # before it can be taken (and long before it is acknowledged)
    if not self.queue.put(traj, timeout, force):
      with self._lock:
        self._seen.discard(traj.traj_id)
        self._raw.pop(traj.traj_id, None)  # its log entry goes at the next compaction
      return False, "queue_full"  # not counted as a rejection: the worker retries
    with self._lock:
      self.admitted += 1
    return True, ""

  def heartbeat(self, worker_id: str, stats: dict) -> dict:
    with self._lock:
      self.workers[worker_id] = dict(stats, last_seen=time.time())
      published = self._published[0]
    return dict(version=published, queue_depth=len(self.queue),
                queue_capacity=self.queue.capacity, inflight_target=self.inflight,
                shutdown=self.shutdown.is_set(), hf_dir=self.hf_dir)

  # --- the update loop ---
  def next_batch(self, stop: threading.Event) -> Optional[list[Trajectory]]:
    """The next B admitted trajectories in arrival order (stale ones dropped), or None when
    stopped."""
    batch = []
    while len(batch) < self.B:
      if stop.is_set() or self.shutdown.is_set():
        return None
      t = self.queue.pop(timeout=0.1)
      if t is None:
        continue
      lag = self.lag(t)
      if self.max_lag >= 0 and lag > self.max_lag:
        self._reject("stale", t.traj_id, f"lag {lag} at take")
        continue
      batch.append(t)
    return batch

  def step(self, batch: list[Trajectory]) -> dict:
    t0 = time.perf_counter()
    for t in batch:
      lag = self.lag(t)
      self.lag_hist[max(b for b in LAG_BINS if b <= lag)] += 1
      self.max_lag_seen = max(self.max_lag_seen, lag)
    m = self.learner.update(batch)
    self._version = self.learner.version
    with self._lock:
      self.used.update(t.traj_id for t in batch)
    self._used_at[self.version] = [t.traj_id for t in batch]
    self.updates += 1
    if self.save():  # before publishing: workers never hold weights a restart would lose
      self.compact_log()
    if self.version % self.publish_every == 0:
      self.publish()
    if self.controller is not None:
      self.inflight = self.controller.observe(self.version, m["acceptance_rate"],
                                              m["policy_lag_max"])
    self.busy_s += time.perf_counter() - t0
    return m

  def run(self, max_updates: int, stop: Optional[threading.Event] = None,
          on_update=None) -> dict:
    """Updates until `max_updates` in total (counting restored ones) or `stop`; saves a
    checkpoint after the last one. Returns the run summary."""
    stop = stop or threading.Event()
    first = True
    t_loop = time.perf_counter()
    while self.version < max_updates and not stop.is_set():
      t0 = time.perf_counter()
      batch = self.next_batch(stop)
      waited = time.perf_counter() - t0
      if first:
        self.startup_wait_s, first = waited, False
        t_loop = time.perf_counter()
      else:
        self.idle_s += waited
      if batch is None:
        break
      m = self.step(batch)
      self.learner.writer.write(self.version, self.system_metrics(), prefix="system/")
      if on_update is not None:
        on_update(m, self)
    self.loop_s = time.perf_counter() - t_loop
    if self.save(force=True):
      self.compact_log()
    return self.summary()

  # --- checkpoints ---
  def save(self, force: bool = False) -> bool:
    data = {"used_ids": sorted(self.used), "rejected": dict(self.rejected),
            "admitted": self.admitted}
    return self.learner.save(data_state=data, force=force)

  def compact_log(self) -> None:
    """Drops from the admission log the records used by updates a committed checkpoint
    holds (an asynchronous save still in flight keeps its records logged)."""
    if self.log is None or self.learner.checkpointer is None:
      return
    committed = self.learner.checkpointer.latest_step() or 0
    done = [v for v in self._used_at if v <= committed]
    with self._lock:
      for v in done:
        for i in self._used_at.pop(v):
          self._raw.pop(i, None)
      raws = list(self._raw.values())
    self.log.rewrite(raws)

  def replay_log(self, decode) -> int:
    """After a restart: queues the logged records no checkpointed update used, in their
    arrival order. Returns how many were queued again."""
    if self.log is None:
      return 0
    raws = AdmissionLog.read(self.log.path)
    self.log.rewrite([])
    n = 0
    for raw in raws:
      traj = decode(raw)
      if traj.traj_id in self.used:
        continue
      ok, _ = self.offer(traj, timeout=0, raw=raw, force=True)
      n += ok
    log.info("admission log: %d of %d records queued again", n, len(raws))
    return n

  def restore(self) -> Optional[dict]:
    """Restores the learner's latest checkpoint and the used ids; drops metric rows written
    after it (their updates are redone), so metrics.jsonl stays one row per version."""
    meta = self.learner.restore()
    if meta is None:
      return None
    self._version = self.learner.version
    data = meta.get("data_state") or {}
    self.used = set(data.get("used_ids", []))
    self.rejected.update(data.get("rejected", {}))
    self.admitted = int(data.get("admitted", 0))
    self.publish()
    jl = self.learner.writer.dir and Path(self.learner.writer.dir) / "metrics.jsonl"
    if jl and jl.exists():
      self.learner.writer.rewrite([r for r in read_jsonl(jl) if r["step"] <= self.version])
    return meta

  # --- metrics ---
  def system_metrics(self) -> dict:
    with self._lock:
      elapsed = max(time.perf_counter() - self.t_start, 1e-9)
      loop = self.idle_s + self.busy_s
      out = dict(queue_depth=len(self.queue), admitted=self.admitted,
                 rejected=sum(self.rejected.values()),
                 learner_idle_fraction=self.idle_s / loop if loop else 0.0,
                 arrivals_per_s=self.arrivals / elapsed,
                 arrival_tokens_per_s=self.arrival_tokens / elapsed,
                 workers=len(self.workers), inflight_target=self.inflight)
      for r, n in self.rejected.items():
        out[f"rejected_{r}"] = n
    return out

  def summary(self) -> dict:
    s = self.system_metrics()
    with self._lock:
      lags = sorted(self.lag_hist)
      return dict(
          updates=self.updates, version=self.version,
          trajectories_admitted=self.admitted, trajectories_used=len(self.used),
          rejected_by_reason=dict(self.rejected),
          max_lag=self.max_lag_seen,
          lag_histogram={str(k): self.lag_hist[k] for k in lags},
          learner_idle_fraction=round(s["learner_idle_fraction"], 4),
          startup_wait_s=round(self.startup_wait_s, 2),
          rollout_trajectories_per_s=round(s["arrivals_per_s"], 3),
          rollout_tokens_per_s=round(s["arrival_tokens_per_s"], 1),
          queue_capacity=self.queue.capacity,
          inflight_adjustments=len(self.controller.history) if self.controller else 0)

  def close(self):
    self.shutdown.set()
    self.queue.close()
    if self.log is not None:
      self.log.close()
