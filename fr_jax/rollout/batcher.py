"""The engine's own thread, for an engine that takes one caller at a time (the embedded one).

Callers from many threads (the gateway's HTTP calls) hand their requests to a `Batcher`; its
thread runs them on the engine: every request waiting when a batch starts joins it (up to
`max_batch`), and with an engine that admits requests while it runs (the embedded one:
`generate(more=, done=)`) every request that arrives later joins the running batch at the
next decode step, and each caller gets its completion as soon as it ends. Weight swaps and
other engine work (`call`) run on the same thread, between decode steps, so they never race
one. `close` lets the batch in progress finish and joins the thread, so that no engine
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
    # an engine whose generate() takes requests while it runs (the embedded one's `more`)
    self.continuous = bool(getattr(engine, "admits_while_running", False))
    self._futs: dict[str, concurrent.futures.Future] = {}  # request id -> its caller
    self._stopping = False  # close's end marker was seen while a batch ran
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
      reqs = self._admit(items)
      if not reqs:
        continue
      err = None
      try:
        if self.continuous:  # later arrivals join the running batch (`_more`, `_done`)
          self.engine.generate(reqs, more=self._more, done=self._done)
        else:
          for c in self.engine.generate(reqs):
            self._done(c)
      except BaseException as e:  # noqa: BLE001 (handed to every caller of the batch)
        err = e
      for rid, fut in self._futs.items():  # left: the engine failed, or lost the request
        fut.set_exception(err or RuntimeError(f"the engine returned no completion for {rid}"))
      self._futs.clear()
      if self._stopping:
        self.q.put(None)

  def _admit(self, items) -> list[Request]:
    """Runs the callables among `items` now; registers the requests and returns them."""
    reqs = []
    for what, fut in items:
      if callable(what):
        try:
          fut.set_result(what())
        except BaseException as e:  # noqa: BLE001 (handed to the caller)
          fut.set_exception(e)
      else:
        self._futs[what.request_id] = fut
        reqs.append(what)
    return reqs

  def _more(self) -> list[Request]:
    """Between decode steps: what has arrived since (weight swaps run here and now)."""
    items = []
    while not self._stopping:
      try:
        nxt = self.q.get_nowait()
      except queue.Empty:
        break
      if nxt is None:
        self._stopping = True
        break
      items.append(nxt)
    return self._admit(items)

  def _done(self, c: Completion) -> None:
    fut = self._futs.pop(c.request_id, None)
    if fut is not None:
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
