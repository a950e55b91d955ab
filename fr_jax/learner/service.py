"""The learner service: admission, a bounded trajectory queue, the update loop, weight
publication and the run's system metrics. Transport-agnostic: the gRPC server
(`fr_jax.transport.server`) and in-process workers (`fr_jax.transport.client.LocalClient`)
call the same `offer`, `weights` and `heartbeat`.

Semantics (FlashREINFORCE has no group barrier):

* `offer` validates a record against the model (named reasons), refuses a duplicate (per-
  producer watermarks, `admission.Producers`) and checks its policy lag (learner version minus
  the oldest behaviour version among its action tokens). An admitted record is written to the
  admission log, durably, before `offer` returns True: that return is the acknowledgement. A
  full queue blocks `offer` (backpressure); a log that cannot be written answers
  `log_unavailable`, and the record counts as never seen, so the worker's retry is admitted.
* Each update takes the next B admitted records in arrival order. One that went stale while
  queued is dead-lettered (`stale`). A non-finite update applies nothing: its offender(s),
  found by bisection on the learner, are dead-lettered (`nonfinite_update`) and the rest go
  back to the front of the queue.
* Every admitted record ends up used by exactly one update, or dead-lettered with a reason,
  across restarts: see `fr_jax/learner/recovery.py` (save, restore, log replay) and
  `fr_jax/learner/admission.py`.
* New weights are published after every `publish_every` updates.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from fr_jax.learner.admission import AdmissionLog, DeadLetters, Producers
from fr_jax.learner.inflight import InflightController
from fr_jax.learner.publish import Publisher
from fr_jax.learner.recovery import Recovery
from fr_jax.learner.trajectory_queue import TrajectoryQueue
from fr_jax.learner.workers import WorkerTable
from fr_jax.trajectory import (
  REASONS,
  RETRY_REASONS,
  Trajectory,
  TrajectoryError,
  record_key,
  validate,
)

log = logging.getLogger("fr_jax.service")

# Admission rejection reasons: the validator's, plus the service's own.
SERVICE_REASONS = ("stale", "future_version", "duplicate", "decode", "shutdown",
                   "producer_expired")
REJECTION_REASONS = REASONS + SERVICE_REASONS
# update_failed: the update raised on the batch; invalid_record: a logged record that
# admission now refuses (a log written by an older learner), named in the detail.
DEAD_LETTER_REASONS = ("stale", "nonfinite_update", "future_version", "update_failed",
                       "invalid_record")
LAG_BINS = (0, 1, 2, 3, 4, 6, 8, 16, 32)  # histogram lower edges

__all__ = ["LearnerService", "InflightController", "REJECTION_REASONS", "RETRY_REASONS"]


class LearnerService(Recovery):
  """Feeds a `Learner` from workers and publishes its weights.

  `encode`/`decode` turn a Trajectory into the bytes the log and dead-letter file keep and
  back (the transport's codec); `admission_log` and `dead_letter` are file paths ("" keeps
  none: in-process runs, whose workers die with the learner). `keep_versions` published
  versions stay available by number (`weights_at`: a worker at a fixed lag)."""

  def __init__(self, learner, *, queue_capacity: int = 256, max_lag: int = -1,
               publish_every: int = 1, hf_export_dir: str = "",
               controller: InflightController | None = None, max_length: int | None = None,
               admission_log: str = "", dead_letter: str = "", log_fsync: bool = True,
               max_producers: int = 65536, producer_ttl_versions: int = 100,
               worker_timeout_s: float = 300.0, keep_versions: int = 1,
               encode: Callable | None = None, decode: Callable | None = None):
    self.learner = learner
    self.B = learner.config.batch_size * learner.config.minibatches
    self.queue = TrajectoryQueue(queue_capacity)
    self.max_lag = int(max_lag)
    self.publish_every = max(1, int(publish_every))
    self.publisher = Publisher(learner, hf_export_dir, keep=keep_versions)
    self.controller = controller
    self.inflight = controller.value if controller else 0
    # Records are validated once, here, with one length limit: the run's (the agent's
    # max_total_tokens, which config validation keeps within what a packed row holds), or
    # else the row's. The learner's update takes them as they are.
    limits = learner.record_limits
    self.limits = dict(limits, max_length=min(max_length or limits["max_length"],
                                              limits["max_length"]))
    self._taken_lag: dict[str, int] = {}  # traj_id -> policy lag when the batch was taken
    self.encode, self.decode = encode, decode
    self._lock = threading.Lock()  # counters and the workers table
    self._admit = threading.Condition()  # the producer table and in-flight admissions
    self._reserved: set = set()  # (producer, seq) being admitted right now
    self.producers = Producers(max_producers, producer_ttl_versions)
    self.rejected = collections.Counter()
    self.admitted = 0
    self.used = 0  # records used by updates (persisted with checkpoints)
    self.lag_hist = collections.Counter()
    self.max_lag_seen = 0
    self.workers = WorkerTable(worker_timeout_s)
    self.shutdown = threading.Event()
    self.updates = 0
    self.idle_s = self.busy_s = self.startup_wait_s = self.loop_s = 0.0
    self.arrivals = 0
    self.arrival_tokens = 0
    self.t_start = time.perf_counter()
    self._version = learner.version
    self.log = AdmissionLog(admission_log, fsync=log_fsync) if admission_log else None
    self.dead = DeadLetters(dead_letter or None)
    self._dead_pending: list = []  # (rows, trajs) whose dead-letter write failed
    self._compacted_at = -1
    self.log_torn_frames = 0
    self.replayed = 0
    self.publish()

  # --- weights ---
  @property
  def version(self) -> int:
    """The learner's policy version, cached: other threads must never read the state's
    buffers, which each update donates."""
    return self._version

  def publish(self):
    """Publishes the current weights for workers (see `Publisher`)."""
    self.publisher.publish(self.version)

  def weights(self, min_version: int = 0):
    """(version, params) of the published weights if version >= min_version, else None."""
    return self.publisher.weights(min_version)

  def lora_weights(self, min_version: int, form: str):
    """A LoRA run's version as base + adapters or adapters alone (`Publisher.lora_weights`)."""
    return self.publisher.lora_weights(min_version, form)

  def weights_at(self, version: int):
    """("ok", params) of exactly `version`, or ("not_yet" | "gone", None) (`Publisher`)."""
    return self.publisher.weights_at(version)

  @property
  def hf_dir(self) -> str:
    return self.publisher.hf_dir

  # --- admission ---
  def _reject(self, reason: str, traj_id: str, detail: str = "") -> tuple[bool, str]:
    with self._lock:
      self.rejected[reason] += 1
    log.debug("rejected %s: %s %s", traj_id, reason, detail)
    return False, reason

  def lag(self, traj: Trajectory) -> int:
    return traj.policy_lag(self.version)

  def offer(self, traj, *, timeout: float | None = None,
            raw: bytes | None = None) -> tuple[bool, str]:
    """Admits or refuses one record: (admitted, reason). True is the acknowledgement: the
    record is in the queue and, when `raw` (its serialised form) is given and the service
    keeps a log, durably in the admission log. Blocks while the queue is full. Reasons in
    `RETRY_REASONS` are not answers: nothing was recorded and the caller should retry."""
    with self._lock:
      self.arrivals += 1
    if isinstance(traj, TrajectoryError):  # failed to decode on the wire
      return self._reject("decode" if traj.reason == "bad_field" else traj.reason, "?",
                          str(traj))
    try:
      self.check(traj)
    except TrajectoryError as e:
      return self._reject(e.reason, getattr(traj, "traj_id", "?")[:64], str(e))
    with self._lock:
      self.arrival_tokens += traj.length
    key = record_key(traj.traj_id)
    with self._admit:
      while key in self._reserved:  # the same record on another stream: wait for its fate
        self._admit.wait()
      if self.producers.is_duplicate(*key):
        why = "duplicate"
      elif self.producers.is_expired(key[0], traj.min_policy_version):
        why = "producer_expired"
      else:
        why = ""
        self._reserved.add(key)
    if why:
      return self._reject(why, traj.traj_id)
    try:
      return self._admit_reserved(traj, key, raw, timeout)
    finally:
      with self._admit:
        self._reserved.discard(key)
        self._admit.notify_all()

  def check(self, traj) -> None:
    """Admission's check of one record (raises TrajectoryError with its reason); a dense
    learner drops routing a record carries (it would only be stored)."""
    validate(traj, **self.limits)
    if "routing" not in self.limits:
      traj.routed_experts = None

  def _admit_reserved(self, traj, key, raw, timeout) -> tuple[bool, str]:
    lag = self.lag(traj)
    if self.max_lag >= 0 and lag > self.max_lag:
      return self._reject("stale", traj.traj_id, f"lag {lag}")
    if lag < 0:  # sampled by weights this learner no longer has (it restarted)
      return self._reject("future_version", traj.traj_id, f"lag {lag}")
    if self.shutdown.is_set() or not self.queue.reserve(timeout):
      if self.shutdown.is_set() or self.queue.closed:
        return self._reject("shutdown", traj.traj_id)
      return False, "queue_full"
    if self.log is not None and raw is not None:
      try:
        self.log.append(traj.traj_id, raw)  # durable before it is acknowledged
      except OSError as e:
        self.queue.unreserve()
        if self.log.write_failures in (1, 10, 100) or self.log.write_failures % 1000 == 0:
          log.warning("admission log write failed (%s, %d so far): answering "
                      "log_unavailable; workers retry", e, self.log.write_failures)
        return False, "log_unavailable"
    with self._admit:
      self.producers.admit(*key, self.version, self.publisher.version)
    self.queue.commit(traj)
    with self._lock:
      self.admitted += 1
    return True, ""

  def heartbeat(self, worker_id: str, stats: dict) -> dict:
    now = time.time()
    with self._lock:
      self.workers.seen(worker_id, stats, now)
    return dict(version=self.publisher.version, queue_depth=len(self.queue),
                queue_capacity=self.queue.capacity, inflight_target=self.inflight,
                shutdown=self.shutdown.is_set(), hf_dir=self.hf_dir)

  # --- settling records: used or dead-lettered ---
  def _settle(self, trajs, version: int) -> None:
    with self._admit:
      for t in trajs:
        self.producers.settle(*record_key(t.traj_id))
    if self.log is not None:
      self.log.settle([t.traj_id for t in trajs], version)

  def _dead_letter(self, trajs, reason: str, detail: str = "") -> None:
    """Dead-letters records, durably, then settles them (a final decision: the log may drop
    them at its next compaction). If the file cannot be written they stay owed and the write
    is retried with the next dead letter."""
    assert reason in DEAD_LETTER_REASONS, reason
    v = self.version
    keep_record = reason != "stale"  # stale drops are common; offenders are kept whole
    rows = [DeadLetters.row(t, reason, v, detail, self.encode(t) if (
        keep_record and self.encode) else None) for t in trajs]
    pending, self._dead_pending = self._dead_pending + [(rows, list(trajs))], []
    for rows, ts in pending:
      for r in rows:
        r["version"] = v
      try:
        self.dead.add(rows)
      except OSError as e:
        log.error("dead-letter write failed (%s); %d record(s) stay owed", e, len(ts))
        self._dead_pending.append((rows, ts))
        continue
      self._settle(ts, -1)
      with self._lock:
        for r in rows:
          if r["reason"] == "stale":
            self.rejected["stale"] += 1

  # --- the update loop ---
  def next_batch(self, stop: threading.Event) -> list[Trajectory] | None:
    """The next B admitted trajectories in arrival order (stale ones dead-lettered), or None
    when stopped (anything taken goes back to the queue)."""
    batch, self._taken_lag = [], {}
    while len(batch) < self.B:
      if stop.is_set() or self.shutdown.is_set():
        self.queue.push_front(batch)
        return None
      t = self.queue.pop(timeout=0.1)
      if t is None:
        continue
      lag = self.lag(t)
      if self.max_lag >= 0 and lag > self.max_lag:
        self._dead_letter([t], "stale", f"lag {lag} > max_policy_lag {self.max_lag} at take")
        continue
      self._taken_lag[t.traj_id] = lag
      batch.append(t)
    return batch

  def step(self, batch: list[Trajectory]) -> dict:
    t0 = time.perf_counter()
    # The lags measured when the batch was taken (no update ran since).
    lags = {t.traj_id: self._taken_lag.get(t.traj_id, self.lag(t)) for t in batch}
    try:
      m = self.learner.update(batch, lags=[lags[t.traj_id] for t in batch])
    except Exception as e:  # noqa: BLE001 -- any error the batch causes; the state decides
      if not self.learner.state_intact():
        raise  # the update consumed the state: restart from the last checkpoint
      # A batch that makes the update raise would do so again: it is not retried.
      detail = f"{type(e).__name__}: {str(e)[:500]}"
      self._dead_letter(batch, "update_failed", detail)
      log.error("update at version %d raised on its batch (%s); dead-lettered %d record(s)",
                self.version, detail, len(batch))
      self.busy_s += time.perf_counter() - t0
      return {"finite": False, "update_failed": detail}  # nothing applied
    skipped = set(m.get("skipped_traj_ids") or ())
    if skipped:
      self._quarantine([t for t in batch if t.traj_id in skipped])
    self._version = self.learner.version
    used = [t for t in batch if t.traj_id not in skipped]
    if used:
      for t in used:
        lag = lags[t.traj_id]
        self.lag_hist[max(b for b in LAG_BINS if b <= lag)] += 1
        self.max_lag_seen = max(self.max_lag_seen, lag)
      self._settle(used, self.version)
      with self._lock:
        self.used += len(used)
      self.updates += 1
      self.save()  # before publishing: a restart never goes back past a committed version
      if self.version % self.publish_every == 0:
        self.publish()
      if self.controller is not None:
        self.inflight = self.controller.observe(self.version, m["acceptance_rate"],
                                                m["policy_lag_max"])
    self.compact_log()
    self.busy_s += time.perf_counter() - t0
    return m

  def _quarantine(self, bad: list[Trajectory]) -> None:
    """A non-finite update: dead-letter the records that make it so, give the rest back."""
    idx = self.learner.find_offenders(bad)
    detail = "the update's loss or gradient is not finite with this record"
    if not idx:  # only the records together are non-finite: none can be singled out
      idx, detail = list(range(len(bad))), "non-finite update, not attributable to one record"
    offenders = [bad[i] for i in idx]
    rest = [t for i, t in enumerate(bad) if i not in set(idx)]
    self._dead_letter(offenders, "nonfinite_update", detail)
    self.queue.push_front(rest)
    log.warning("non-finite update at version %d: quarantined %s; %d record(s) given back",
                self.version, [t.traj_id for t in offenders], len(rest))

  def run(self, max_updates: int, stop: threading.Event | None = None,
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
      if on_update is not None and m.get("finite", True):
        on_update(m, self)
    self.loop_s = time.perf_counter() - t_loop
    self.save(force=True)
    return self.summary()

  # --- metrics ---
  def system_metrics(self) -> dict:
    with self._lock:
      self.workers.prune(time.time())
      elapsed = max(time.perf_counter() - self.t_start, 1e-9)
      loop = self.idle_s + self.busy_s
      out = dict(queue_depth=len(self.queue), admitted=self.admitted,
                 rejected=sum(self.rejected.values()),
                 dead_lettered=sum(self.dead.counts.values()),
                 learner_idle_fraction=self.idle_s / loop if loop else 0.0,
                 arrivals_per_s=self.arrivals / elapsed,
                 arrival_tokens_per_s=self.arrival_tokens / elapsed,
                 workers=len(self.workers), producers=len(self.producers),
                 inflight_target=self.inflight)
      out.update({f"rejected_{r}": n for r, n in self.rejected.items()})
      if self.log is not None:
        out.update(log_records=len(self.log), log_bytes=self.log.size_bytes,
                   log_write_failures=self.log.write_failures)
    return out

  def summary(self) -> dict:
    s = self.system_metrics()
    with self._lock:
      return dict(
          updates=self.updates, version=self.version,
          trajectories_admitted=self.admitted, trajectories_used=self.used,
          rejected_by_reason=dict(self.rejected),
          dead_lettered_by_reason=dict(self.dead.counts),
          max_lag=self.max_lag_seen,
          lag_histogram={str(k): self.lag_hist[k] for k in sorted(self.lag_hist)},
          learner_idle_fraction=round(s["learner_idle_fraction"], 4),
          startup_wait_s=round(self.startup_wait_s, 2),
          update_loop_s=round(self.loop_s, 1),
          learner_compile_s=round(self.learner.compile_s, 1),
          rollout_trajectories_per_s=round(s["arrivals_per_s"], 3),
          rollout_tokens_per_s=round(s["arrival_tokens_per_s"], 1),
          queue_capacity=self.queue.capacity,
          replayed=self.replayed, log_torn_frames=self.log_torn_frames,
          log_write_failures=self.log.write_failures if self.log else 0,
          producers=len(self.producers), producers_evicted=self.producers.evicted,
          inflight_adjustments=len(self.controller.history) if self.controller else 0)

  def close(self):
    self.shutdown.set()
    self.queue.close()
    if self.log is not None:
      self.log.close()
