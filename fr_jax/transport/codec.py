"""Arrays, trajectories and weights <-> protobuf messages.

Arrays travel as raw little-endian bytes with dtype and shape (`Tensor`). Decoding never
trusts the sender: an unknown dtype, a negative dimension or a byte count that disagrees with
the shape raises `TrajectoryError("bad_field", ...)`, which the learner counts and answers.
"""

from __future__ import annotations

from typing import Iterator

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np

from fr_jax.trajectory import Trajectory, TrajectoryError
from fr_jax.transport import fr_jax_pb2 as pb

DTYPES = ("bool", "int8", "uint8", "int16", "int32", "int64", "uint32", "float16", "bfloat16",
          "float32", "float64")
CHUNK_BYTES = 4 << 20  # weight chunks; far below the channel's message limit
MAX_MESSAGE_BYTES = 64 << 20  # gRPC send/receive limit on both ends


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
  return pb.Trajectory(
      prompt_id=str(t.prompt_id), traj_id=t.traj_id,
      prompt_tokens=to_tensor(t.prompt_tokens.astype(np.int32)),
      completion_tokens=to_tensor(t.completion_tokens.astype(np.int32)),
      action_mask=to_tensor(t.action_mask.astype(bool)),
      behavior_logp=to_tensor(t.behavior_logp.astype(np.float32)),
      policy_version=to_tensor(t.policy_version.astype(np.int32)),
      reward=float(t.reward), finish_reason=t.finish_reason, num_tool_calls=t.num_tool_calls,
      num_turns=t.num_turns, env=t.env, worker_id=worker_id)


def trajectory_from_proto(m: pb.Trajectory) -> Trajectory:
  """The record as sent; `validate()` (in the learner's admission) checks its contents."""
  arrays = {f: from_tensor(getattr(m, f), f) for f in
            ("prompt_tokens", "completion_tokens", "action_mask", "behavior_logp",
             "policy_version")}
  return Trajectory(prompt_id=m.prompt_id, reward=m.reward, finish_reason=m.finish_reason,
                    num_tool_calls=m.num_tool_calls, num_turns=m.num_turns, env=m.env,
                    traj_id=m.traj_id, **arrays)


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
  for k in sorted(tree):
    v = tree[k]
    name = f"{prefix}{k}"
    if isinstance(v, dict):
      out.update(flatten(v, name + "/"))
    else:
      out[name] = v
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


def weight_chunks(version: int, flat: dict[str, np.ndarray], hf_dir: str = "",
                  chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.WeightsChunk]:
  """Every tensor as one or more byte-range chunks; the first chunk carries the count."""
  first = True
  for name, a in flat.items():
    a = np.ascontiguousarray(a)
    dname = _dtype_name(a)
    data = memoryview(a.reshape(-1).view(np.uint8))
    total = len(data)
    for off in range(0, max(total, 1), chunk_bytes):
      yield pb.WeightsChunk(version=version, num_tensors=len(flat) if first else 0, name=name,
                            dtype=dname, shape=list(a.shape), offset=off, total_bytes=total,
                            data=bytes(data[off:off + chunk_bytes]), hf_dir=hf_dir)
      first = False


def assemble_weights(chunks) -> tuple[int, dict[str, np.ndarray], str]:
  """(version, {name: array}, hf_dir) from a chunk stream; checks it arrived whole."""
  bufs: dict[str, tuple[bytearray, str, tuple]] = {}
  got: dict[str, int] = {}
  version, expected, hf_dir = None, None, ""
  for c in chunks:
    if version is None:
      version, expected, hf_dir = c.version, c.num_tensors, c.hf_dir
    elif c.version != version:
      raise ValueError(f"weights stream mixed versions {version} and {c.version}")
    if c.name not in bufs:
      bufs[c.name] = (bytearray(c.total_bytes), c.dtype, tuple(c.shape))
    buf = bufs[c.name][0]
    buf[c.offset:c.offset + len(c.data)] = c.data
    got[c.name] = got.get(c.name, 0) + len(c.data)
  if version is None:
    raise ValueError("empty weights stream")
  if len(bufs) != expected:
    raise ValueError(f"weights stream incomplete: {len(bufs)} of {expected} tensors")
  short = [n for n, (b, _, _) in bufs.items() if got[n] != len(b)]
  if short:
    raise ValueError(f"weights stream incomplete: tensors {short[:3]} are missing bytes")
  flat = {n: np.frombuffer(bytes(b), dtype=_np_dtype(d)).reshape(s)
          for n, (b, d, s) in bufs.items()}
  return int(version), flat, hf_dir
