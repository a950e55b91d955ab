r"""Weights from the learner to SGLang servers through weight relays, the design before
issue 36 against the one after, in the same run: the learner's egress per version, each
relay's throughput, and the seconds from publish to every server serving the new version.

  python -m experiments.benchmarks.weight_relay     # SmolLM2-135M f32 x 4 relays, 1.5B bf16 x 2
  python -m experiments.benchmarks.weight_relay --designs=shards --update=sparse
  python -m experiments.benchmarks.weight_relay --cases=random:smollm2-135m:float32 \
      --relays=2 --versions=3

Per case and design, in a fresh process (so that one case's memory does not crowd the next):
random weights in a real model's shapes (`random:NAME`), one STAND-IN SGLang server per relay
(tests/sglang_standin.py: the embedded JAX engine behind SGLang's HTTP API, which SGLang itself
would need CUDA for; their reload from disk is part of "serving") and one relay process
(`launch.weight_relay`) beside each.

* `whole` (before): a learner-side weight service in one process (`transport.server.serve`
  over parameters published by hand); every relay fetches the whole model (`GetWeights`),
  then writes it. (A multi-process learner would first gather its shards; not included.)
* `shards` (after): a 2-process learner (`experiments/benchmarks/shard_hosts.py`: two
  `jax.distributed` processes, each holding half the weights and serving its own pieces in
  bf16); relays with `--serve_address`, so relays beyond the first two fetch from relays.
  `--update`: `dense` versions change every element (deltas cannot help), `sparse` ones 0.7 %
  (the demo run's measured rate: deltas on the wire).

Version 1 is delivered cold (relays starting); each of --versions further versions is
published and timed: publish -> each server's load done -> its first answer at that version (a
one-token /generate). The relays report fetch (for shards: fetch and write, one step), write
and load per version. Everything shares this machine's cores.

The 1.5B case runs in bfloat16: in float32 the servers' copies do not fit in 24 GB. A case is
skipped (a `skipped` line) when less memory is available than it needs; the benchmark's
processes volunteer to the OOM killer first (oom_score_adj 1000), as the machine is shared,
and run with MALLOC_ARENA_MAX=2 (set by re-executing itself). Prints JSON lines: the machine,
the settings, one row per (version, server), a summary per case with the learner's egress per
version and memory peaks.

Time: about 2 minutes per design for SmolLM2-135M and 7 for the 1.5B shapes on 2 cores.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from absl import app, flags

from experiments.benchmarks.common import emitter, machine

flags.DEFINE_list("cases", ["random:smollm2-135m:float32",
                            "random:r1-distill-qwen-1.5b:bfloat16"],
                  "model:dtype pairs (random:NAME shapes from fr_jax.models.registry.SHAPES)")
flags.DEFINE_integer("versions", 3, "timed versions per case after the cold first one")
flags.DEFINE_list("designs", ["whole", "shards"], "whole: every relay fetches the whole model "
                  "from process 0 (the design before issue 36); shards: a 2-process learner, "
                  "each process serving its own shards, relays feeding relays")
flags.DEFINE_list("relays", ["4", "2"], "relays (each with its own server) per case, in the "
                  "order of --cases")
flags.DEFINE_enum("update", "dense", ["dense", "sparse", "lora"], "shards design: how each "
                  "version differs: every element at random (dense: deltas cannot help), 0.7% "
                  "of the elements (sparse: the demo run's measured rate, docs/scale.md), or "
                  "a LoRA model's adapters only, every element of them (lora: rank --lora_rank "
                  "on every projection; the relays fold them in)")
flags.DEFINE_integer("lora_rank", 16, "--update=lora: the adapters' rank (alpha = 2 rank)")
flags.DEFINE_float("poll_s", 0.2, "the relays' --poll_s")
flags.DEFINE_string("dir", "", "where the relays write (default: a temporary directory)")
flags.DEFINE_string("one", "", "internal: run only this MODEL:DTYPE,DESIGN,RELAYS case here (each "
                    "case runs in a fresh process, so that one's memory does not crowd out the "
                    "next)")
FLAGS = flags.FLAGS

ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
emit = emitter("weight_relay")


def mem_available_gb() -> float:
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("MemAvailable:"):
        return int(line.split()[1]) / 2**20
  return float("nan")


class MemWatch:
  """The lowest MemAvailable seen and the relays' largest RSS, sampled every 0.1 s."""

  def __init__(self):
    self.low = mem_available_gb()
    self.pids: list[int] = []
    self.rss_mb: dict[int, float] = {}
    self.trace: list = []
    self._stop = threading.Event()
    self._t = threading.Thread(target=self._run, daemon=True)
    self._t.start()

  def _run(self):
    t0 = time.monotonic()
    while not self._stop.wait(0.1):
      self.low = min(self.low, mem_available_gb())
      for pid in self.pids:
        try:
          with open(f"/proc/{pid}/statm") as f:
            mb = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        except OSError:
          continue
        if mb > self.rss_mb.get(pid, 0) + 50:
          self.trace.append((round(time.monotonic() - t0, 1), pid, round(mb)))
        self.rss_mb[pid] = max(self.rss_mb.get(pid, 0), mb)

  def close(self) -> float:
    self._stop.set()
    self._t.join()
    return self.low


def random_params(cfg, seed: int, where: Path) -> dict:
  """Random parameters in `cfg`'s shapes and dtype (norms 1), made one tensor at a time into
  writable memory-mapped files under `where`: the learner's copy is page cache the kernel can
  write back, not memory the servers and relays being measured must share."""
  import ml_dtypes

  from fr_jax.models import decoder
  from fr_jax.transport import codec
  where.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  dt = np.dtype(ml_dtypes.bfloat16) if cfg.param_dtype == "bfloat16" else np.dtype(
      cfg.param_dtype)
  flat = {}
  for i, (name, shape) in enumerate(codec.flatten(decoder.param_shapes(cfg)).items()):
    a = np.lib.format.open_memmap(where / f"{i}.npy", mode="w+", dtype=dt, shape=shape)
    if name.endswith("norm"):
      a[...] = 1
    else:
      for row in range(0, shape[0], 4096):  # a bounded float32 temporary
        a[row:row + 4096] = 0.02 * rng.standard_normal((min(4096, shape[0] - row),
                                                        *shape[1:]), np.float32)
    flat[name] = a
  return codec.unflatten(flat)


class ShardHosts:
  """The 2-process learner of the shards design (experiments/benchmarks/shard_hosts.py),
  driven over the processes' stdin."""

  def __init__(self, model: str, dtype: str, params_dir: Path):
    import socket
    with socket.socket() as sock:
      sock.bind(("127.0.0.1", 0))
      coord = sock.getsockname()[1]
    self.procs = [subprocess.Popen(
        [sys.executable, "-m", "experiments.benchmarks.shard_hosts",
         f"--params_dir={params_dir}", f"--model={model}", f"--dtype={dtype}",
         f"--lora_rank={lora_fields().get('lora_rank', 0)}",
         "--num_processes=2", f"--process_id={i}", f"--coordinator=127.0.0.1:{coord}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=open(params_dir.parent / f"shard_host{i}.log", "w"), text=True,
        env=dict(ENV, FR_JAX_LEARNER_SECRET="bench")) for i in range(2)]
    self.logs = [params_dir.parent / f"shard_host{i}.log" for i in range(2)]
    line = self._line(0, "serving")
    self.port = int(line.split()[1])

  def _line(self, k: int, prefix: str) -> str:
    while True:
      line = self.procs[k].stdout.readline()
      if not line:
        raise RuntimeError(f"shard host {k} exited ({self.procs[k].poll()}): "
                           + self.logs[k].read_text()[-3000:])
      if line.startswith(prefix):
        return line.strip()

  def _send(self, k: int, text: str) -> None:
    self.procs[k].stdin.write(text + "\n")
    self.procs[k].stdin.flush()

  def publish(self, v: int, how: str) -> None:
    """Process 1's pieces first, then process 0's (which announces the version)."""
    self._send(1, f"publish {v} {how}")
    self._line(1, "published")
    self._send(0, f"publish {v} {how}")
    self._line(0, "published")

  def sent_bytes(self) -> int:
    total = 0
    for k in range(2):
      self._send(k, "stats")
      total += json.loads(self._line(k, "{"))["sent_bytes"]
    return total

  def shutdown(self) -> None:
    self._send(0, "quit")
    self._line(0, "shutdown")

  def close(self) -> None:
    for k, p in enumerate(self.procs):
      if p.poll() is None:
        try:
          self._send(k, "exit")
          p.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
          p.kill()


def lora_fields() -> dict:
  """The ModelConfig fields of --update=lora's adapters (none for the other updates)."""
  if FLAGS.update != "lora":
    return {}
  return dict(lora_rank=FLAGS.lora_rank, lora_alpha=2.0 * FLAGS.lora_rank,
              lora_targets=("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))


def run_case(model: str, dtype: str, out_root: Path, design: str, n_relays: int) -> None:
  import jax

  from fr_jax.models import registry
  from fr_jax.rollout.engine import Request
  from fr_jax.rollout.sglang import SGLangEngine
  from fr_jax.transport import relay
  from fr_jax.transport import server as srv
  from tests.sglang_standin import PublishedWeights, StandInSGLang

  cfg = registry.shape_config(model.removeprefix("random:"), param_dtype=dtype,
                              **lora_fields())
  itemsize = np.dtype(jax.numpy.dtype(dtype)).itemsize
  gb = cfg.num_params * itemsize / 2**30
  wire_gb = cfg.num_params * 2 / 2**30  # shards travel in bfloat16
  # servers, and the whole design's relay buffers or the shards design's two hosts' pieces
  need = (n_relays * 1.15 * gb + (n_relays * gb if design == "whole" else 2 * wire_gb)) + 2.0
  avail = mem_available_gb()
  tag = f"{model.replace(':', '_')}-{dtype}-{design}{n_relays}"
  if avail < need:
    emit("skipped", model=model, dtype=dtype, design=design, relays=n_relays,
         model_gb=round(gb, 2), reason=f"{avail:.1f} GB available, about {need:.1f} GB needed")
    return
  watch = MemWatch()
  t0 = time.perf_counter()
  # what the servers start with; computing in the storage dtype keeps XLA from holding f32
  # copies of bf16 weights (+5.5 GB at the 1.5B shapes)
  m0 = registry.load(model, param_dtype=dtype, compute_dtype=dtype, seed=0)
  standins = [StandInSGLang(m0, num_slots=1, max_len=64, drop_before_load=True)
              for _ in range(n_relays)]
  del m0
  clients = [SGLangEngine(s.url, timeout=600) for s in standins]
  probe = Request("warm", [1, 2, 3], max_new_tokens=1, temperature=1.0, seed=0)
  for c in clients:  # compiles the (shared) engine functions
    c.generate([probe])
  setup_s = time.perf_counter() - t0

  published = random_params(cfg, 1, out_root / f"{tag}-published")
  hosts = server = None
  if design == "whole":
    service = PublishedWeights()
    service.publish(1, published)
    server, port = srv.serve(service)
  else:
    hosts = ShardHosts(model, dtype, out_root / f"{tag}-published")  # bf16 on the wire
    port = hosts.port
  rdirs = [out_root / f"{tag}-relay{k}" for k in range(n_relays)]
  t_pub = {1: time.time()}
  extra = (["--fetch=whole"] if design == "whole" else
           ["--fetch=shards", "--serve_address=127.0.0.1:0"])
  relays = [subprocess.Popen(
      [sys.executable, "-m", "launch.weight_relay", "--config=experiments/configs/cpu_default.py",
       f"--config.model.name={model}", f"--config.model.param_dtype={dtype}",
       f"--learner=127.0.0.1:{port}", f"--server={s.url}", f"--dir={d}",
       f"--poll_s={FLAGS.poll_s}", f"--relay_id=relay{k}", *extra],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
      for k, (s, d) in enumerate(zip(standins, rdirs))]
  watch.pids = [p.pid for p in relays]
  emit("settings", model=model, dtype=dtype, design=design, relays=n_relays,
       params=cfg.num_params, bytes=int(cfg.num_params * itemsize),
       wire_bytes=int(cfg.num_params * (itemsize if design == "whole" else 2)),
       update=FLAGS.update if design == "shards" else "negate (in place)",
       versions=FLAGS.versions,
       poll_s=FLAGS.poll_s, setup_s=round(setup_s, 1), mem_available_gb=round(avail, 1))
  rows, egress = [], {}
  sent0 = 0
  try:
    for v in range(1, FLAGS.versions + 2):
      if v > 1:
        t_pub[v] = time.time()
        if design == "whole":  # different weights, same shapes, made in place: no copy
          for a in jax.tree.leaves(published):
            np.negative(a, out=a)
          service.publish(v, published)
        else:
          hosts.publish(v, FLAGS.update)
      for k, (s, c) in enumerate(zip(standins, clients)):
        t_end = time.monotonic() + 900
        while not (s.loads and s.loads[-1][0] == v):
          if time.monotonic() > t_end or any(p.poll() is not None for p in relays):
            raise RuntimeError(f"version {v} never reached server {k}: "
                               + " | ".join(p.stderr.read()[-2000:] for p in relays
                                            if p.poll() is not None))
          time.sleep(0.02)
        (got,) = c.generate([Request(f"v{v}", [1, 2, 3], max_new_tokens=1, temperature=1.0,
                                     seed=v)])
        assert got.versions == [v], got.versions
        rows.append(dict(version=v, server=k, loaded_s=s.loads[-1][2] - t_pub[v],
                         serving_s=time.time() - t_pub[v]))
      if hosts is not None:
        sent = hosts.sent_bytes()
        egress[v], sent0 = sent - sent0, sent
    if hosts is not None:
      hosts.shutdown()
    else:
      service.shutdown.set()
    summaries = []
    for p in relays:
      out, err = p.communicate(timeout=120)
      if p.returncode != 0:
        raise RuntimeError(f"relay exited {p.returncode}: {err[-2000:]}")
      summaries.append(json.loads(out.strip().splitlines()[-1]))
  finally:
    for p in relays:
      if p.poll() is None:
        p.kill()
    for c in clients:
      c.close()
    for s in standins:
      s.close()
    if server is not None:
      srv.stop(server)
    if hosts is not None:
      hosts.close()
  low = watch.close()

  for r in rows:
    d = summaries[r["server"]]["versions"][r["version"] - 1]
    assert d["version"] == r["version"]
    emit("version", model=model, dtype=dtype, design=design, relays=n_relays,
         cold=r["version"] == 1, version=r["version"], server=r["server"],
         mb=round(d["bytes"] / 1e6, 1), wire_mb=round(d["wire_bytes"] / 1e6, 1),
         fetch_s=round(d["fetch_s"], 3), fetch_mb_s=round(d["bytes"] / 1e6 / d["fetch_s"], 1),
         write_s=round(d["write_s"], 3), load_s=round(d["load_s"], 3), attempts=d["attempts"],
         publish_to_loaded_s=round(r["loaded_s"], 3),
         publish_to_serving_s=round(r["serving_s"], 3))
  if design == "whole":  # process 0 sent each relay everything it received
    for v in range(1, FLAGS.versions + 2):
      egress[v] = sum(s["versions"][v - 1]["wire_bytes"] for s in summaries)
  warm = [r for r in rows if r["version"] > 1]
  everyone = [max(r["serving_s"] for r in warm if r["version"] == v)
              for v in range(2, FLAGS.versions + 2)]
  ds = [summaries[r["server"]]["versions"][r["version"] - 1] for r in warm]
  med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
  model_bytes = ds[0]["bytes"]
  emit("summary", model=model, dtype=dtype, design=design, relays=n_relays,
       mb=round(model_bytes / 1e6, 1), timed_versions=FLAGS.versions,
       egress_bytes_per_version=[egress[v] for v in range(2, FLAGS.versions + 2)],
       egress_over_model_median=med([egress[v] / model_bytes
                                     for v in range(2, FLAGS.versions + 2)]),
       fetch_mb_s_per_relay_median=med([d["bytes"] / 1e6 / d["fetch_s"] for d in ds]),
       wire_mb_per_relay_median=med([d["wire_bytes"] / 1e6 for d in ds]),
       fetch_s_median=med([d["fetch_s"] for d in ds]),
       write_s_median=med([d["write_s"] for d in ds]),
       load_s_median=med([d["load_s"] for d in ds]),
       publish_to_all_serving_s_median=med(everyone), publish_to_all_serving_s_max=round(
           max(everyone), 3),
       failures=[s["failures"] for s in summaries],
       relay_peak_rss_mb=[round(s["peak_rss_mb"]) for s in summaries],
       bench_peak_rss_mb=round(relay.peak_rss_mb()),
       mem_available_low_gb=round(low, 1))


def main(argv):
  if "MALLOC_ARENA_MAX" not in os.environ:  # again, with glibc's per-thread arenas bounded:
    # XLA's threads otherwise keep freed temporaries, about 1 GB per 1.5B-shaped server
    os.execve(sys.executable, [sys.executable, "-m", "experiments.benchmarks.weight_relay",
                               *sys.argv[1:]], dict(os.environ, MALLOC_ARENA_MAX="2"))
  del argv
  try:  # this machine is shared: if memory runs out, these processes (children too) go first
    with open("/proc/self/oom_score_adj", "w") as f:
      f.write("1000")
  except OSError:
    pass
  import shutil
  if FLAGS.one:
    case, design, n = FLAGS.one.split(",")
    model, _, dtype = case.rpartition(":")
    root = Path(FLAGS.dir)
    try:
      run_case(model, dtype, root, design, int(n))
    finally:
      shutil.rmtree(root, ignore_errors=True)  # this case's files
    return
  emit("machine", **machine(), malloc_arena_max=os.environ.get("MALLOC_ARENA_MAX"),
       mem_total_gb=round(os.sysconf("SC_PAGE_SIZE")
                                                  * os.sysconf("SC_PHYS_PAGES") / 2**30, 1))
  root = Path(FLAGS.dir or tempfile.mkdtemp(prefix="weight_relay_bench_"))
  if len(FLAGS.relays) != len(FLAGS.cases):
    raise app.UsageError("--relays needs one count per --cases entry")
  for case, n in zip(FLAGS.cases, FLAGS.relays):
    for design in FLAGS.designs:
      # a fresh process per case: the last one's buffers and files are gone
      subprocess.run([sys.executable, "-m", "experiments.benchmarks.weight_relay",
                      f"--one={case},{design},{n}", f"--dir={root / f'{design}{n}'}",
                      f"--versions={FLAGS.versions}", f"--poll_s={FLAGS.poll_s}",
                      f"--update={FLAGS.update}", f"--lora_rank={FLAGS.lora_rank}"],
                     check=True)
  if not FLAGS.dir:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
