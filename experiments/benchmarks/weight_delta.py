r"""How much a delta encoding would save on the wire between consecutive weights versions of a
real run: the demo's checkpoints (SmolLM2-135M trained by FlashREINFORCE), cast to the serving
dtype as the relays receive them.

  python -m experiments.benchmarks.weight_delta --run_dir=runs/demo
  python -m experiments.benchmarks.weight_delta --run_dir=/tmp/run --dtype=bfloat16 --level=3

The demo saves a checkpoint every 4 updates; to measure versions one update apart, resume a
finished run with `--config.checkpoint.every=1` for a few updates (docs/scale.md gives the
command). For each pair of checkpoints (a, b), b's parameters against a's, in `--dtype`:

* `changed_tensors`: tensors with any element changed, and `changed_tensor_bytes`: what
  sending only those would cost (the "changed tensors only" encoding);
* `changed_elements`: the fraction of elements whose bits changed;
* `xor_zstd_bytes`: the bitwise XOR of b's bytes with a's, compressed with zstandard at
  `--level` (one frame per tensor), and `plain_zstd_bytes`: b's bytes compressed alike (what
  compression alone gives, without a base version);
* the savings, full bytes over each encoding, and the seconds each took on one core.

Prints JSON lines: the machine, one row per pair, a summary with the median savings.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
from absl import app, flags

from experiments.benchmarks.common import emitter, machine

flags.DEFINE_string("run_dir", "runs/demo", "a run directory with checkpoints/")
flags.DEFINE_string("dtype", "bfloat16", "the serving dtype the relays receive")
flags.DEFINE_integer("level", 3, "zstandard compression level")
flags.DEFINE_integer("max_pairs", 8, "at most this many consecutive pairs (newest)")
FLAGS = flags.FLAGS
emit = emitter("weight_delta")


def load_params(step_dir: Path, dtype) -> dict[str, np.ndarray]:
  """{name: array in `dtype`} of a checkpoint's parameters."""
  import jax
  import orbax.checkpoint as ocp

  from fr_jax.transport import codec
  state = ocp.StandardCheckpointer().restore(step_dir / "state")
  params = jax.tree.map(np.asarray, state["params"])
  return {k: np.ascontiguousarray(a.astype(dtype)) for k, a in codec.flatten(params).items()}


def measure(a: dict, b: dict, level: int) -> dict:
  import zstandard
  cctx = zstandard.ZstdCompressor(level=level)
  full = changed_t = changed_bytes = changed_el = n_el = xor_bytes = plain_bytes = 0
  t_xor = t_plain = 0.0
  for k in sorted(b):
    x, y = a[k].view(np.uint8).reshape(-1), b[k].view(np.uint8).reshape(-1)
    full += y.nbytes
    w = b[k].dtype.itemsize
    diff = np.bitwise_xor(x, y)
    el = diff.reshape(-1, w).any(axis=1)
    n_el += el.size
    changed_el += int(el.sum())
    if el.any():
      changed_t += 1
      changed_bytes += y.nbytes
    t0 = time.perf_counter()
    xor_bytes += len(cctx.compress(diff.tobytes()))
    t_xor += time.perf_counter() - t0
    t0 = time.perf_counter()
    plain_bytes += len(cctx.compress(y.tobytes()))
    t_plain += time.perf_counter() - t0
  return dict(tensors=len(b), changed_tensors=changed_t, full_bytes=full,
              changed_tensor_bytes=changed_bytes, changed_elements=round(changed_el / n_el, 5),
              xor_zstd_bytes=xor_bytes, plain_zstd_bytes=plain_bytes,
              saving_changed_tensors=round(full / max(changed_bytes, 1), 3),
              saving_xor_zstd=round(full / xor_bytes, 3),
              saving_plain_zstd=round(full / plain_bytes, 3),
              xor_zstd_s=round(t_xor, 2), plain_zstd_s=round(t_plain, 2))


def main(argv):
  del argv
  from fr_jax.learner.checkpoint import committed_steps
  from fr_jax.models.hf_io import _np_dtype
  ckpt = Path(FLAGS.run_dir) / "checkpoints"
  steps = committed_steps(ckpt)[-(FLAGS.max_pairs + 1):]
  if len(steps) < 2:
    raise SystemExit(f"{ckpt}: {len(steps)} checkpoints; two or more are needed")
  emit("machine", **machine(), run_dir=str(FLAGS.run_dir), dtype=FLAGS.dtype,
       level=FLAGS.level, steps=steps)
  dtype = _np_dtype(FLAGS.dtype)
  rows = []
  prev = load_params(ckpt / str(steps[0]), dtype)
  for s0, s1 in zip(steps, steps[1:]):
    cur = load_params(ckpt / str(s1), dtype)
    r = measure(prev, cur, FLAGS.level)
    emit("pair", base=s0, version=s1, apart=s1 - s0, **r)
    rows.append(r)
    prev = cur
  med = lambda k: round(statistics.median(r[k] for r in rows), 3)  # noqa: E731
  emit("summary", pairs=len(rows), apart=sorted({b - a for a, b in zip(steps, steps[1:])}),
       changed_elements_median=med("changed_elements"),
       saving_changed_tensors_median=med("saving_changed_tensors"),
       saving_xor_zstd_median=med("saving_xor_zstd"),
       saving_plain_zstd_median=med("saving_plain_zstd"))


if __name__ == "__main__":
  app.run(main)
