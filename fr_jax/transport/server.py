"""The learner's gRPC server: streams trajectories in, weights and stats out.

It binds to loopback unless told otherwise; a non-loopback address needs a shared token
(`Authorization: Bearer <token>` metadata, checked on every call) or TLS (certificate and key
files), given by flag. Message sizes are capped at `codec.MAX_MESSAGE_BYTES`.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from concurrent import futures
from pathlib import Path
from typing import Optional

import grpc
import numpy as np

from fr_jax.transport import codec
from fr_jax.transport import fr_jax_pb2 as pb
from fr_jax.transport import rpc
from fr_jax.trajectory import TrajectoryError

log = logging.getLogger("fr_jax.transport")

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


class BindError(ValueError):
  """An address the server refuses to bind as configured."""


def is_loopback(address: str) -> bool:
  host = address.rsplit(":", 1)[0].strip("[]")
  if host in ("localhost", ""):
    return host == "localhost"
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


class _TokenAuth(grpc.ServerInterceptor):
  def __init__(self, token: str):
    self._token = token

    def deny(request, context):
      context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong shared token")

    self._deny = {kind: getattr(grpc, f"{kind}_rpc_method_handler")(deny)
                  for kind in ("unary_unary", "unary_stream", "stream_stream")}

  def intercept_service(self, continuation, handler_call_details):
    md = dict(handler_call_details.invocation_metadata or ())
    if md.get("authorization") == f"Bearer {self._token}":
      return continuation(handler_call_details)
    return self._deny[rpc.method_kind(handler_call_details.method)]


class _Servicer:
  """The Learner service's three methods (see rpc.METHODS) over a LearnerService."""

  def __init__(self, service):
    self.service = service
    self._weights_cache: tuple[int, list] = (-1, [])

  def PushTrajectories(self, request_iterator, context):
    s = self.service
    for msg in request_iterator:
      try:
        traj = codec.trajectory_from_proto(msg)
      except TrajectoryError as e:
        traj = e
      except Exception as e:  # noqa: BLE001 - anything malformed is a decode rejection
        traj = TrajectoryError("bad_field", f"undecodable record: {e}")
      ok, reason = False, "queue_full"
      raw = msg.SerializeToString() if s.log is not None else None
      while reason == "queue_full" and context.is_active():
        ok, reason = s.offer(traj, timeout=1.0, raw=raw)  # blocks while full: backpressure
      yield pb.PushAck(traj_id=msg.traj_id, admitted=ok, reason=reason,
                       learner_version=s.version, queue_depth=len(s.queue))

  def GetWeights(self, request, context):
    got = self.service.weights(request.min_version)
    if got is None:
      return
    v, params = got
    if self._weights_cache[0] != v:  # host copy once per version, shared by all workers
      flat = {k: np.asarray(a) for k, a in codec.flatten(params).items()}
      self._weights_cache = (v, flat)
    v, flat = self._weights_cache
    yield from codec.weight_chunks(v, flat, hf_dir=self.service.hf_dir)

  def Heartbeat(self, request, context):
    r = self.service.heartbeat(request.worker_id, dict(
        engine_version=request.engine_version, trajectories=request.trajectories,
        tokens=request.tokens, uptime_s=request.uptime_s, inflight=request.inflight))
    return pb.LearnerStats(version=r["version"], queue_depth=r["queue_depth"],
                           queue_capacity=r["queue_capacity"],
                           inflight_target=r["inflight_target"], shutdown=r["shutdown"],
                           hf_dir=r["hf_dir"],
                           stats_json=json.dumps(self.service.system_metrics()))


def decode_record(raw: bytes):
  """A logged record (serialised pb.Trajectory) back to a Trajectory."""
  return codec.trajectory_from_proto(pb.Trajectory.FromString(raw))


def serve(service, address: str = "127.0.0.1:0", *, token: str = "",
          tls_cert: str = "", tls_key: str = "", max_workers: int = 64):
  """Starts the server; returns (server, bound port). Port 0 picks a free one."""
  if not is_loopback(address) and not (token or (tls_cert and tls_key)):
    raise BindError(f"refusing to bind {address!r} beyond loopback without --auth_token or "
                    "--tls_cert/--tls_key")
  interceptors = [_TokenAuth(token)] if token else []
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                  thread_name_prefix="grpc"),
                       options=CHANNEL_OPTIONS, interceptors=interceptors)
  rpc.add_to_server(_Servicer(service), server)
  if tls_cert and tls_key:
    creds = grpc.ssl_server_credentials([(Path(tls_key).read_bytes(),
                                          Path(tls_cert).read_bytes())])
    port = server.add_secure_port(address, creds)
  else:
    port = server.add_insecure_port(address)
  if port == 0:
    raise BindError(f"could not bind {address!r}")
  server.start()
  log.info("learner service on %s (port %d)%s", address, port, " with token" if token else "")
  return server, port


def stop(server, grace: Optional[float] = 1.0):
  server.stop(grace).wait()
