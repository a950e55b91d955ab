"""The engine's own thread, for an engine that takes one caller at a time (the embedded one).

Callers from many threads (the gateway's HTTP calls) hand their requests to a `Batcher`; its
thread runs them on the engine in batches: every request waiting when a batch starts joins it
(up to `max_batch`), and the engine's continuous batching interleaves them. Weight swaps and
other engine work (`call`) run on the same thread, between batches, so they never race a
decode step. `close` lets the batch in progress finish and joins the thread, so that no engine
work is left running when the process ends.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading

from fr_jax.rollout.engine import Completion, Request


class EngineClosed(RuntimeError):
  """A request handed to a Batcher that has closed."""


class Batcher:
  """`engine` on its own thread, batching the calls that wait (module docstring)."""

  def __init__(self, engine, max_batch: int):
    self.engine, self.max_batch = engine, max(1, max_batch)
    self.closed = False
    self._lock = threading.Lock()  # no request queued behind close's end marker
    self.q: queue.Queue = queue.Queue()
    self.thread = threading.Thread(target=self._run, daemon=True, name="gateway-engine")
    self.thread.start()

  def generate(self, req: Request) -> Completion:
    return self._submit(req)

  def call(self, fn) -> None:
    """Runs fn() on the engine thread, between batches; returns when it has run."""
    self._submit(fn)

  def _submit(self, what):
    fut: concurrent.futures.Future = concurrent.futures.Future()
    with self._lock:
      if self.closed:
        raise EngineClosed("the engine's thread has stopped")
      self.q.put((what, fut))
    return fut.result()

  def _run(self):
    while True:
      item = self.q.get()
      if item is None:
        self._refuse_waiting()
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

  def _refuse_waiting(self):
    while True:
      try:
        item = self.q.get_nowait()
      except queue.Empty:
        return
      if item is not None:
        item[1].set_exception(EngineClosed("the engine's thread has stopped"))

  def close(self, timeout: float = 60.0):
    """Lets the batch in progress end, refuses what waits, and joins the thread."""
    with self._lock:
      self.closed = True
      self.q.put(None)
    self.thread.join(timeout=timeout)
    if self.thread.is_alive():
      raise RuntimeError(f"the engine's batch did not end within {timeout:.0f} s")
