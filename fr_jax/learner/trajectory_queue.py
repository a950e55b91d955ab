"""The learner's bounded trajectory queue: FIFO, with backpressure.

A producer first `reserve`s a slot (blocking while the queue is full, which is how a full
learner stalls its workers), makes the record durable, then `commit`s it into the slot; so a
record is never durable without room waiting for it. `push_front` returns records taken for
an update that did not use them.
"""

from __future__ import annotations

import collections
import threading


class TrajectoryQueue:
  """A bounded FIFO. `reserve` waits for a free slot (backpressure) that `commit` fills;
  `put` is both. `push_front` returns records taken but not used."""

  def __init__(self, capacity: int):
    if capacity < 1:
      raise ValueError(f"queue capacity={capacity} must be >= 1")
    self.capacity = capacity
    self._items: collections.deque = collections.deque()
    self._reserved = 0
    self._cv = threading.Condition()
    self.closed = False

  def __len__(self):
    return len(self._items)

  def reserve(self, timeout: float | None = None, force: bool = False) -> bool:
    """False if still full after `timeout` seconds (None: wait forever) or closed. `force`
    ignores the capacity (records replayed after a restart, admitted before)."""
    with self._cv:
      ok = self._cv.wait_for(lambda: self.closed or force or
                             len(self._items) + self._reserved < self.capacity, timeout)
      if not ok or self.closed:
        return False
      self._reserved += 1
      return True

  def unreserve(self) -> None:
    with self._cv:
      self._reserved -= 1
      self._cv.notify_all()

  def commit(self, item) -> None:
    with self._cv:
      self._reserved -= 1
      self._items.append(item)
      self._cv.notify_all()

  def put(self, item, timeout: float | None = None, force: bool = False) -> bool:
    if not self.reserve(timeout, force):
      return False
    self.commit(item)
    return True

  def push_front(self, items) -> None:
    with self._cv:
      self._items.extendleft(reversed(list(items)))
      self._cv.notify_all()

  def pop(self, timeout: float | None = None):
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
