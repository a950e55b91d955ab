"""Arrays, trajectories and weights <-> protobuf messages.

Arrays travel as raw little-endian bytes with dtype and shape (`Tensor`). Decoding never
trusts the sender: an unknown dtype, a negative dimension or a byte count that disagrees with
the shape raises `TrajectoryError("bad_field", ...)`, which the learner counts and answers.

Weights travel as byte-range chunks of each tensor, the tensor's last chunk carrying the
zlib CRC-32 of all its bytes. `assemble_weights` checks the stream arrived whole and every
tensor matches its CRC, and otherwise raises `WeightsError` with a named reason.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator

import ml_dtypes  # registers bfloat16 with numpy
import numpy as np

from fr_jax.trajectory import Trajectory, TrajectoryError
from fr_jax.transport import fr_jax_pb2 as pb

DTYPES = ("bool", "int8", "uint8", "int16", "int32", "int64", "uint32", "float16", "bfloat16",
          "float32", "float64")
CHUNK_BYTES = 4 << 20  # weight chunks; far below the channel's message limit
MAX_MESSAGE_BYTES = 64 << 20  # gRPC send/receive limit on both ends
# A record's array fields, each with the dtype it travels in (routed_experts keeps its own).
RECORD_ARRAYS = {"prompt_tokens": np.int32, "completion_tokens": np.int32, "action_mask": bool,
                 "behavior_logp": np.float32, "policy_version": np.int32}


def _np_dtype(name: str) -> np.dtype:
  if name not in DTYPES:
    raise TrajectoryError("bad_field", f"unknown tensor dtype {name!r}")
  return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _dtype_name(a: np.ndarray) -> str:
  return "bfloat16" if a.dtype == ml_dtypes.bfloat16 else a.dtype.name


def to_tensor(a) -> pb.Tensor:
  a = np.asarray(a)
  name = _dtype_name(a)
  if name not in DTYPES:
    raise ValueError(f"cannot send dtype {a.dtype}")
  le = a.astype(a.dtype.newbyteorder("<"), copy=False) if a.dtype.byteorder == ">" else a
  return pb.Tensor(dtype=name, shape=list(a.shape), data=np.ascontiguousarray(le).tobytes())


def from_tensor(t: pb.Tensor, field: str = "tensor") -> np.ndarray:
  dt = _np_dtype(t.dtype)
  shape = tuple(int(d) for d in t.shape)
  if any(d < 0 for d in shape):
    raise TrajectoryError("bad_field", f"{field}: negative dimension in shape {shape}")
  n = int(np.prod(shape, dtype=np.int64))
  if n * dt.itemsize != len(t.data):
    raise TrajectoryError("bad_field", f"{field}: {len(t.data)} bytes do not hold a "
                          f"{t.dtype} array of shape {shape}")
  return np.frombuffer(t.data, dtype=dt.newbyteorder("<")).astype(dt).reshape(shape)


def trajectory_to_proto(t: Trajectory, worker_id: str = "") -> pb.Trajectory:
  """The record as a message. routed_experts keeps its own (compact) dtype; None leaves the
  field unset."""
  routed = None if t.routed_experts is None else to_tensor(t.routed_experts)
  return pb.Trajectory(
      prompt_id=str(t.prompt_id), traj_id=t.traj_id,
      **{f: to_tensor(getattr(t, f).astype(dt)) for f, dt in RECORD_ARRAYS.items()},
      reward=float(t.reward), finish_reason=t.finish_reason, num_tool_calls=t.num_tool_calls,
      num_turns=t.num_turns, env=t.env, worker_id=worker_id, routed_experts=routed)


def trajectory_from_proto(m: pb.Trajectory) -> Trajectory:
  """The record as sent; `validate()` (in the learner's admission) checks its contents."""
  arrays = {f: from_tensor(getattr(m, f), f) for f in RECORD_ARRAYS}
  routed = (from_tensor(m.routed_experts, "routed_experts") if m.HasField("routed_experts")
            else None)
  return Trajectory(prompt_id=m.prompt_id, reward=m.reward, finish_reason=m.finish_reason,
                    num_tool_calls=m.num_tool_calls, num_turns=m.num_turns, env=m.env,
                    traj_id=m.traj_id, routed_experts=routed, **arrays)


def encode_record(t: Trajectory) -> bytes:
  """A Trajectory as the bytes the admission log and dead-letter file keep."""
  return trajectory_to_proto(t).SerializeToString()


def decode_record(raw: bytes) -> Trajectory:
  """Logged bytes (a serialised pb.Trajectory) back to a Trajectory."""
  return trajectory_from_proto(pb.Trajectory.FromString(raw))


# --- weights ---
def flatten(tree, prefix: str = "") -> dict[str, np.ndarray]:
  """A nested dict of arrays -> {'a/b/c': array} (sorted by name)."""
  out = {}
  for k, v in sorted(tree.items()):
    if isinstance(v, dict):
      out.update(flatten(v, f"{prefix}{k}/"))
    else:
      out[f"{prefix}{k}"] = v
  return out


def unflatten(flat: dict[str, np.ndarray]) -> dict:
  tree: dict = {}
  for name, v in flat.items():
    *path, leaf = name.split("/")
    node = tree
    for p in path:
      node = node.setdefault(p, {})
    node[leaf] = v
  return tree


class WeightsError(ValueError):
  """A weights stream that cannot be used, with a named `reason`:

  * `empty`: no chunk at all; `mixed_versions`: chunks of two versions in one stream;
  * `bad_chunk`: a chunk whose dtype, shape, size or byte range makes no sense, or that
    disagrees with an earlier chunk of the same tensor;
  * `incomplete`: tensors or bytes missing (a stream that ended early);
  * `no_checksum`: a tensor without its CRC-32 (a sender older than the checksums);
  * `checksum_mismatch`: a tensor whose bytes do not match its CRC-32;
  * `stream_cut`, `unreachable` (raised by the client): the stream broke after some chunks,
    or before any.
  """

  def __init__(self, reason: str, detail: str):
    super().__init__(f"{reason}: {detail}")
    self.reason = reason


def tensor_crcs(flat: dict[str, np.ndarray]) -> dict[str, int]:
  """{name: zlib CRC-32 of the tensor's little-endian C-order bytes} (3 GB/s on one core)."""
  return {name: zlib.crc32(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))
          for name, a in flat.items()}


def weight_chunks(version: int, flat: dict[str, np.ndarray], hf_dir: str = "",
                  chunk_bytes: int = CHUNK_BYTES,
                  crcs: dict[str, int] | None = None) -> Iterator[pb.WeightsChunk]:
  """Every tensor as one or more byte-range chunks; the first chunk carries the count and
  each tensor's last chunk its CRC-32 (`crcs`, computed here when not given)."""
  for i, (name, a) in enumerate(flat.items()):
    a = np.ascontiguousarray(a)
    dname = _dtype_name(a)
    data = memoryview(a.reshape(-1).view(np.uint8))
    total = len(data)
    crc = crcs[name] if crcs is not None else 0
    for off in range(0, max(total, 1), chunk_bytes):
      piece = data[off:off + chunk_bytes]
      if crcs is None:
        crc = zlib.crc32(piece, crc)
      last = off + chunk_bytes >= total
      yield pb.WeightsChunk(version=version, num_tensors=0 if i or off else len(flat), name=name,
                            dtype=dname, shape=list(a.shape), offset=off, total_bytes=total,
                            data=bytes(piece), hf_dir=hf_dir, crc32=crc if last else None)


class _Partial:
  """One tensor being assembled; its CRC runs along while chunks arrive in order."""
  __slots__ = ("buf", "dtype", "shape", "got", "crc", "want_crc", "in_order")

  def __init__(self, c: pb.WeightsChunk, room: int | None):
    try:
      dt = _np_dtype(c.dtype)
    except TrajectoryError as e:
      raise WeightsError("bad_chunk", f"tensor {c.name!r}: {e}") from None
    shape = tuple(int(d) for d in c.shape)
    n = math.prod(shape) * dt.itemsize  # Python ints: no int64 wrap-around
    if any(d < 0 for d in shape) or n != c.total_bytes:
      raise WeightsError("bad_chunk", f"tensor {c.name!r}: {c.total_bytes} bytes do not hold "
                         f"a {c.dtype} array of shape {shape}")
    if room is not None and n > room:  # checked before the buffer exists
      raise WeightsError("too_big", f"tensor {c.name!r} ({n} bytes) takes the stream past "
                         "the model's size")
    self.buf, self.dtype, self.shape = bytearray(n), c.dtype, shape
    self.got, self.crc, self.want_crc, self.in_order = 0, 0, None, True


def assemble_weights(chunks, max_bytes: int | None = None
                     ) -> tuple[int, dict[str, np.ndarray], str]:
  """(version, {name: array}, hf_dir) from a chunk stream. Checks it arrived whole and that
  every tensor matches its CRC-32; anything else raises WeightsError with its reason. With
  `max_bytes` (the model's size), a stream whose tensors add up to more is refused
  (`too_big`) before their buffers are allocated. The arrays share the received buffers (no
  copy)."""
  parts: dict[str, _Partial] = {}
  room = max_bytes
  version, expected, hf_dir = None, None, ""
  for c in chunks:
    if version is None:
      version, hf_dir = c.version, c.hf_dir
    elif c.version != version:
      raise WeightsError("mixed_versions", f"weights stream mixed versions {version} and "
                         f"{c.version}")
    if c.num_tensors:  # on the stream's first chunk
      expected = c.num_tensors
    t = parts.get(c.name)
    if t is None:
      t = parts[c.name] = _Partial(c, room)
      room = None if room is None else room - len(t.buf)
    elif (c.dtype, tuple(c.shape), c.total_bytes) != (t.dtype, t.shape, len(t.buf)):
      raise WeightsError("bad_chunk", f"tensor {c.name!r} changed dtype or shape mid-stream")
    end = c.offset + len(c.data)
    if c.offset < 0 or end > len(t.buf):
      raise WeightsError("bad_chunk", f"tensor {c.name!r}: bytes [{c.offset}, {end}) fall "
                         f"outside its {len(t.buf)}")
    t.buf[c.offset:end] = c.data
    if t.in_order and c.offset == t.got:
      t.crc = zlib.crc32(c.data, t.crc)
    else:
      t.in_order = False  # a repeated or reordered chunk: checked over the whole buffer
    t.got += len(c.data)
    if c.HasField("crc32"):
      t.want_crc = c.crc32
  if version is None:
    raise WeightsError("empty", "empty weights stream")
  if expected is None:
    raise WeightsError("incomplete", "weights stream incomplete: the first chunk (with the "
                       "tensor count) is missing")
  if len(parts) != expected:
    raise WeightsError("incomplete", f"weights stream incomplete: {len(parts)} of {expected} "
                       "tensors")
  short = [n for n, t in parts.items() if t.got != len(t.buf)]
  if short:
    raise WeightsError("incomplete", f"weights stream incomplete: tensors {short[:3]} are "
                       "missing bytes")
  for name, t in parts.items():
    if t.want_crc is None:
      raise WeightsError("no_checksum", f"tensor {name!r} came without its CRC-32; the "
                         "learner predates checksummed weights: update it")
    got = t.crc if t.in_order else zlib.crc32(t.buf)
    if got != t.want_crc:
      raise WeightsError("checksum_mismatch", f"tensor {name!r} (version {version}): CRC-32 "
                         f"{got:08x}, the learner sent {t.want_crc:08x}")
  flat = {n: np.frombuffer(t.buf, dtype=_np_dtype(t.dtype)).reshape(t.shape)
          for n, t in parts.items()}
  return int(version), flat, hf_dir
