"""The learner over several processes (`jax.distributed`): process 0 leads, the others follow.

Every process builds the same `Learner` on one global mesh (its devices are the union of the
processes' devices), and an update is one SPMD program that each process must run, in the
same order, with the same arguments. Process 0 alone runs the learner service: the gRPC
server, admission, the queue, the admission log, the metric files. Before every learner call
that touches the global state (`update`, `find_offenders`, `save`, `restore`,
`snapshot_params`, `close`), process 0 announces it through the coordinator's key-value
store: the method name, its trajectories in the wire codec and its other arguments as JSON.
The other processes wait in `Learner.follow`, decode the call and make it. Each process then
packs the same batch (packing is deterministic) and places on its own devices only its own
rows of it (`mesh.put`), so no process moves another's data.

The announcement goes through the coordinator, not through a device collective, so a
follower can wait as long as the learner waits for trajectories without a collective timing
out. Announcements are numbered; process 0 deletes one `KEEP` calls after making it, by
which time every follower has taken part in the later collectives and so has read it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import jax

from fr_jax import compile_cache
from fr_jax.trajectory import Trajectory

log = logging.getLogger("fr_jax.learner.multihost")

KEEP = 16  # announcements kept in the key-value store
_PREFIX = "fr_jax/learner_call/"
POLL_MS = 60_000  # a follower's wait is a loop of waits this long


def initialize(coordinator_address: str = "", num_processes: int = 0, process_id: int = -1,
               *, cpu_collectives: str = "gloo") -> None:
  """`jax.distributed.initialize`, before anything touches a device. Empty/zero/-1 values are
  left for JAX to detect from the cluster (Slurm, TPU VMs, ...). On the CPU backend the
  cross-process collectives are gloo's."""
  if cpu_collectives:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(coordinator_address or None,
                             num_processes if num_processes > 0 else None,
                             process_id if process_id >= 0 else None)
  compile_cache.off_for_processes()  # gloo collectives do not survive the cache
  log.info("jax.distributed: process %d of %d, %d local and %d global devices",
           jax.process_index(), jax.process_count(), jax.local_device_count(),
           jax.device_count())


def _client():
  from jax._src import distributed  # the coordinator's key-value store has no public API
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("a multi-process learner needs jax.distributed.initialize() first")
  return client


def encode_call(method: str, trajs: Sequence[Trajectory] | None, kwargs: dict) -> bytes:
  """One announcement: a JSON header line, then each trajectory in the wire codec, each
  preceded by its length."""
  from fr_jax.transport import codec
  records = [codec.encode_record(t) for t in trajs] if trajs is not None else None
  head = json.dumps({"method": method, "kwargs": kwargs,
                     "records": None if records is None else [len(r) for r in records]})
  return head.encode() + b"\n" + b"".join(records or [])


def decode_call(payload: bytes) -> tuple[str, list[Trajectory] | None, dict]:
  from fr_jax.transport import codec
  head, _, body = payload.partition(b"\n")
  h = json.loads(head)
  trajs = None
  if h["records"] is not None:
    trajs, at = [], 0
    for n in h["records"]:
      trajs.append(codec.decode_record(body[at:at + n]))
      at += n
  return h["method"], trajs, h["kwargs"]


class Group:
  """This process's place in a multi-process learner, and the announcement channel."""

  def __init__(self, process_id: int | None = None, num_processes: int | None = None,
               client=None):
    self.process_id = jax.process_index() if process_id is None else process_id
    self.num_processes = jax.process_count() if num_processes is None else num_processes
    self._client = client
    self._n = 0  # announcements made (leader) or received (follower)

  @property
  def leader(self) -> bool:
    return self.process_id == 0

  @property
  def client(self):
    if self._client is None:
      self._client = _client()
    return self._client

  def announce(self, method: str, trajs: Sequence[Trajectory] | None, kwargs: dict) -> None:
    assert self.leader, "only process 0 announces learner calls"
    self.client.key_value_set_bytes(f"{_PREFIX}{self._n}", encode_call(method, trajs, kwargs))
    if self._n >= KEEP:
      self.client.key_value_delete(f"{_PREFIX}{self._n - KEEP}")
    self._n += 1

  def receive(self) -> tuple[str, list[Trajectory] | None, dict]:
    """The next call process 0 announced; waits as long as it takes."""
    key = f"{_PREFIX}{self._n}"
    while True:
      try:
        payload = self.client.blocking_key_value_get_bytes(key, POLL_MS)
        break
      except jax.errors.JaxRuntimeError as e:
        if "DEADLINE_EXCEEDED" not in str(e):  # the coordinator is gone: the run is over
          raise
    self._n += 1
    return decode_call(payload)


def group() -> Group | None:
  """This process's group when JAX runs several processes, else None."""
  return Group() if jax.process_count() > 1 else None

