r"""One shard stream alone: the per-stream rates docs/scale.md's fleet model is built from.

  python -m experiments.benchmarks.shard_stream                  # SmolLM2-135M shapes, bf16
  python -m experiments.benchmarks.shard_stream --model=r1-distill-qwen-1.5b --streams=1,2

A shard host process (random bf16 weights in the model's shapes, two versions 0.7% of the
elements apart: the demo run's measured rate, experiments/benchmarks/weight_delta.py) serves
its pieces over loopback gRPC; this process fetches them like a relay
(`fr_jax.transport.shard_fetch.fetch` into a safetensors file): version 1 plain, then version 2 as
deltas against it, with 1..N parallel streams. Nothing else runs on purpose, so the figures
are this machine's per-stream ceiling (the host and the relay each have a core). Prints JSON
lines: the machine, one row per (streams, encoding) with MB/s of model bytes written and
checked, and the host's delta-making rate.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

from experiments.benchmarks.common import emitter, machine

flags.DEFINE_string("model", "smollm2-135m", "shapes from fr_jax.models.registry.SHAPES")
flags.DEFINE_list("streams", ["1", "2"], "parallel streams to try")
flags.DEFINE_integer("repeats", 3, "fetches per (streams, encoding); the median is reported")
flags.DEFINE_string("serve", "", "internal: be the host process, writing the manifest here")
FLAGS = flags.FLAGS
emit = emitter("shard_stream")


def serve(model: str, manifest_path: str) -> None:
  import ml_dtypes
  import numpy as np

  from fr_jax.models import decoder, hf_shards, registry
  from fr_jax.transport import codec, shards
  from fr_jax.transport import server as srv
  cfg = registry.shape_config(model, param_dtype="bfloat16")
  rng = np.random.default_rng(0)
  params = codec.unflatten({k: (0.02 * rng.standard_normal(s, np.float32)).astype(
      ml_dtypes.bfloat16) for k, s in codec.flatten(decoder.param_shapes(cfg)).items()})
  m = hf_shards.manifest_of(params, cfg, "bfloat16")
  host = shards.ShardHost("bfloat16", precompute=False)
  p1 = hf_shards.local_pieces(params, cfg, m, 0)
  del params
  host.put(1, m, p1)
  p2 = {i: b.copy() for i, b in p1.items()}
  for b in p2.values():
    flat = b.reshape(-1).view(np.uint16)
    flat[np.unique(rng.integers(0, flat.size, max(1, flat.size * 7 // 1000)))] ^= 1
  host.put(2, m, p2)
  t = time.perf_counter()
  for i in range(len(m.pieces)):
    host.delta_frame(2, 1, i)
  make_s = time.perf_counter() - t
  _, port = srv.serve_shards(host)
  Path(manifest_path).write_text(m.to_json())
  print(f"{port} {make_s}", flush=True)
  sys.stdin.read()  # until the parent closes it


def main(argv):
  del argv
  if FLAGS.serve:
    return serve(FLAGS.model, FLAGS.serve)
  import statistics

  from fr_jax.models import hf_shards
  from fr_jax.transport import shard_fetch
  from fr_jax.transport.client import WeightsClient
  emit("machine", **machine(), model=FLAGS.model)
  tmp = Path(tempfile.mkdtemp(prefix="shard_stream_"))
  host = subprocess.Popen([sys.executable, "-m", "experiments.benchmarks.shard_stream",
                           f"--model={FLAGS.model}", f"--serve={tmp / 'manifest.json'}"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
  port, make_s = host.stdout.readline().split()
  m = hf_shards.Manifest.from_json((tmp / "manifest.json").read_text())
  emit("host", mb=round(m.nbytes / 1e6, 1), delta_make_s=round(float(make_s), 2),
       delta_make_mb_s=round(m.nbytes / 1e6 / float(make_s), 1))
  client = WeightsClient(f"127.0.0.1:{port}")
  src = [shard_fetch.Source("hosts", hosts=(f"127.0.0.1:{port}",))]

  def open_stream(a, v, p, b):
    return client.open_shards(a, v, p, b)

  try:
    for n in [int(s) for s in FLAGS.streams]:
      for encoding in ("plain", "delta"):
        times, wire = [], 0
        for r in range(FLAGS.repeats):
          base = shard_fetch.VersionFile(tmp / f"base{n}{r}.st", m, 1)
          shard_fetch.fetch(base, src, open_stream, streams=n)
          vf = base
          if encoding == "delta":
            t = time.perf_counter()
            vf = shard_fetch.VersionFile(tmp / f"v2_{n}{r}.st", m, 2)
            shard_fetch.fetch(vf, src, open_stream, base=base, streams=n)
          else:
            t = time.perf_counter()
            vf = shard_fetch.VersionFile(tmp / f"again{n}{r}.st", m, 1)
            shard_fetch.fetch(vf, src, open_stream, streams=n)
          times.append(time.perf_counter() - t)
          wire = sum(vf.received.values())
          for f in (base, vf):  # an open file's blocks outlive its name
            f.close()
          for f in tmp.glob("*.st"):
            f.unlink()
        med = statistics.median(times)
        emit("fetch", streams=n, encoding=encoding, mb=round(m.nbytes / 1e6, 1),
             wire_mb=round(wire / 1e6, 2), seconds_median=round(med, 3),
             mb_s_median=round(m.nbytes / 1e6 / med, 1),
             seconds=[round(x, 3) for x in times])
  finally:
    client.close()
    host.stdin.close()
    host.wait(timeout=30)
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
