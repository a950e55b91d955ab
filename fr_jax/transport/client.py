"""What a rollout worker needs from the learner, over gRPC or in-process (same interface).

* `push(traj)` hands a finished trajectory over; it blocks while the learner's queue is full
  (backpressure).
* `get_weights(min_version)` -> (version, params, hf_dir) or None if the learner has nothing
  that new.
* `heartbeat(stats)` -> the learner's version, queue depth, in-flight target, shutdown flag
  (None while the learner is unreachable).

`GrpcClient` keeps one trajectory stream open with at most `max_unacked` records sent and
not yet acknowledged, so a full learner queue stalls the worker instead of piling records into
gRPC's buffers. Acknowledgements carry the record id and settle exactly that record. A record
stays pending until its own acknowledgement arrives; after a reconnect every pending record is
sent again, in order, before anything new (the learner answers `duplicate` for one it already
holds, which is an acknowledgement too). Each stream gets a generation number and only the
current one may take records from the outbox, so a stream that died inside gRPC's consumer
thread can never swallow one. Reconnects back off exponentially; the backoff starts over after
an acknowledgement or a stream that stayed up for `STREAM_UP_S` (an idle client gets no acks).
An acknowledged record is in the learner's admission log, which survives its restart.

`on_ack(traj_id, admitted, reason)` is called once per acknowledged record (an audit ledger
for the chaos run, `launch.worker --ack_ledger`).
`LocalClient` calls the service directly: threads in one process share the model and the
devices, and nothing is serialised.
A LoRA run's worker (`lora=True`) fetches its first version as the frozen base and the
adapters, unmerged, keeps the base, and from then on fetches the adapters' bytes only; the
params it hands back are base + adapters, which its engine folds (`decoder.decode_layout`).
A learner that does not have them at hand answers with the merged model, used as it is.
`WeightsClient` is the part of `GrpcClient` without a trajectory stream (weights and
heartbeats only), for processes that only follow the learner's weights: the weight relay
beside each SGLang server (`fr_jax/transport/relay.py`), which also asks for manifests
(`manifest`) and pieces from any learner process or peer relay (`open_shards`, over channels
with the same credentials).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import jax.numpy as jnp

from fr_jax.models import lora as lora_lib
from fr_jax.trajectory import RETRY_REASONS
from fr_jax.transport import codec, rpc
from fr_jax.transport import fr_jax_pb2 as pb
from fr_jax.transport.server import CHANNEL_OPTIONS

log = logging.getLogger("fr_jax.transport")
STREAM_UP_S = 1.0  # a stream that broke after this long was established: back off afresh


class LocalClient:
  """In-process: calls the LearnerService directly."""

  def __init__(self, service, worker_id: str = "local", *, durable: bool = False):
    self.service, self.worker_id = service, worker_id
    # durable: hand the service each record serialised, so a service that keeps an admission
    # log writes it there before admitting it (a producer that forgets what the learner
    # acknowledged, such as the gateway's journal, needs it to survive a crash).
    self.durable = durable
    self.acks = collections.Counter()

  def push(self, traj, stop: threading.Event | None = None) -> tuple[bool, str]:
    """Offers `traj` until it is admitted or refused for good (or `stop`, or the service
    shuts down); returns the last (admitted, reason)."""
    raw = codec.encode_record(traj) if self.durable else None
    while True:
      ok, reason = self.service.offer(traj, timeout=1.0, raw=raw)
      if reason not in RETRY_REASONS or self.service.shutdown.is_set() or (
          stop and stop.is_set()):
        break
      if reason == "log_unavailable":
        time.sleep(0.5)
    self.acks["admitted" if ok else reason] += 1
    return ok, reason

  def get_weights(self, min_version: int):
    got = self.service.weights(min_version)
    return None if got is None else (got[0], got[1], self.service.hf_dir)

  def weights_at(self, version: int):
    return self.service.weights_at(version)

  def heartbeat(self, stats: dict) -> dict | None:
    return self.service.heartbeat(self.worker_id, stats)

  def flush(self, timeout: float = 0.0) -> bool:
    return True

  def close(self):
    pass


def channel_credentials(tls_ca: str, tls_cert: str = "", tls_key: str = ""):
  """Credentials to reach a TLS learner (with a client certificate for mutual TLS)."""
  return grpc.ssl_channel_credentials(
      Path(tls_ca).read_bytes(), private_key=Path(tls_key).read_bytes() if tls_key else None,
      certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None)


class WeightsClient:
  """Weights and heartbeats over gRPC; no trajectory stream."""

  def __init__(self, address: str, *, worker_id: str = "worker", token: str = "",
               tls_ca: str = "", tls_cert: str = "", tls_key: str = "", lora: bool = False):
    self.address, self.worker_id = address, worker_id
    self.lora = lora  # fetch a LoRA run's versions as adapters (module docstring)
    self._lora_base: dict | None = None  # the frozen base, once fetched (flat)
    self._tls = (tls_ca, tls_cert, tls_key)
    self.channel = self._channel(address)
    self.stub = rpc.Stub(self.channel)
    self._md = (("authorization", f"Bearer {token}"),) if token else None
    self._stubs = {"": self.stub, address: self.stub}  # shard sources by address
    self._stubs_lock = threading.Lock()
    self._peer_channels: list[grpc.Channel] = []

  def _channel(self, address: str) -> grpc.Channel:
    return (grpc.secure_channel(address, channel_credentials(*self._tls),
                                options=CHANNEL_OPTIONS) if self._tls[0]
            else grpc.insecure_channel(address, options=CHANNEL_OPTIONS))

  def manifest(self, min_version: int, serve_address: str = "", timeout: float = 30.0):
    """(version, manifest JSON, hosts, parent) of the learner's shards if their version >=
    min_version; None if nothing that new. Raises grpc.RpcError: UNIMPLEMENTED from a
    learner that does not serve shards, UNAVAILABLE while it cannot be reached."""
    r = self.stub.GetManifest(pb.ManifestRequest(min_version=min_version,
                                                 worker_id=self.worker_id,
                                                 serve_address=serve_address),
                              metadata=self._md, timeout=timeout)
    return None if r.version < 0 else (r.version, r.manifest, list(r.hosts), r.parent)

  def open_shards(self, address: str, version: int, pieces: list[int],
                  base_version: int | None = None, timeout: float = 3600.0):
    """The chunk stream of `pieces` of `version` from the shard server at `address` ("": the
    learner's), as deltas against `base_version` where it sends them."""
    with self._stubs_lock:
      stub = self._stubs.get(address)
      if stub is None:
        channel = self._channel(address)
        self._peer_channels.append(channel)
        stub = self._stubs[address] = rpc.Stub(channel)
    return stub.GetShards(pb.ShardsRequest(version=version, pieces=pieces,
                                           base_version=base_version,
                                           worker_id=self.worker_id),
                          metadata=self._md, timeout=timeout)

  def fetch_weights(self, min_version: int, timeout: float = 300.0,
                    max_bytes: int | None = None, form: str = ""):
    """(version, {name: NumPy array}, hf_dir), or None when the learner's weights are older
    than `min_version`. Chunks are assembled as they arrive (no second copy of the stream);
    `max_bytes` (the model's size) bounds what is allocated for them. Raises
    codec.WeightsError: `unreachable` (no chunk came), `stream_cut` (the stream broke after
    some), or the codec's reasons for a stream that arrived damaged or too big."""
    got = 0

    def counted(stream):
      nonlocal got
      for c in stream:
        got += 1
        yield c

    call = self.stub.GetWeights(
        pb.WeightsRequest(min_version=min_version, worker_id=self.worker_id, form=form),
        metadata=self._md, timeout=timeout)
    try:
      chunks = counted(call)
      first = next(chunks, None)
      if first is None:
        return None
      return codec.assemble_weights(itertools.chain([first], chunks), max_bytes=max_bytes)
    except grpc.RpcError as e:
      reason = "stream_cut" if got else "unreachable"
      raise codec.WeightsError(reason, f"weights from {self.address} after {got} chunks: "
                               f"{e.code()} {e.details()}") from None
    finally:
      call.cancel()  # a no-op once the stream has ended; frees it after a damaged chunk

  def get_weights(self, min_version: int, timeout: float = 300.0):
    """(version, params as jax arrays, hf_dir); None if nothing that new, or if the fetch
    failed (logged)."""
    form = "" if not self.lora else "lora" if self._lora_base is None else "adapters"
    try:
      got = self.fetch_weights(min_version, timeout, form=form)
    except codec.WeightsError as e:
      log.warning("weights fetch from %s failed: %s", self.address, e)
      return None
    if got is None:
      return None
    v, flat, hf_dir = got
    adapters = {k for k in flat if lora_lib.is_adapter(k)}
    arrays = {k: jnp.asarray(a) for k, a in flat.items()}
    if adapters and len(adapters) < len(flat):  # base + adapters: keep the base
      self._lora_base = {k: a for k, a in arrays.items() if k not in adapters}
    elif adapters:  # adapters alone, on the base fetched before
      arrays = {**self._lora_base, **arrays}
    return v, codec.unflatten(arrays), hf_dir

  def heartbeat(self, stats: dict, timeout: float = 5.0) -> dict | None:
    try:
      r = self.stub.Heartbeat(pb.WorkerStats(worker_id=self.worker_id, **stats),
                              metadata=self._md, timeout=timeout)
    except grpc.RpcError:
      return None
    return rpc.fields(r)

  def close(self):
    for channel in self._peer_channels:
      channel.close()
    self.channel.close()


class GrpcClient(WeightsClient):
  def __init__(self, address: str, *, outbox_size: int = 8, max_unacked: int = 8,
               backoff_min: float = 0.2, backoff_max: float = 5.0,
               on_ack: Callable[[str, bool, str], None] | None = None, **connection):
    super().__init__(address, **connection)  # worker_id, token, tls_*: see WeightsClient
    self._cv = threading.Condition()  # guards the outbox, the pending records, _gen
    self._outbox: collections.deque = collections.deque()  # pushed, not yet sent
    self._pending: collections.OrderedDict = collections.OrderedDict()  # sent, not acked
    self._gen = 0  # the current stream; older ones may no longer take records
    self._settling = 0  # answers taken off _pending, not yet counted and given to on_ack
    self.outbox_size = outbox_size
    self.max_unacked = max_unacked  # gRPC would otherwise buffer the whole outbox
    self.on_ack = on_ack
    self.acks = collections.Counter()
    self.reconnects = 0
    self.backoff_min, self.backoff_max = backoff_min, backoff_max
    self._closed = threading.Event()
    self._sender = threading.Thread(target=self._send_loop, name=f"push-{self.worker_id}",
                                    daemon=True)
    self._sender.start()

  # --- trajectories ---
  def push(self, traj, stop: threading.Event | None = None) -> None:
    """Queues one record for the stream; blocks while the outbox is full (until `stop`).
    Records must be pushed in the order of their ids' sequence numbers."""
    msg = codec.trajectory_to_proto(traj, self.worker_id) if not isinstance(
        traj, pb.Trajectory) else traj
    with self._cv:
      while len(self._outbox) >= self.outbox_size:
        if self._closed.is_set() or (stop is not None and stop.is_set()):
          return
        self._cv.wait(0.5)
      self._outbox.append(msg)
      self._cv.notify_all()

  def _requests(self, gen: int):
    """The request stream of generation `gen`: every pending record it has not sent yet (in
    order), then new ones from the outbox. Ends when a newer stream starts."""
    sent = set()
    while True:
      with self._cv:
        while True:
          if self._closed.is_set() or gen != self._gen:
            return
          todo = [m for i, m in self._pending.items() if i not in sent]
          if todo:
            break
          # A repeated id waits for the first copy's answer: each push gets its own.
          if (self._outbox and len(self._pending) < self.max_unacked
              and self._outbox[0].traj_id not in self._pending):
            m = self._outbox.popleft()
            self._pending[m.traj_id] = m
            self._cv.notify_all()
            todo = [m]
            break
          self._cv.wait(0.5)
      for m in todo:
        sent.add(m.traj_id)
        yield m

  def _send_loop(self):
    backoff = self.backoff_min
    while not self._closed.is_set():
      with self._cv:
        self._gen += 1
        gen = self._gen
        self._cv.notify_all()
      t_open = time.monotonic()
      try:
        for ack in self.stub.PushTrajectories(self._requests(gen), metadata=self._md):
          backoff = self.backoff_min
          if not ack.admitted and ack.reason in RETRY_REASONS:
            continue  # not an answer: the record stays pending and goes again
          with self._cv:
            settled = self._pending.pop(ack.traj_id, None) is not None
            self._settling += settled
          if not settled:  # a second answer for a record already settled
            continue
          try:
            self.acks["admitted" if ack.admitted else ack.reason] += 1
            if self.on_ack is not None:
              self.on_ack(ack.traj_id, ack.admitted, ack.reason)
          finally:
            with self._cv:
              self._settling -= 1
              self._cv.notify_all()
        time.sleep(self.backoff_min)  # the learner ended the stream: open another
      except grpc.RpcError as e:
        if self._closed.is_set():
          break
        self.reconnects += 1
        if time.monotonic() - t_open >= STREAM_UP_S:
          backoff = self.backoff_min
        log.warning("trajectory stream to %s broke (%s); %d unacknowledged, retrying in %.1fs",
                    self.address, e.code(), len(self._pending), backoff)
        time.sleep(backoff)
        backoff = min(backoff * 2, self.backoff_max)

  def flush(self, timeout: float = 30.0) -> bool:
    """Waits until every pushed record's answer is counted in `acks` and given to `on_ack`;
    False on timeout."""
    t_end = time.monotonic() + timeout
    with self._cv:
      while self._outbox or self._pending or self._settling:
        left = t_end - time.monotonic()
        if left <= 0:
          return False
        self._cv.wait(min(left, 0.5))
    return True

  @property
  def unacknowledged(self) -> int:
    with self._cv:
      return len(self._outbox) + len(self._pending)

  def close(self):
    self._closed.set()
    with self._cv:
      self._cv.notify_all()
    self.channel.close()
    self._sender.join(timeout=5)
