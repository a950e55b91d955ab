"""Weights at fleet speed: every learner process serves its own shards, in the servers' dtype,
as deltas where they are small, and weight relays feed each other.

* **Hosts.** Each learner process keeps the pieces it holds of the last `keep` published
  versions (`ShardHost.put`: blocks of HF tensors in the wire dtype, taken from its own
  addressable shards by `fr_jax.models.hf_shards.local_pieces`; nothing is gathered) and
  serves them (`GetShards`, the `fr_jax.Shards` service). Each piece travels as byte-range
  chunks, its last chunk carrying the CRC-32 of the piece's bytes.
* **Deltas.** A relay that holds version b asks for version v with `base_version=b`; a host
  that still holds b sends each piece as the zstd-compressed XOR of its bytes with b's
  (`delta_frame`, made once per (v, b, piece) and shared by every asker; against the previous
  version they are made in the background as soon as v is published), or its plain bytes
  where that is not at least `max_delta_ratio` smaller (judged once per version from a
  sample, `deltas_worth_it`: a version where every element moved costs no compression). The
  receiver XORs the decompressed stream into b's bytes and checks the CRC-32 of the result: a
  reconstructed piece is bit-equal to the host's or refused.
* **Relays** (`fr_jax.transport.shard_fetch`). A relay writes the pieces straight into the
  safetensors file of the version
  (`VersionFile`: the header from the manifest, each piece `pwrite` where it belongs; no second
  copy of the model in memory), from its sources in order (`fetch`): first its parent (a relay
  that holds or is fetching the version, named by the learner), then the learner hosts, all
  in parallel, each for the pieces still missing. A relay that holds a version, whole or in
  part, serves it to other relays (`VersionFile.serve`: a piece is sent once it is written and
  checked; the frames it received as deltas are forwarded as they came).
* **The tree.** Process 0 answers each relay's `GetManifest` with the version, its manifest,
  the hosts and a parent (`Fanout`): the first `root` relays of a version fetch from the
  hosts, each later one from the earliest relay of that version with fewer than `fanout`
  children (breadth first). The hosts then send each version about `root` times whatever the
  fleet's size, and every relay at most `fanout` times; docs/scale.md has the arithmetic.

Faults: a source that dies, cuts its stream or sends a damaged, mixed-version or unexpected
chunk is dropped for this fetch with a named reason (`codec.WeightsError`), and the pieces it
did not deliver come from the next source. A version becomes visible to its server only whole
(every piece checked; `durable.write_version`).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import numpy as np

from fr_jax.models.hf_shards import Manifest
from fr_jax.transport import codec
from fr_jax.transport import fr_jax_pb2 as pb

log = logging.getLogger("fr_jax.shards")


def _bytes(a: np.ndarray) -> memoryview:
  return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _xor(a, b) -> bytes:
  return np.bitwise_xor(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)).tobytes()


def piece_chunks(version: int, manifest: Manifest, i: int, data, crc: int,
                 base: int | None = None,
                 chunk_bytes: int = codec.CHUNK_BYTES) -> Iterator[pb.WeightsChunk]:
  """Piece i as chunks: its bytes, or with `base` its delta frame (`data`); the last chunk
  carries `crc`, the CRC-32 of the piece's own bytes."""
  p = manifest.pieces[i]
  total = len(data)
  for off in range(0, max(total, 1), chunk_bytes):
    last = off + chunk_bytes >= total
    yield pb.WeightsChunk(version=version, name=p.tensor, dtype=manifest.dtype,
                          shape=list(p.shape), offset=off, total_bytes=total,
                          data=bytes(data[off:off + chunk_bytes]), piece=i,
                          crc32=crc if last else None, base_version=base)


class _Once:
  """Values computed once per key, by the first asker; later askers wait for it."""

  def __init__(self):
    self._lock = threading.Lock()
    self._done: dict = {}

  def get(self, key, make: Callable):
    with self._lock:
      slot = self._done.get(key)
      mine = slot is None
      if mine:
        slot = self._done[key] = [threading.Event(), None]
    if mine:
      try:
        slot[1] = make()
      finally:
        slot[0].set()
    slot[0].wait()
    return slot[1]

  def drop(self, keep: Callable) -> None:
    with self._lock:
      for k in [k for k in self._done if not keep(k)]:
        del self._done[k]


class ShardHost:
  """One learner process's pieces of the last `keep` published versions, served by version
  (`serve`). On process 0 it also answers manifests: `hosts` (every process's shard server,
  "" for process 0's own, which relays reach at the learner's address) and `fanout`."""

  def __init__(self, dtype: str = "bfloat16", *, keep: int = 2, delta_level: int = 1,
               max_delta_ratio: float = 0.5, root: int = 2, fanout: int = 2,
               precompute: bool = True, delta_threads: int = 0):
    if keep < 2:
      raise ValueError(f"keep={keep}: a delta needs the previous version too")
    self.dtype, self.keep = dtype, keep
    self.delta_level, self.max_delta_ratio = delta_level, max_delta_ratio
    self.precompute = precompute  # make the next version's deltas in the background
    # threads making them (0: half this host's cores, at most 8)
    self.delta_threads = delta_threads or max(1, min(8, (os.cpu_count() or 2) // 2))
    self.hosts: list[str] = [""]
    self.fanout = Fanout(root, fanout)
    self._lock = threading.Lock()
    self._cond = threading.Condition(self._lock)  # a new version came
    self.wait_s = 60.0
    # version -> (manifest, {piece: (its bytes, their CRC-32)})
    self._held: collections.OrderedDict = collections.OrderedDict()
    self._frames = _Once()
    self.sent_bytes = 0  # egress: chunk payload bytes sent
    self.sent = collections.Counter()  # by encoding: "plain", "delta"

  @property
  def newest(self) -> int:
    with self._lock:
      return next(reversed(self._held), -1)

  def manifest(self, version: int) -> Manifest | None:
    with self._lock:
      held = self._held.get(version)
    return None if held is None else held[0]

  def put(self, version: int, manifest: Manifest, pieces: dict[int, np.ndarray]) -> None:
    """This process's pieces of `version` (in the manifest's dtype), CRCs computed now."""
    if manifest.dtype != self.dtype:
      raise ValueError(f"pieces in {manifest.dtype}, this host serves {self.dtype}")
    held = {i: (_bytes(a), zlib.crc32(_bytes(a))) for i, a in pieces.items()}
    with self._lock:
      for v in [v for v in self._held if v >= version]:  # a restored learner went back
        del self._held[v]
      previous = next(reversed(self._held), None)
      self._held[version] = (manifest, held)
      while len(self._held) > self.keep:
        self._held.popitem(last=False)
      kept = set(self._held)
      self._cond.notify_all()
    self._frames.drop(lambda k: k[0] in kept and k[1] in kept)
    if previous is not None and self.precompute:  # the deltas relays will ask for, now
      threading.Thread(target=self._precompute, args=(version, previous), daemon=True,
                       name=f"deltas-v{version}").start()

  def _precompute(self, version: int, base: int) -> None:
    """Every piece's delta frame against `base`, in the order relays ask for them, while
    the first relays' polls come in (a request for a frame not made yet makes it itself)."""
    pair = self._pair(version, base)
    if pair is None or not self.deltas_worth_it(version, base):
      return

    def one(i):
      if self.newest == version:  # else a newer version came: its deltas matter now
        self.delta_frame(version, base, i)

    with futures.ThreadPoolExecutor(self.delta_threads, thread_name_prefix="delta") as pool:
      list(pool.map(one, sorted(pair[0])))  # zstd and NumPy release the GIL

  def _pair(self, version: int, base: int):
    with self._lock:
      new, old = self._held.get(version), self._held.get(base)
    return None if new is None or old is None or new[0] != old[0] else (new[1], old[1])

  def deltas_worth_it(self, version: int, base: int, sample: int = 1 << 20) -> bool:
    """Whether `version` against `base` compresses at least `max_delta_ratio`, judged once
    from the first `sample` bytes of (up to) 8 of the largest pieces: a version whose every
    element moved (a large step) costs no compression work per piece."""
    def make():
      import zstandard
      pair = self._pair(version, base)
      if pair is None:
        return False
      new, old = pair
      big = sorted(new, key=lambda i: -len(new[i][0]))[:8]
      raw = b"".join(_xor(new[i][0][:sample], old[i][0][:sample]) for i in big)
      small = zstandard.ZstdCompressor(level=self.delta_level).compress(raw)
      return len(small) <= self.max_delta_ratio * len(raw)
    return self._frames.get((version, base, "worth"), make)

  def delta_frame(self, version: int, base: int, i: int) -> bytes | None:
    """The zstd-compressed XOR of piece i's bytes in `version` with `base`'s, made once; None
    where the base is gone, its manifest differs or the frame would not save enough."""
    def make():
      import zstandard
      pair = self._pair(version, base) if self.deltas_worth_it(version, base) else None
      if pair is None:
        return None
      a, b = pair[0][i][0], pair[1][i][0]
      frame = zstandard.ZstdCompressor(level=self.delta_level).compress(_xor(a, b))
      return frame if len(frame) <= self.max_delta_ratio * len(a) else None
    return self._frames.get((version, base, i), make)

  def serve(self, request: pb.ShardsRequest, context) -> Iterator[pb.WeightsChunk]:
    """The pieces asked for. A version newer than any held is waited for up to `wait_s` (this
    process may still be preparing it while process 0 already answers manifests)."""
    v = request.version
    deadline = time.monotonic() + self.wait_s
    with self._cond:
      while v not in self._held and v > next(reversed(self._held), -1) and \
          time.monotonic() < deadline and context.is_active():
        self._cond.wait(0.1)
      held = self._held.get(v)
    if held is None:
      context.abort(grpc.StatusCode.NOT_FOUND, f"version {v} is not held here (newest: "
                    f"{self.newest})")
    manifest, pieces = held
    base = request.base_version if request.HasField("base_version") else None
    for i in request.pieces:
      if i not in pieces:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"piece {i} is not served here")
      data, crc = pieces[i]
      frame = None if base is None else self.delta_frame(v, base, i)
      self.sent["plain" if frame is None else "delta"] += 1
      for c in piece_chunks(v, manifest, i, data if frame is None else frame, crc,
                            None if frame is None else base):
        self.sent_bytes += len(c.data)
        yield c


class Fanout:
  """Which source each relay fetches a version from: the hosts for the first `root` relays,
  then the earliest relay of the version (breadth first) with fewer than `fanout` children
  that was heard from in the last `alive_s` seconds."""

  def __init__(self, root: int = 2, fanout: int = 2, alive_s: float = 60.0, keep: int = 4):
    self.root, self.fanout, self.alive_s, self.keep = root, fanout, alive_s, keep
    self._lock = threading.Lock()
    self._seen: dict[str, tuple[str, float]] = {}  # relay -> (its address, when)
    self._versions: collections.OrderedDict = collections.OrderedDict()  # v -> {relay: parent}

  def seen(self, relay: str, address: str | None = None) -> None:
    with self._lock:
      old = self._seen.get(relay, ("", 0.0))[0]
      self._seen[relay] = (old if address is None else address, time.monotonic())

  def parent(self, relay: str, address: str, version: int) -> str:
    """The address `relay` fetches `version` from first ("": the hosts)."""
    self.seen(relay, address)
    with self._lock:
      tree = self._versions.setdefault(version, {})
      while len(self._versions) > self.keep:
        self._versions.popitem(last=False)
      if relay in tree:
        return tree[relay]
      children = collections.Counter(tree.values())
      parent = ""
      if children[""] >= self.root:
        now = time.monotonic()
        for r in tree:  # in the order they came: breadth first
          addr, when = self._seen.get(r, ("", 0.0))
          if addr and r != relay and now - when < self.alive_s and \
              children[addr] < self.fanout:
            parent = addr
            break
      tree[relay] = parent
      return parent
