"""The learner service's table of workers: the stats of each one's last heartbeat, kept
bounded. Callers serialise access (the service holds its lock)."""

from __future__ import annotations

MAX_WORKERS_TRACKED = 4096


class WorkerTable(dict):
  """worker id -> its last heartbeat's stats plus `last_seen` (time.time()). Workers silent
  for `timeout_s` are forgotten, and the least recently seen beyond `cap`."""

  def __init__(self, timeout_s: float, cap: int = MAX_WORKERS_TRACKED):
    super().__init__()
    self.timeout_s, self.cap = float(timeout_s), cap
    self._pruned_at = 0.0

  def seen(self, worker_id: str, stats: dict, now: float) -> None:
    self[worker_id[:256]] = dict(stats, last_seen=now)
    self.prune(now)

  def prune(self, now: float) -> None:
    """At most once a second (or per half timeout): the pass is O(workers)."""
    if now - self._pruned_at < min(1.0, self.timeout_s / 2):
      return
    self._pruned_at = now
    for w in [w for w, s in self.items() if now - s["last_seen"] > self.timeout_s]:
      del self[w]
    if len(self) > self.cap:
      for w in sorted(self, key=lambda w: self[w]["last_seen"])[:len(self) - self.cap]:
        del self[w]
