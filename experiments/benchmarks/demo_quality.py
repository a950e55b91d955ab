r"""Demo quality: `make demo` (SmolLM2-135M-Instruct on arithmetic) at several seeds, and the
held-out gain of each run, as JSON lines. Run it for any change to the engine, the agent
loop, the objective, the learner, packing, the models or the demo configs.

  python -m experiments.benchmarks.demo_quality --seeds=0,1,2
  python -m experiments.benchmarks.demo_quality --seeds=3,4 --load=2    # under CPU load
  python -m experiments.benchmarks.demo_quality --seeds=0 --set=optim.lr=5e-6 --out=runs/dq

Each run is `python -m launch.train --config=experiments/configs/cpu_default.py
--run_dir=OUT/seedN --config.env.seed=N` (the seed fixes the prompts and the rollouts'
sampling seeds), one after another. `--load=K` starts K processes that spin on the CPU for
the whole run (the asynchronous timing then differs, as it does on a busy machine). `--set`
overrides config fields (repeatable).

One line per run: the held-out accuracy (greedy, the config's eval.n test problems) at the
start and the end and the gain in points, the final response length and truncation rate
(held-out and, averaged over the last 8 updates, training), where the time went (model load
and start-up, the two evaluations, the update loop; the learner's busy time and compile time
inside it), the peak resident memory and the machine. Then a summary line: the gains, their
minimum and median, and whether every run reached `--min_gain` points with length and
truncation not rising. As long as `make demo` a run (13-26 minutes on 2 cores, docs/times.md).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags

from experiments.benchmarks.common import emitter, machine

flags.DEFINE_list("seeds", ["0", "1", "2"], "env.seed of each run")
flags.DEFINE_string("config", "experiments/configs/cpu_default.py", "the demo's config")
flags.DEFINE_string("out", "runs/demo_quality", "one run directory per seed under this")
flags.DEFINE_integer("load", 0, "CPU-spinning processes to run alongside each run")
flags.DEFINE_multi_string("set", [], "config overrides, FIELD=VALUE (repeatable)")
flags.DEFINE_float("min_gain", 15.0, "held-out gain in points that every run must reach")
flags.DEFINE_bool("rerun", False, "run again a seed whose run directory has a summary")
F = flags.FLAGS

emit = emitter("demo_quality")


def _spin(stop):
  while not stop.is_set():
    sum(i * i for i in range(10_000))


def _peak_rss_mb(proc) -> float:
  """Samples the process tree's resident memory every second until it exits."""
  import psutil
  peak = 0
  try:
    p = psutil.Process(proc.pid)
    while proc.poll() is None:
      try:
        rss = p.memory_info().rss + sum(c.memory_info().rss for c in p.children(True))
      except psutil.Error:
        rss = 0
      peak = max(peak, rss)
      time.sleep(1.0)
  except psutil.Error:
    pass
  proc.wait()
  return round(peak / 2**20, 1)


def run_one(seed: int) -> dict:
  run_dir = os.path.join(F.out, f"seed{seed}")
  summary_path = os.path.join(run_dir, "summary.json")
  if F.rerun and os.path.exists(run_dir):
    import shutil
    shutil.rmtree(run_dir)
  peak_mb = None
  wall = None
  if not os.path.exists(summary_path):
    os.makedirs(run_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "launch.train", f"--config={F.config}",
           f"--run_dir={run_dir}", f"--config.env.seed={seed}",
           *[f"--config.{s}" for s in F.set]]
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
                for _ in range(F.load)]
    for s in spinners:
      s.start()
    t0 = time.perf_counter()
    with open(os.path.join(run_dir, "stderr.log"), "w") as err:
      proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
      peak_mb = _peak_rss_mb(proc)
    wall = round(time.perf_counter() - t0, 1)
    stop.set()
    for s in spinners:
      s.join()
    if proc.returncode != 0:
      return dict(seed=seed, failed=True, returncode=proc.returncode, run_dir=run_dir,
                  stderr_tail=open(os.path.join(run_dir, "stderr.log")).read()[-2000:])
  with open(summary_path) as f:
    s = json.load(f)
  from fr_jax.learner.metrics import read_jsonl
  ev = {(r["stage"], r["version"]): r for r in read_jsonl(os.path.join(run_dir, "evals.jsonl"))}
  start, end = ev[("rl", 0)], ev[("rl", s["version"])]
  ups = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "reward_mean" in r]
  first, last = ups[:8], ups[-8:]
  mean = lambda rows, k: round(statistics.fmean(r[k] for r in rows), 4)  # noqa: E731
  learner_s = sum(r["step_time_s"] for r in ups)
  return dict(
      seed=seed, run_dir=run_dir, load=F.load, overrides=F.set,
      heldout_start=start["accuracy"], heldout_end=end["accuracy"],
      gain_points=round(100 * (end["accuracy"] - start["accuracy"]), 1),
      heldout_length=[round(start["response_length"], 1), round(end["response_length"], 1)],
      heldout_truncation=[start["truncation_rate"], end["truncation_rate"]],
      train_length_first8_last8=[mean(first, "response_length"), mean(last, "response_length")],
      train_truncation_first8_last8=[mean(first, "truncation_rate"),
                                     mean(last, "truncation_rate")],
      train_reward_first8_last8=[mean(first, "reward_mean"), mean(last, "reward_mean")],
      acceptance_min=round(min(r["acceptance_rate"] for r in ups), 3),
      policy_lag_mean=mean(ups, "policy_lag_mean"),
      updates=s["updates"],
      wall_s=wall if wall is not None else s.get("wall_s"),
      time_s=dict(
          eval_start=start["seconds"], eval_end=end["seconds"],
          update_loop=s.get("update_loop_s"), learner_busy=round(learner_s, 1),
          learner_compile=s.get("learner_compile_s"), startup_wait=s.get("startup_wait_s")),
      learner_idle_fraction=s.get("learner_idle_fraction"),
      peak_rss_mb=peak_mb)


def main(argv):
  del argv
  emit("machine", **machine())
  runs = []
  for seed in [int(x) for x in F.seeds]:
    r = run_one(seed)
    emit("run", **r)
    runs.append(r)
  ok = [r for r in runs if not r.get("failed")]
  gains = [r["gain_points"] for r in ok]
  steady = [r["train_length_first8_last8"][1] <= r["train_length_first8_last8"][0] + 2
            and r["heldout_truncation"][1] <= r["heldout_truncation"][0] for r in ok]
  emit("summary", seeds=[r["seed"] for r in runs], gains=gains, failed=len(runs) - len(ok),
       min_gain=min(gains) if gains else None,
       median_gain=statistics.median(gains) if gains else None,
       passed=bool(ok) and len(ok) == len(runs) and all(g >= F.min_gain for g in gains)
       and all(steady))


if __name__ == "__main__":
  app.run(main)
