"""What a rollout worker needs from the learner, over gRPC or in-process (same interface).

* `push(traj)` hands a finished trajectory over; it blocks while the learner's queue is full
  (backpressure).
* `get_weights(min_version)` -> (version, params, hf_dir) or None if the learner has nothing
  that new.
* `heartbeat(stats)` -> the learner's version, queue depth, in-flight target, shutdown flag
  (None while the learner is unreachable).

`GrpcClient` keeps one trajectory stream open, with at most `max_unacked` records sent and
not yet acknowledged, so a full learner queue stalls the worker instead of piling records
into gRPC's buffers. Unacknowledged records are re-sent after a reconnect (the learner drops
any it already holds as `duplicate`); acknowledged ones are in the learner's admission log,
which survives its restart. Reconnects back off exponentially.
`LocalClient` calls the service directly: threads in one process share the model and the
devices, and nothing is serialised.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Optional

import grpc
import jax.numpy as jnp

from fr_jax.transport import codec
from fr_jax.transport import fr_jax_pb2 as pb
from fr_jax.transport import rpc
from fr_jax.transport.server import CHANNEL_OPTIONS

log = logging.getLogger("fr_jax.transport")


class LocalClient:
  """In-process: calls the LearnerService directly."""

  def __init__(self, service, worker_id: str = "local"):
    self.service, self.worker_id = service, worker_id
    self.acks = collections.Counter()

  def push(self, traj, stop: Optional[threading.Event] = None) -> None:
    while True:
      ok, reason = self.service.offer(traj, timeout=1.0)
      if reason != "queue_full" or self.service.shutdown.is_set() or (stop and stop.is_set()):
        break
    self.acks["admitted" if ok else reason] += 1

  def get_weights(self, min_version: int):
    got = self.service.weights(min_version)
    return None if got is None else (got[0], got[1], self.service.hf_dir)

  def heartbeat(self, stats: dict) -> Optional[dict]:
    return self.service.heartbeat(self.worker_id, stats)

  def flush(self, timeout: float = 0.0) -> bool:
    return True

  def close(self):
    pass


class GrpcClient:
  def __init__(self, address: str, *, worker_id: str = "worker", token: str = "",
               tls_ca: str = "", outbox_size: int = 8, max_unacked: int = 8,
               backoff_min: float = 0.2,
               backoff_max: float = 5.0):
    self.address, self.worker_id = address, worker_id
    if tls_ca:
      with open(tls_ca, "rb") as f:
        creds = grpc.ssl_channel_credentials(f.read())
      self.channel = grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS)
    else:
      self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    self.stub = rpc.Stub(self.channel)
    self._md = (("authorization", f"Bearer {token}"),) if token else None
    self._outbox: queue.Queue = queue.Queue(maxsize=outbox_size)
    self._pending: collections.deque = collections.deque()  # sent, not yet acknowledged
    self.max_unacked = max_unacked  # gRPC would otherwise buffer the whole outbox
    self.acks = collections.Counter()
    self.reconnects = 0
    self.backoff_min, self.backoff_max = backoff_min, backoff_max
    self._closed = threading.Event()
    self._sender = threading.Thread(target=self._send_loop, name=f"push-{worker_id}",
                                    daemon=True)
    self._sender.start()

  # --- trajectories ---
  def push(self, traj, stop: Optional[threading.Event] = None) -> None:
    """Queues one record for the stream; blocks while the outbox is full (until `stop`)."""
    msg = codec.trajectory_to_proto(traj, self.worker_id) if not isinstance(
        traj, pb.Trajectory) else traj
    while not self._closed.is_set() and not (stop is not None and stop.is_set()):
      try:
        self._outbox.put(msg, timeout=0.5)
        return
      except queue.Full:
        continue

  def _requests(self, resend):
    yield from resend  # already in _pending
    while not self._closed.is_set():
      if len(self._pending) >= self.max_unacked:  # the learner is holding back: so do we
        time.sleep(0.01)
        continue
      try:
        m = self._outbox.get(timeout=0.2)
      except queue.Empty:
        continue
      self._pending.append(m)
      yield m

  def _send_loop(self):
    backoff = self.backoff_min
    while not self._closed.is_set():
      resend = list(self._pending)  # stays pending until acknowledged
      try:
        for ack in self.stub.PushTrajectories(self._requests(resend), metadata=self._md):
          if self._pending:
            self._pending.popleft()
          self.acks["admitted" if ack.admitted else ack.reason] += 1
          backoff = self.backoff_min
      except grpc.RpcError as e:
        if self._closed.is_set():
          break
        self.reconnects += 1
        log.warning("trajectory stream to %s broke (%s); %d unacknowledged, retrying in %.1fs",
                    self.address, e.code(), len(self._pending), backoff)
        time.sleep(backoff)
        backoff = min(backoff * 2, self.backoff_max)

  def flush(self, timeout: float = 30.0) -> bool:
    """Waits until every pushed record is acknowledged; False on timeout."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
      if self._outbox.empty() and not self._pending:
        return True
      time.sleep(0.05)
    return False

  # --- weights and stats ---
  def get_weights(self, min_version: int, timeout: float = 300.0):
    try:
      chunks = self.stub.GetWeights(pb.WeightsRequest(min_version=min_version,
                                                      worker_id=self.worker_id),
                                    metadata=self._md, timeout=timeout)
      chunks = list(chunks)
    except grpc.RpcError as e:
      log.warning("weights fetch from %s failed: %s", self.address, e.code())
      return None
    if not chunks:
      return None
    v, flat, hf_dir = codec.assemble_weights(chunks)
    return v, codec.unflatten({k: jnp.asarray(a) for k, a in flat.items()}), hf_dir

  def heartbeat(self, stats: dict, timeout: float = 5.0) -> Optional[dict]:
    try:
      r = self.stub.Heartbeat(pb.WorkerStats(worker_id=self.worker_id, **stats),
                              metadata=self._md, timeout=timeout)
    except grpc.RpcError:
      return None
    return dict(version=r.version, queue_depth=r.queue_depth, queue_capacity=r.queue_capacity,
                inflight_target=r.inflight_target, shutdown=r.shutdown, hf_dir=r.hf_dir,
                stats_json=r.stats_json)

  def close(self):
    self._closed.set()
    self.channel.close()
    self._sender.join(timeout=5)
