"""The learner's gRPC server: streams trajectories in, weights and stats out.

Authentication: it binds to loopback unless told otherwise. Beyond loopback every client must
prove itself, with a shared token (`Authorization: Bearer <token>` metadata, compared in
constant time on every call) or a client certificate signed by `tls_client_ca` (mutual TLS).
Server-only TLS encrypts but lets anyone in, so beyond loopback it needs one of the two.

Capacity: a trajectory stream holds one server thread for its lifetime. The pool has
`max_streams` threads for streams plus `unary_threads` that streams can never take, so
heartbeats and weight fetches answer however many workers stream; a stream beyond
`max_streams` is refused (RESOURCE_EXHAUSTED) and its client retries with backoff.
Message sizes are capped at `codec.MAX_MESSAGE_BYTES`.

Weights: `GetWeights` streams the published version in chunks, each tensor's last chunk with
the CRC-32 of the whole tensor; the host copy and the checksums are made once per version.
A LoRA run's workers ask with `form` "lora" (the frozen base and the adapters, unmerged) once,
then "adapters" (the adapters' bytes only) for every later version (`Publisher.lora_weights`);
until the learner has them at hand they get the merged model.
A learner whose service has `shards` (a `transport.shards.ShardHost`) also answers weight
relays' `GetManifest` and serves its pieces (`GetShards`, the `fr_jax.Shards` service);
`serve_shards` is that service alone, for the other learner processes and for relays that
serve their peers.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import threading
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np

from fr_jax.trajectory import TrajectoryError
from fr_jax.transport import codec, rpc
from fr_jax.transport import fr_jax_pb2 as pb

log = logging.getLogger("fr_jax.transport")

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
UNARY_THREADS = 32


class BindError(ValueError):
  """An address or credentials the server refuses to serve with as configured."""


def is_loopback(address: str) -> bool:
  host = address.rsplit(":", 1)[0].strip("[]")
  if host in ("localhost", ""):
    return host == "localhost"
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def read_pem(path: str, what: str) -> bytes:
  """The file's bytes; BindError naming the flag and the path if it cannot be read."""
  try:
    return Path(path).read_bytes()
  except OSError as e:
    raise BindError(f"{what} {path}: {e.strerror or e}") from None


class _TokenAuth(grpc.ServerInterceptor):
  def __init__(self, token: str):
    self._expected = f"Bearer {token}".encode()

    def deny(request, context):
      context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong shared token")

    self._deny = {kind: getattr(grpc, f"{kind}_rpc_method_handler")(deny)
                  for kind in ("unary_unary", "unary_stream", "stream_stream")}

  def intercept_service(self, continuation, handler_call_details):
    got = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
    got = got.encode() if isinstance(got, str) else bytes(got)
    if hmac.compare_digest(got, self._expected):  # constant time: no timing oracle
      return continuation(handler_call_details)
    return self._deny[rpc.method_kind(handler_call_details.method)]


class _Servicer:
  """The Learner service's three methods (see rpc.METHODS) over a LearnerService."""

  def __init__(self, service, max_streams: int):
    self.service = service
    self.max_streams = max_streams
    self.streams = 0
    self._lock = threading.Lock()  # the stream count
    self._weights_lock = threading.Lock()
    self._weights_cache: tuple[int, dict, dict] = (-1, {}, {})  # version, arrays, CRC-32s

  def PushTrajectories(self, request_iterator, context):
    with self._lock:
      full = self.streams >= self.max_streams
      if not full:
        self.streams += 1
    if full:
      context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.max_streams} trajectory streams open; retry later")
    try:
      yield from self._stream(request_iterator, context)
    finally:
      with self._lock:
        self.streams -= 1

  def _stream(self, request_iterator, context):
    s = self.service
    for msg in request_iterator:
      try:
        traj = codec.trajectory_from_proto(msg)
      except TrajectoryError as e:
        traj = e
      except Exception as e:  # anything malformed is a decode rejection
        traj = TrajectoryError("bad_field", f"undecodable record: {e}")
      ok, reason = False, "queue_full"
      raw = msg.SerializeToString() if s.log is not None else None
      while reason == "queue_full" and context.is_active():
        ok, reason = s.offer(traj, timeout=1.0, raw=raw)  # blocks while full: backpressure
      if reason == "log_unavailable":  # nothing recorded: end the stream, the client retries
        context.abort(grpc.StatusCode.UNAVAILABLE,
                      "the learner cannot write its admission log (disk full?); retry")
      yield pb.PushAck(traj_id=msg.traj_id, admitted=ok, reason=reason,
                       learner_version=s.version, queue_depth=len(s.queue))

  def GetWeights(self, request, context):
    if request.form:  # a LoRA run's version as base + adapters, or adapters alone
      pick = getattr(self.service, "lora_weights", None)
      try:  # the form is checked by lora_weights alone
        got = pick(request.min_version, request.form) if pick is not None else None
      except ValueError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
      if got is not None:
        v, flat = got
        yield from codec.weight_chunks(v, flat, hf_dir=self.service.hf_dir,
                                       crcs=codec.tensor_crcs(flat))
        return
    got = self.service.weights(request.min_version)
    if got is None:
      return
    v, params = got
    if params is None:
      context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                    "this multi-process learner publishes its weights as shards only (weight "
                    "relays fetch them); an embedded-engine worker needs a one-process learner")
    with self._weights_lock:  # one host copy and one checksum pass per version, for all
      if self._weights_cache[0] != v:
        flat = {k: np.asarray(a) for k, a in codec.flatten(params).items()}
        self._weights_cache = (v, flat, codec.tensor_crcs(flat))
      v, flat, crcs = self._weights_cache
    yield from codec.weight_chunks(v, flat, hf_dir=self.service.hf_dir, crcs=crcs)

  def GetManifest(self, request, context):
    host = getattr(self.service, "shards", None)
    if host is None:
      context.abort(grpc.StatusCode.UNIMPLEMENTED, "this learner does not serve shards")
    v = host.newest
    manifest = host.manifest(v) if v >= request.min_version else None
    if manifest is None:
      return pb.ManifestReply(version=-1)
    parent = host.fanout.parent(request.worker_id, request.serve_address, v)
    return pb.ManifestReply(version=v, manifest=manifest.to_json(), hosts=host.hosts,
                            parent=parent)

  def GetShards(self, request, context):
    host = getattr(self.service, "shards", None)
    if host is None:
      context.abort(grpc.StatusCode.UNIMPLEMENTED, "this learner does not serve shards")
    yield from host.serve(request, context)

  def Heartbeat(self, request, context):
    host = getattr(self.service, "shards", None)
    if host is not None:
      host.fanout.seen(request.worker_id)
    stats = rpc.fields(request, skip=("worker_id",))
    r = self.service.heartbeat(request.worker_id, stats)  # the LearnerStats fields but stats_json
    return pb.LearnerStats(**r, stats_json=json.dumps(self.service.system_metrics()))


def check_credentials(address: str, *, token: str = "", tls_cert: str = "", tls_key: str = "",
                      tls_client_ca: str = ""):
  """The server credentials for these settings (None: plaintext). BindError, naming the flag
  and what to do, for anything that cannot serve: a missing or unreadable file, half a key
  pair, or no client authentication beyond loopback."""
  if bool(tls_cert) != bool(tls_key):
    raise BindError("--tls_cert and --tls_key go together")
  if tls_client_ca and not tls_cert:
    raise BindError("--tls_client_ca (mutual TLS) needs --tls_cert and --tls_key")
  pems = {flag: read_pem(path, flag) for flag, path in (
      ("--tls_cert", tls_cert), ("--tls_key", tls_key), ("--tls_client_ca", tls_client_ca))
      if path}
  if not is_loopback(address) and not (token or tls_client_ca):
    raise BindError(
        f"refusing to serve {address!r} beyond loopback without client authentication: "
        "give --auth_token or --tls_client_ca (mutual TLS); server-only TLS lets any "
        "client in")
  if not tls_cert:
    return None
  ca = pems.get("--tls_client_ca")
  return grpc.ssl_server_credentials([(pems["--tls_key"], pems["--tls_cert"])],
                                     root_certificates=ca, require_client_auth=ca is not None)


def _start(register, address: str, what: str, *, token: str = "", tls_cert: str = "",
           tls_key: str = "", tls_client_ca: str = "", threads: int = UNARY_THREADS):
  creds = check_credentials(address, token=token, tls_cert=tls_cert, tls_key=tls_key,
                            tls_client_ca=tls_client_ca)
  interceptors = [_TokenAuth(token)] if token else []
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads,
                                                  thread_name_prefix="grpc"),
                       options=CHANNEL_OPTIONS, interceptors=interceptors)
  register(server)
  port = (server.add_secure_port(address, creds) if creds is not None
          else server.add_insecure_port(address))
  if port == 0:
    raise BindError(f"could not bind {address!r}")
  server.start()
  log.info("%s on %s (port %d)%s%s", what, address, port, " with token" if token else "",
           " with mutual TLS" if tls_client_ca else "")
  return server, port


def serve(service, address: str = "127.0.0.1:0", *, max_streams: int = 1024,
          unary_threads: int = UNARY_THREADS, **credentials):
  """Starts the server; returns (server, bound port). Port 0 picks a free one.
  `credentials`: token, tls_cert, tls_key, tls_client_ca (`check_credentials`)."""
  servicer = _Servicer(service, max_streams)

  def register(server):
    rpc.add_to_server(servicer, server)
    rpc.add_to_server(servicer, server, rpc.SHARDS, rpc.SHARD_METHODS)
    server.fr_jax_servicer = servicer  # open_streams() reads it

  return _start(register, address, "learner service", threads=max_streams + unary_threads,
                **credentials)


class _ShardsServicer:
  def __init__(self, source):
    self.source = source

  def GetShards(self, request, context):
    yield from self.source.serve(request, context)


def serve_shards(source, address: str = "127.0.0.1:0", **credentials):
  """The `fr_jax.Shards` service alone over `source` (anything with `serve(request,
  context)`: a ShardHost, a relay); returns (server, bound port)."""
  return _start(lambda server: rpc.add_to_server(_ShardsServicer(source), server, rpc.SHARDS,
                                                 rpc.SHARD_METHODS),
                address, "shard service", **credentials)


def open_streams(server) -> int:
  """Trajectory streams open on a server `serve` started, now."""
  with server.fr_jax_servicer._lock:
    return server.fr_jax_servicer.streams


def stop(server, grace: float | None = 1.0):
  server.stop(grace).wait()
