"""The `fr_jax.Learner` service's method table, and the server registration and client stub
built from it (the messages come from `fr_jax_pb2`, generated from fr_jax.proto; the three
methods are declared here instead of in a generated `_pb2_grpc` module)."""

from __future__ import annotations

import grpc

from fr_jax.transport import fr_jax_pb2 as pb

SERVICE = "fr_jax.Learner"  # package.service in fr_jax.proto

# name -> (cardinality, request message, response message), as in the .proto's `service`.
METHODS = {
    "PushTrajectories": ("stream_stream", pb.Trajectory, pb.PushAck),
    "GetWeights": ("unary_stream", pb.WeightsRequest, pb.WeightsChunk),
    "Heartbeat": ("unary_unary", pb.WorkerStats, pb.LearnerStats),
}


def add_to_server(servicer, server) -> None:
  """Registers `servicer`'s methods (one per METHODS entry) on a grpc.Server."""
  handlers = {
      name: getattr(grpc, f"{kind}_rpc_method_handler")(
          getattr(servicer, name), request_deserializer=req.FromString,
          response_serializer=resp.SerializeToString)
      for name, (kind, req, resp) in METHODS.items()}
  server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def fields(message, skip: tuple = ()) -> dict:
  """A message's fields as a dict (the heartbeat's stats both ways), less those in `skip`."""
  return {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields
          if f.name not in skip}


def method_kind(full_method: str) -> str:
  """'/fr_jax.Learner/GetWeights' -> 'unary_stream' (None-safe for unknown methods)."""
  return METHODS.get(full_method.rsplit("/", 1)[-1], ("unary_unary",))[0]


class Stub:
  """Client callables, one attribute per method."""

  def __init__(self, channel: grpc.Channel):
    for name, (kind, req, resp) in METHODS.items():
      setattr(self, name, getattr(channel, kind)(
          f"/{SERVICE}/{name}", request_serializer=req.SerializeToString,
          response_deserializer=resp.FromString))
