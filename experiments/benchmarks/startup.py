r"""Start-up with the persistent compilation cache cold and warm (`fr_jax.compile_cache`).

  python -m experiments.benchmarks.startup                      # both cases, 2 warm runs
  python -m experiments.benchmarks.startup --cases=worker --repeats=3

Cases, each in fresh processes:
  worker  what a restarted worker pays before its first rollout with the demo's config
          (cpu_default, SmolLM2-135M-Instruct): load the model, build the embedded engine and
          compile every prefill bucket and decode window (`EmbeddedEngine.warmup`)
  demo    `make demo`'s command stopped after its first update, with the held-out evaluations
          off (`--config.max_updates=1 --config.eval.n=0`): the process's wall time, the
          learner's compile seconds and its wait for the first batch (engine start-up and the
          first B rollouts)

Each case runs once over an empty cache directory (cold), then `--repeats` times over the
directory the cold run filled (warm). One JSON line per run, then one per case with the warm
median and the cold/warm ratio. About 6 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from experiments.benchmarks.common import emitter, machine

flags.DEFINE_list("cases", ["worker", "demo"], "worker, demo")
flags.DEFINE_integer("repeats", 2, "warm runs per case")
flags.DEFINE_string("config", "experiments/configs/cpu_default.py", "the demo's config")
flags.DEFINE_string("child", "", "internal: run one worker start-up in this process")
flags.DEFINE_string("cache", "", "internal: the child's cache directory")
F = flags.FLAGS

emit = emitter("startup")


def worker_child() -> None:
  """One worker start-up in this process (the `worker` case); prints its figures."""
  t0 = time.perf_counter()
  from fr_jax import compile_cache
  compile_cache.configure(F.cache)
  from fr_jax import config as rcfg
  from fr_jax import system
  from fr_jax.models import registry
  c = rcfg.validate(runpy.run_path(F.config)["get_config"]())
  model = registry.load_configured(c.model)
  t1 = time.perf_counter()
  engine = system.build_engine(c, model)
  engine.warmup()
  t2 = time.perf_counter()
  print(json.dumps(dict(load_s=round(t1 - t0, 2), engine_s=round(t2 - t1, 2),
                        total_s=round(t2 - t0, 2), compiles=engine.compile_counts)))


def run_worker(cache: str) -> dict:
  t0 = time.perf_counter()
  out = subprocess.run([sys.executable, "-m", "experiments.benchmarks.startup",
                        "--child=worker", f"--cache={cache}", f"--config={F.config}"],
                       capture_output=True, text=True, check=False)
  if out.returncode:
    raise RuntimeError(f"worker start-up failed:\n{out.stderr[-3000:]}")
  return dict(json.loads(out.stdout.strip().splitlines()[-1]),
              wall_s=round(time.perf_counter() - t0, 2))


def run_demo(cache: str) -> dict:
  run_dir = tempfile.mkdtemp(prefix="startup_demo_")
  try:
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "launch.train", f"--config={F.config}", f"--run_dir={run_dir}",
         "--config.max_updates=1", "--config.eval.n=0", f"--config.compile_cache_dir={cache}"],
        capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if out.returncode:
      raise RuntimeError(f"launch.train failed:\n{out.stderr[-3000:]}")
    s = json.loads(out.stdout.strip().splitlines()[-1])
    return dict(wall_s=round(wall, 2), learner_compile_s=s.get("learner_compile_s"),
                startup_wait_s=s.get("startup_wait_s"), updates=s.get("updates"))
  finally:
    shutil.rmtree(run_dir, ignore_errors=True)


def main(argv):
  del argv
  if F.child:
    return worker_child()
  emit("machine", **machine())
  runs = {"worker": run_worker, "demo": run_demo}
  for case in F.cases:
    if case not in runs:
      raise app.UsageError(f"--cases: unknown case {case!r}; choose from {sorted(runs)}")
  for case in F.cases:
    cache = tempfile.mkdtemp(prefix="startup_xla_")
    try:
      cold = runs[case](cache)
      emit("run", case=case, cache="cold", **cold)
      entries = len(os.listdir(cache))
      warm = []
      for _ in range(F.repeats):
        warm.append(runs[case](cache))
        emit("run", case=case, cache="warm", **warm[-1])
      med = statistics.median(w["wall_s"] for w in warm)
      emit("summary", case=case, cold_wall_s=cold["wall_s"], warm_wall_s_median=med,
           cold_over_warm=round(cold["wall_s"] / med, 2), cache_entries=entries)
    finally:
      shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
