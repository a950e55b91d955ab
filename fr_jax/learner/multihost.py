"""The learner over several processes (`jax.distributed`): process 0 leads, the others follow.

Every process builds the same `Learner` on one global mesh (its devices are the union of the
processes' devices), and an update is one SPMD program that each process must run, in the
same order, with the same arguments. Process 0 alone runs the learner service: the gRPC
server, admission, the queue, the admission log, the metric files. Before every learner call
that touches the global state (`update`, `find_offenders`, `save`, `restore`,
`snapshot_params`, `close`), process 0 announces it through the coordinator's key-value
store: the method name, its trajectories in the wire codec and its other arguments as JSON.
The other processes wait in `follow`, decode the call and make it. Each process then
packs the same batch (packing is deterministic) and places on its own devices only its own
rows of it (`mesh.put`), so no process moves another's data.

The announcement goes through the coordinator, not through a device collective, so a
follower can wait as long as the learner waits for trajectories without a collective timing
out. Announcements are numbered; process 0 deletes one `KEEP` calls after making it, by
which time every follower has taken part in the later collectives and so has read it.

Whoever reaches the coordinator's port can write its key-value store: JAX's coordination
service has no credentials. So the coordinator binds only to the address it was given, and an
announcement is only ever made if it is authentic and one of the calls in `CALLS`, with typed
arguments:
- Each carries an HMAC-SHA256 keyed from the run's secret (`--auth_token` / `$FR_JAX_TOKEN`,
  or `$FR_JAX_LEARNER_SECRET`) over this run's session nonce (process 0 broadcasts 16 random
  bytes through a device collective when the group forms), its number and its bytes. A
  forged or replayed one (another run with the same secret has another session) is refused
  with a warning, and the follower waits for the authentic one.
- Process 0 writes with overwrite, so a value someone else put at its next key first cannot
  stop it. What an outsider can still do is deny service (delete or keep rewriting keys); the
  threat model in docs/system.md says so.

An announcement carries the whole batch (its records in the wire codec): about the batch's
wire size per update, e.g. 8 x 1 k-token records are ~70 kB, and routing adds
layers x k x 4 bytes per token (Qwen3-30B-A3B: 48 x 8 x 4 = 1.5 kB/token, 416 MB for the
paper recipe's 256 x 1 k-token batches). The store holds `KEEP` of them.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import os
import time
from collections.abc import Sequence

import jax
import numpy as np

from fr_jax import compile_cache
from fr_jax.trajectory import Trajectory

log = logging.getLogger("fr_jax.learner.multihost")

KEEP = 16  # announcements kept in the key-value store
_PREFIX = "fr_jax/learner_call/"
_VALUES = "fr_jax/value/"  # put_signed / get_signed
POLL_MS = 60_000  # a follower's wait is a loop of waits this long
SECRET_ENV = ("FR_JAX_LEARNER_SECRET", "FR_JAX_TOKEN")  # where the run's secret is read
_secret = ""  # the run's secret, set by `initialize`


class NoSecret(ValueError):
  """A multi-process learner was started without the shared secret its calls are signed with."""


class ForgedAnnouncement(ValueError):
  """A value in the announcement channel that process 0 did not write for this run."""


def _optional(kind):
  return lambda v: v is None or isinstance(v, kind)


def _int_list(v):
  return v is None or (isinstance(v, list) and all(type(x) is int for x in v))


# The learner calls a follower makes, each with its argument checks and whether it carries
# trajectories (`collective` refuses to wrap a method not listed here).
CALLS = {
    "update": ({"lags": _int_list, "log_ids": lambda v: type(v) is bool}, True),
    "find_offenders": ({}, True),
    "save": ({"data_state": _optional(dict), "force": lambda v: type(v) is bool,
              "extra": _optional(dict)}, False),
    "restore": ({"step_": lambda v: v is None or type(v) is int}, False),
    "snapshot_params": ({}, False),
    "publish_shards": ({"version": lambda v: type(v) is int}, False),
    "close": ({}, False),
}


def check_call(method: str, has_trajs: bool, kwargs: dict) -> None:
  """Raises ValueError unless `method(trajs?, **kwargs)` is a call a follower may make."""
  if method not in CALLS:
    raise ValueError(f"{method!r} is not a learner call a follower makes (one of {sorted(CALLS)})")
  checks, trajs = CALLS[method]
  if has_trajs != trajs:
    raise ValueError(f"{method}: trajectories {'missing' if trajs else 'not expected'}")
  for k, v in kwargs.items():
    if k not in checks or not checks[k](v):
      raise ValueError(f"{method}: argument {k}={str(v)[:80]!r} is not allowed")


def secret_from_env() -> str:
  return next((os.environ[k] for k in SECRET_ENV if os.environ.get(k)), "")


def initialize(coordinator_address: str = "", num_processes: int = 0, process_id: int = -1,
               *, secret: str = "", bind_address: str = "") -> None:
  """`jax.distributed.initialize`, before anything touches a device. Empty/zero/-1 values are
  left for JAX to detect from the cluster (Slurm, TPU VMs, ...). On the CPU backend the
  cross-process collectives are gloo's.

  `secret` (default: `$FR_JAX_LEARNER_SECRET`, else `$FR_JAX_TOKEN`) signs the announcements;
  every process must have the same. Process 0's coordinator binds to `bind_address`, default
  the coordinator address itself (JAX's own default is every interface)."""
  global _secret
  _secret = secret or secret_from_env()
  if not _secret:
    raise NoSecret("a multi-process learner signs its calls with a shared secret: set "
                   f"${SECRET_ENV[1]} (or ${SECRET_ENV[0]}, or pass --auth_token) to the same "
                   "value on every process")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if not coordinator_address:  # as jax.distributed would find it, so that it can bind there
    from jax._src import clusters
    coordinator_address, num_processes, process_id, _ = (
        clusters.ClusterEnv.auto_detect_unset_distributed_params(
            None, num_processes if num_processes > 0 else None,
            process_id if process_id >= 0 else None, None, None, 300))
  jax.distributed.initialize(coordinator_address or None,
                             num_processes if num_processes and num_processes > 0 else None,
                             process_id if process_id is not None and process_id >= 0 else None,
                             coordinator_bind_address=(bind_address or coordinator_address
                                                       or None))
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


def _session() -> bytes:
  """16 random bytes from process 0, the same on every process (a device collective: every
  process calls this at the same point)."""
  from jax.experimental import multihost_utils
  mine = np.frombuffer(os.urandom(16), np.uint8)
  return np.asarray(multihost_utils.broadcast_one_to_all(mine)).astype(np.uint8).tobytes()


class Group:
  """This process's place in a multi-process learner, and the announcement channel.

  `secret` defaults to the one `initialize` was given; `session` (the same bytes on every
  process of this run) defaults to a fresh nonce from process 0 (`_session`)."""

  def __init__(self, process_id: int | None = None, num_processes: int | None = None,
               client=None, *, secret: str | None = None, session: bytes | None = None):
    self.process_id = jax.process_index() if process_id is None else process_id
    self.num_processes = jax.process_count() if num_processes is None else num_processes
    self._client = client
    self._n = 0  # announcements made (leader) or received (follower)
    secret = _secret if secret is None else secret
    if not secret:
      raise NoSecret("multihost.Group needs the run's secret (multihost.initialize(secret=...))")
    self._mac_key = hmac.new(secret.encode(), b"fr_jax learner announcements",
                             hashlib.sha256).digest()
    self._session = _session() if session is None else session
    self.forged = 0  # values refused as not process 0's for this run (follower)

  def _mac(self, n: int, payload: bytes) -> bytes:
    return hmac.new(self._mac_key, self._session + n.to_bytes(8, "big") + payload,
                    hashlib.sha256).digest()

  def seal(self, n: int, payload: bytes) -> bytes:
    return self._mac(n, payload) + payload

  def open(self, n: int, sealed: bytes) -> bytes:
    """The payload of announcement `n`, or ForgedAnnouncement."""
    mac, payload = sealed[:32], sealed[32:]
    if len(sealed) < 32 or not hmac.compare_digest(mac, self._mac(n, payload)):
      raise ForgedAnnouncement(f"announcement {n}: bad HMAC ({len(sealed)} bytes)")
    return payload

  def _value_mac(self, name: str, value: bytes) -> bytes:
    return hmac.new(self._mac_key, self._session + b"value/" + name.encode() + b"\0" + value,
                    hashlib.sha256).digest()

  def put_signed(self, name: str, value: bytes) -> None:
    """Publishes `value` under `name` for the other processes (`get_signed`), sealed with the
    run's secret: e.g. where this process serves its weight shards."""
    self.client.key_value_set_bytes(f"{_VALUES}{name}", self._value_mac(name, value) + value,
                                    allow_overwrite=True)

  def get_signed(self, name: str, timeout_ms: int = 300_000) -> bytes:
    """The value a process of this run put under `name`, waiting for it; a value someone
    else wrote there is refused (ForgedAnnouncement) and waited through."""
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
      left = max(1, int((deadline - time.monotonic()) * 1000))
      sealed = self.client.blocking_key_value_get_bytes(f"{_VALUES}{name}", left)
      mac, value = sealed[:32], sealed[32:]
      if len(sealed) >= 32 and hmac.compare_digest(mac, self._value_mac(name, value)):
        return value
      self.forged += 1
      log.warning("refused a forged value for %s", name)
      if time.monotonic() > deadline:
        raise ForgedAnnouncement(f"{name}: no authentic value within {timeout_ms} ms")
      time.sleep(0.05)

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
    check_call(method, trajs is not None, kwargs)
    payload = encode_call(method, trajs, kwargs)
    # Overwrite: a value someone else wrote at this key first must not stop the run.
    self.client.key_value_set_bytes(f"{_PREFIX}{self._n}", self.seal(self._n, payload),
                                    allow_overwrite=True)
    if self._n >= KEEP:
      self.client.key_value_delete(f"{_PREFIX}{self._n - KEEP}")
    self._n += 1

  def receive(self) -> tuple[str, list[Trajectory] | None, dict]:
    """The next call process 0 announced; waits as long as it takes. A value at its key that
    process 0 did not seal for this run is refused (and counted in `forged`); the wait goes
    on until process 0's own overwrites it."""
    key = f"{_PREFIX}{self._n}"
    while True:
      try:
        sealed = self.client.blocking_key_value_get_bytes(key, POLL_MS)
      except jax.errors.JaxRuntimeError as e:
        if "DEADLINE_EXCEEDED" not in str(e):  # the coordinator is gone: the run is over
          raise
        continue
      try:
        payload = self.open(self._n, sealed)
        break
      except ForgedAnnouncement as e:
        self.forged += 1
        if self.forged == 1 or self.forged % 100 == 0:
          log.warning("refused %s (%d so far): someone else writes the coordinator's store",
                      e, self.forged)
        time.sleep(0.05)
    self._n += 1
    method, trajs, kwargs = decode_call(payload)
    check_call(method, trajs is not None, kwargs)
    return method, trajs, kwargs


def group() -> Group | None:
  """This process's group when JAX runs several processes, else None."""
  return Group() if jax.process_count() > 1 else None


def collective(method):
  """A learner method that every process of a multi-process learner calls: process 0
  announces it (`Group.announce`) before making it; the others make it in `follow`. Only the
  calls `CALLS` lists (with their argument checks) are ever made by a follower."""
  if method.__name__ not in CALLS:
    raise TypeError(f"{method.__name__} is not in multihost.CALLS")

  @functools.wraps(method)
  def call(self, *args, **kwargs):
    if self.group is not None and self.group.leader:
      trajs = args[0] if args and isinstance(args[0], (list, tuple)) else None
      if trajs is None and args:
        raise TypeError(f"{method.__name__}: pass arguments other than trajectories by name")
      self.group.announce(method.__name__, trajs, kwargs)
    return method(self, *args, **kwargs)

  return call


def follow(learner) -> None:
  """On a process other than 0: makes each learner call process 0 announces, until it
  closes."""
  assert learner.group is not None and not learner.group.leader
  while True:
    method, trajs, kwargs = learner.group.receive()
    log.debug("following %s", method)
    try:
      getattr(learner, method)(*([] if trajs is None else [trajs]), **kwargs)
    except Exception as e:  # noqa: BLE001 -- as process 0's service does with an update
      if method != "update" or not learner.state_intact():
        raise
      # Process 0 raised the same (the same code on the same batch) and dead-letters it.
      log.error("update raised on its batch (%s: %s); following on", type(e).__name__, e)
    if method == "close":
      return
