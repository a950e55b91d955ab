"""The `fr_jax.Learner` and `fr_jax.Shards` services' method tables, and the server
registration and client stubs built from them (the messages come from `fr_jax_pb2`, generated
from fr_jax.proto; the methods are declared here instead of in a generated `_pb2_grpc`
module)."""

from __future__ import annotations

import grpc

from fr_jax.transport import fr_jax_pb2 as pb

SERVICE = "fr_jax.Learner"  # package.service in fr_jax.proto

# name -> (cardinality, request message, response message), as in the .proto's `service`.
METHODS = {
    "PushTrajectories": ("stream_stream", pb.Trajectory, pb.PushAck),
    "GetWeights": ("unary_stream", pb.WeightsRequest, pb.WeightsChunk),
    "Heartbeat": ("unary_unary", pb.WorkerStats, pb.LearnerStats),
    "GetManifest": ("unary_unary", pb.ManifestRequest, pb.ManifestReply),
}
SHARDS = "fr_jax.Shards"  # every learner process's, and a relay's for its peers
SHARD_METHODS = {"GetShards": ("unary_stream", pb.ShardsRequest, pb.WeightsChunk)}
_KINDS = {name: kind for name, (kind, _, _) in {**METHODS, **SHARD_METHODS}.items()}


def add_to_server(servicer, server, service: str = SERVICE, methods: dict = METHODS) -> None:
  """Registers `servicer`'s methods (one per `methods` entry) on a grpc.Server."""
  handlers = {
      name: getattr(grpc, f"{kind}_rpc_method_handler")(
          getattr(servicer, name), request_deserializer=req.FromString,
          response_serializer=resp.SerializeToString)
      for name, (kind, req, resp) in methods.items()}
  server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


def fields(message, skip: tuple = ()) -> dict:
  """A message's fields as a dict (the heartbeat's stats both ways), less those in `skip`."""
  return {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields
          if f.name not in skip}


def method_kind(full_method: str) -> str:
  """'/fr_jax.Learner/GetWeights' -> 'unary_stream' (None-safe for unknown methods)."""
  return _KINDS.get(full_method.rsplit("/", 1)[-1], "unary_unary")


class Stub:
  """Client callables, one attribute per method (of both services: a channel to a learner
  process reaches either)."""

  def __init__(self, channel: grpc.Channel):
    for service, methods in ((SERVICE, METHODS), (SHARDS, SHARD_METHODS)):
      for name, (kind, req, resp) in methods.items():
        setattr(self, name, getattr(channel, kind)(
            f"/{service}/{name}", request_serializer=req.SerializeToString,
            response_deserializer=resp.FromString))
