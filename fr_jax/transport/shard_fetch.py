"""The relay's side of shards (`fr_jax.transport.shards` has the hosts' side and the design):
the version's safetensors file as it is written and served to peers (`VersionFile`), one
stream's chunks checked and written into it (`receive`), and the sources tried in order
(`fetch`).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import os
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np

from fr_jax.models.hf_shards import Manifest
from fr_jax.transport import codec
from fr_jax.transport import fr_jax_pb2 as pb
from fr_jax.transport.shards import piece_chunks

log = logging.getLogger("fr_jax.shards")


class VersionFile:
  """One version's safetensors file as a relay writes it: header first, size preallocated,
  every piece written where it belongs as its chunks arrive, and readable by peers piece by
  piece once checked (`done`)."""

  def __init__(self, path, manifest: Manifest, version: int):
    self.path, self.manifest, self.version = Path(path), manifest, version
    header = manifest.header()
    self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.pwrite(self.fd, header, 0)
    os.ftruncate(self.fd, len(header) + manifest.nbytes)
    n = len(manifest.pieces)
    self._runs = [manifest.runs(i, len(header)) for i in range(n)]
    self._starts = [[r[1] for r in runs] for runs in self._runs]
    self.done = [threading.Event() for _ in range(n)]
    self.crcs: list[int | None] = [None] * n
    self.frames: dict[int, tuple[int, bytes]] = {}  # piece -> (base, the delta frame received)
    self.failed = threading.Event()  # the fetch gave up: peers reading it stop
    self.received = collections.Counter()  # wire bytes by source
    self.sent_bytes = 0

  def missing(self) -> list[int]:
    return [i for i, e in enumerate(self.done) if not e.is_set()]

  def _io(self, i: int, off: int, n: int):
    """(file offset, start, length) runs of bytes [off, off + n) of piece i."""
    runs, starts = self._runs[i], self._starts[i]
    k = bisect.bisect_right(starts, off) - 1
    end = off + n
    while off < end:
      f, s, length = runs[k]
      take = min(end, s + length) - off
      yield f + off - s, off, take
      off += take
      k += 1

  def write(self, i: int, off: int, data) -> None:
    mv = memoryview(data)
    for f, o, n in self._io(i, off, len(mv)):
      os.pwrite(self.fd, mv[o - off:o - off + n], f)

  def read(self, i: int, off: int = 0, n: int | None = None) -> bytes:
    n = self.manifest.piece_bytes(i) - off if n is None else n
    return b"".join(os.pread(self.fd, k, f) for f, _, k in self._io(i, off, n))

  def close(self) -> None:
    try:
      os.close(self.fd)
    except OSError:
      pass

  def serve(self, request: pb.ShardsRequest, context) -> Iterator[pb.WeightsChunk]:
    """The pieces asked for, each once it is written and checked (waiting for it while the
    fetch goes on); a delta frame received against the asker's base is forwarded as is."""
    base = request.base_version if request.HasField("base_version") else None
    for i in request.pieces:
      if not 0 <= i < len(self.done):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no piece {i}")
      while not self.done[i].wait(0.2):
        if self.failed.is_set() or not context.is_active():
          context.abort(grpc.StatusCode.UNAVAILABLE, f"version {self.version}: this relay's "
                        "fetch failed")
      frame = self.frames.get(i)
      if frame is not None and frame[0] == base:
        chunks = piece_chunks(self.version, self.manifest, i, frame[1], self.crcs[i], base)
      else:
        chunks = piece_chunks(self.version, self.manifest, i, self.read(i), self.crcs[i])
      for c in chunks:
        self.sent_bytes += len(c.data)
        yield c


class _Receiving:
  """One piece arriving: its running offset, the CRC of its bytes so far, and for a delta
  the decompressor and the frame's bytes (kept to forward)."""

  __slots__ = ("at", "out", "crc", "dec", "frame")

  def __init__(self, delta: bool):
    import zstandard
    self.at = self.out = self.crc = 0
    self.dec = zstandard.ZstdDecompressor().decompressobj() if delta else None
    self.frame: list[bytes] | None = [] if delta else None


def receive(vf: VersionFile, chunks, want: set[int], base: VersionFile | None,
            source: str) -> None:
  """Writes the pieces of `want` that `chunks` brings into `vf`, each checked against its
  CRC-32 (deltas applied to `base`); removes each from `want` when done. Raises
  codec.WeightsError naming what is wrong with the stream."""
  m, states = vf.manifest, {}
  for c in chunks:
    i = c.piece
    if c.version != vf.version:
      raise codec.WeightsError("mixed_versions", f"{source} sent version {c.version} for "
                               f"{vf.version}")
    if i not in want or not 0 <= i < len(m.pieces):
      raise codec.WeightsError("bad_chunk", f"{source} sent piece {i}, not asked for")
    p, size = m.pieces[i], m.piece_bytes(i)
    if (c.name, c.dtype, tuple(c.shape)) != (p.tensor, m.dtype, p.shape):
      raise codec.WeightsError("bad_chunk", f"{source}: piece {i} is {c.name} {c.dtype} "
                               f"{tuple(c.shape)}, the manifest says {p.tensor} {m.dtype} "
                               f"{p.shape}")
    delta = c.HasField("base_version")
    if delta and (base is None or c.base_version != base.version):
      raise codec.WeightsError("bad_chunk", f"{source}: a delta against version "
                               f"{c.base_version}, which this relay does not hold")
    s = states.get(i)
    if s is None:
      s = states[i] = _Receiving(delta)
    if c.offset != s.at or (s.dec is not None) != delta or (
        not delta and c.total_bytes != size):
      raise codec.WeightsError("bad_chunk", f"{source}: piece {i} chunk at {c.offset} of "
                               f"{c.total_bytes}, expected {s.at}")
    s.at += len(c.data)
    if delta:
      s.frame.append(c.data)
      try:
        out = s.dec.decompress(c.data)
      except Exception as e:  # zstandard.ZstdError: a damaged frame
        raise codec.WeightsError("checksum_mismatch", f"{source}: piece {i}: {e}") from None
      if s.out + len(out) > size:
        raise codec.WeightsError("bad_chunk", f"{source}: piece {i}'s delta is too long")
      out = np.bitwise_xor(np.frombuffer(out, np.uint8),
                           np.frombuffer(base.read(i, s.out, len(out)), np.uint8))
    else:
      out = c.data
      if s.at > size:
        raise codec.WeightsError("bad_chunk", f"{source}: piece {i} overruns its {size} bytes")
    vf.write(i, s.out, out)
    s.crc = zlib.crc32(out, s.crc)
    s.out += len(out)
    vf.received[source] += len(c.data)
    if c.HasField("crc32"):  # the piece's last chunk
      if s.out != size:
        raise codec.WeightsError("incomplete", f"{source}: piece {i} ended at {s.out} of "
                                 f"{size} bytes")
      if s.crc != c.crc32:
        raise codec.WeightsError("checksum_mismatch", f"{source}: piece {i} ({p.tensor}) "
                                 f"CRC-32 {s.crc:08x}, the sender's {c.crc32:08x}")
      vf.crcs[i] = s.crc
      if delta:
        vf.frames[i] = (base.version, b"".join(s.frame))
      vf.done[i].set()
      want.discard(i)
      del states[i]


@dataclasses.dataclass
class Source:
  """Where pieces come from: one relay (`address`), or the learner hosts (`hosts`: the
  address of each process's shard server by process index)."""
  name: str
  address: str = ""
  hosts: tuple[str, ...] = ()


def fetch(vf: VersionFile, sources: list[Source], open_stream: Callable, *,
          base: VersionFile | None = None, stop: threading.Event | None = None,
          streams: int = 1) -> dict:
  """Fills `vf` from `sources` in order, each asked only for the pieces still missing: the
  hosts all at once, `streams` streams each (the pieces dealt round-robin), a relay in
  `streams` streams. `open_stream(address, version, pieces, base_version)` returns a chunk
  iterator (grpc errors for a dead source). Returns {"failures": {reason: n}, "sources":
  [names used]}; raises codec.WeightsError("incomplete") if pieces remain missing after the
  last source (its `failures` attribute holds the per-source reasons)."""
  failures: collections.Counter = collections.Counter()
  used = []
  bv = None if base is None else base.version

  def one(address: str, name: str, pieces: list[int]) -> None:
    want = set(pieces)
    try:
      receive(vf, open_stream(address, vf.version, pieces, bv), want, base, name)
      if want:
        raise codec.WeightsError("incomplete", f"{name} ended without pieces {sorted(want)[:3]}")
    except codec.WeightsError as e:
      failures[e.reason] += 1
      log.warning("shards from %s: %s", name, e)
    except grpc.RpcError as e:
      failures["stream_cut" if len(want) < len(pieces) else "unreachable"] += 1
      log.warning("shards from %s cut after %d of %d pieces: %s %s", name,
                  len(pieces) - len(want), len(pieces), e.code(), e.details())
    except OSError as e:  # this side's file: a full disk, say
      failures["write_failed"] += 1
      log.warning("shards from %s: cannot write %s: %s", name, vf.path, e)

  for src in sources:
    missing = vf.missing()
    if not missing or (stop is not None and stop.is_set()):
      break
    used.append(src.name)
    groups = collections.defaultdict(list)  # (address, name) -> pieces, per stream
    for k, i in enumerate(missing):
      if src.hosts:
        h = vf.manifest.pieces[i].host
        groups[(src.hosts[h], f"host {h}", k % streams)].append(i)
      else:
        groups[(src.address, src.name, k % streams)].append(i)
    threads = [threading.Thread(target=one, args=(address, name, ids), daemon=True)
               for (address, name, _), ids in sorted(groups.items())]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  missing = vf.missing()
  if missing:
    err = codec.WeightsError("incomplete", f"version {vf.version}: {len(missing)} pieces "
                             f"missing after {used} ({dict(failures)})")
    err.failures = dict(failures)  # each source's reason, for the caller's counts
    raise err
  return {"failures": dict(failures), "sources": used}
