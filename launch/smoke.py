r"""Smoke run: a learner and N rollout worker processes over loopback gRPC.

  python -m launch.smoke                      # tiny_test config, 2 workers, 5 updates
  python -m launch.smoke --workers=4 --updates=10 --run_dir=/tmp/smoke

Prints the learner's final JSON line (updates, trajectories_admitted, rejected_by_reason,
max_lag, learner_idle_fraction, ...) with the workers' exit codes added. Exits non-zero if
the learner fails or times out.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

flags.DEFINE_string("config", "experiments/configs/tiny_test.py", "experiment config")
flags.DEFINE_integer("workers", 2, "worker processes")
flags.DEFINE_integer("updates", 5, "learner updates")
flags.DEFINE_string("run_dir", "", "run directory (default: a fresh temporary one)")
flags.DEFINE_float("timeout_s", 600.0, "give up after this long")
FLAGS = flags.FLAGS


def spawn(module, *args, log=None):
  return subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                          stderr=log or subprocess.DEVNULL, text=True)


def main(argv):
  del argv
  run_dir = FLAGS.run_dir or tempfile.mkdtemp(prefix="fr_jax_smoke_")
  os.makedirs(run_dir, exist_ok=True)
  port_file = os.path.join(run_dir, "port")
  if os.path.exists(port_file):
    os.remove(port_file)
  common = [f"--config={FLAGS.config}", f"--run_dir={run_dir}",
            f"--config.max_updates={FLAGS.updates}"]
  with open(os.path.join(run_dir, "learner.log"), "w") as llog:
    learner = spawn("launch.learner", *common, f"--port_file={port_file}", log=llog)
    t_end = time.monotonic() + FLAGS.timeout_s
    while not os.path.exists(port_file):
      if learner.poll() is not None or time.monotonic() > t_end:
        learner.kill()
        sys.exit(f"learner did not start; see {run_dir}/learner.log")
      time.sleep(0.2)
    address = f"127.0.0.1:{open(port_file).read().strip()}"
    workers = []
    for i in range(FLAGS.workers):
      wlog = open(os.path.join(run_dir, f"worker-{i}.log"), "w")
      workers.append(spawn("launch.worker", *common, f"--learner={address}",
                           f"--worker_index={i}", f"--num_workers={FLAGS.workers}", log=wlog))
    try:
      out, _ = learner.communicate(timeout=max(1.0, t_end - time.monotonic()))
    except subprocess.TimeoutExpired:
      learner.kill()
      sys.exit(f"learner timed out after {FLAGS.timeout_s:g}s; see {run_dir}")
    codes = []
    for w in workers:
      try:
        w.wait(timeout=30)
      except subprocess.TimeoutExpired:
        w.kill()
        w.wait()
      codes.append(w.returncode)
  if learner.returncode != 0:
    sys.exit(f"learner exited with {learner.returncode}; see {run_dir}/learner.log")
  summary = json.loads(out.strip().splitlines()[-1])
  summary.update(worker_exit_codes=codes, run_dir=run_dir)
  print(json.dumps(summary), flush=True)


if __name__ == "__main__":
  app.run(main)
