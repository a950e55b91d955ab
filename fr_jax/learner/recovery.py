"""The learner service's durability: checkpoints, log compaction, and restart.

`LearnerService` mixes this in; it is split out because it is the one part a reader checks
for "what survives a crash". A checkpoint holds the train state plus the producer watermarks
and counts (`save`). The admission log is compacted only up to a *committed* checkpoint
(`compact_log`). A restart restores the newest committed checkpoint and replays from the log
exactly the records it still owes, neither used by a checkpointed update nor dead-lettered
(`restore`, `_replay`).
"""

from __future__ import annotations

import logging

from fr_jax.learner.admission import owed_records
from fr_jax.trajectory import TrajectoryError, record_key

log = logging.getLogger("fr_jax.service")


class Recovery:
  """Checkpoint, compaction and restart methods of `LearnerService` (which owns the state
  they read: learner, producers, admission log, dead letters, queue, counters)."""

  def save(self, force: bool = False) -> bool:
    with self._admit:
      producers = self.producers.state()
    with self._lock:
      data = {"producers": producers, "rejected": dict(self.rejected),
              "admitted": self.admitted, "used": self.used}
    return self.learner.save(data_state=data, force=force)

  def compact_log(self) -> None:
    """Drops from the admission log the records settled by updates a *committed*
    checkpoint holds. An asynchronous save still being written is not committed: a crash
    now would restart from the checkpoint before it."""
    if self.log is None:
      return
    ck = self.learner.checkpointer
    committed = ck.committed_step() if ck is not None else self.version
    if committed is None or committed == self._compacted_at:
      return
    self.log.compact(committed)
    self._compacted_at = committed

  def restore(self) -> dict | None:
    """Restores the latest committed checkpoint (parameters, optimizer, version, producer
    watermarks, counts; `Learner.restore` forgets the metric rows of updates it does not
    hold, which are redone); queues again what the admission log still owes (neither used
    by a checkpointed update nor dead-lettered). Returns the checkpoint's meta, or None
    when starting fresh."""
    meta = self.learner.restore()
    if meta is not None:
      self._version = self.learner.version
      data = meta.get("data_state") or {}
      self.producers.load(data.get("producers", {}))
      self.rejected.update(data.get("rejected", {}))
      self.admitted = int(data.get("admitted", 0))
      self.used = int(data.get("used", 0))
      self.publish()
    self._replay()
    return meta

  def _replay(self) -> None:
    """Queues again the logged records the restored state still owes, in arrival order;
    records sampled by weights newer than the restored ones are dead-lettered."""
    if self.log is None:
      return
    if self.decode is None:
      raise ValueError("a service with an admission log needs `decode` to replay it")
    owed, frames, torn, end = owed_records(self.log.path, self.decode, self.producers,
                                           self.dead.ids())
    self.producers.forget_unsettled()
    self.log.reset([(t.traj_id, r) for t, r in owed], end)
    future, invalid = [], 0
    for traj, _ in owed:
      self.producers.admit(*record_key(traj.traj_id), self.version, self.publisher.version)
      try:  # admitted under another config or an older learner's checks: check again
        self.check(traj)
      except TrajectoryError as e:
        self._dead_letter([traj], "invalid_record", f"{e.reason}: {e}")
        invalid += 1
        continue
      if self.lag(traj) < 0:
        future.append(traj)
      else:
        self.queue.put(traj, force=True)
    if future:
      self._dead_letter(future, "future_version", "sampled by weights newer than the "
                        f"checkpoint restored at version {self.version}")
    self.log_torn_frames += torn
    self.replayed = len(owed) - len(future) - invalid
    log.info("admission log: %d of %d records queued again, %d dead-lettered "
             "(future_version), %d refused (invalid_record), %d torn frame(s) skipped",
             self.replayed, frames, len(future), invalid, torn)
