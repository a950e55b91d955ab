r"""Smoke run: a learner and N rollout worker processes over loopback gRPC.

  python -m launch.smoke                      # tiny_test config, 2 workers, 5 updates
  python -m launch.smoke --workers=4 --updates=10 --run_dir=/tmp/smoke
  python -m launch.smoke --learner_processes=2   # a 2-process learner (2 x 4 CPU devices)

Prints the learner's final JSON line (updates, trajectories_admitted, rejected_by_reason,
max_lag, learner_idle_fraction, ...) with the workers' exit codes added. Exits non-zero if
the learner fails or times out.
"""

import json
import os
import secrets
import socket
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
flags.DEFINE_integer("learner_processes", 1, "learner processes (jax.distributed over "
                     "loopback, gloo collectives); with >1, each gets --learner_devices CPU "
                     "devices and the mesh is data=processes x fsdp=devices")
flags.DEFINE_integer("learner_devices", 4, "CPU devices per learner process (multi-process)")
FLAGS = flags.FLAGS


def spawn(module, *args, log=None, env=None):
  return subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                          stderr=log or subprocess.DEVNULL, text=True, env=env)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def main(argv):
  del argv
  run_dir = FLAGS.run_dir or tempfile.mkdtemp(prefix="fr_jax_smoke_")
  os.makedirs(run_dir, exist_ok=True)
  port_file = os.path.join(run_dir, "port")
  if os.path.exists(port_file):
    os.remove(port_file)
  common = [f"--config={FLAGS.config}", f"--run_dir={run_dir}",
            f"--config.max_updates={FLAGS.updates}"]
  followers = []
  learner_args = [f"--port_file={port_file}"]
  env = None
  n = FLAGS.learner_processes
  if n > 1:
    d = FLAGS.learner_devices
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={d}",
               FR_JAX_LEARNER_SECRET=secrets.token_hex(16))  # signs the learner's calls
    learner_args += [f"--coordinator_address=127.0.0.1:{free_port()}",
                     f"--num_processes={n}", f"--config.mesh.data={n}",
                     f"--config.mesh.fsdp={d}", f"--config.packing.row_buckets=({n * d},)"]
    for i in range(1, n):
      flog = open(os.path.join(run_dir, f"learner-{i}.log"), "w")
      followers.append(spawn("launch.learner", *common, *learner_args, f"--process_id={i}",
                             log=flog, env=env))
    learner_args.append("--process_id=0")
  with open(os.path.join(run_dir, "learner.log"), "w") as llog:
    learner = spawn("launch.learner", *common, *learner_args, log=llog, env=env)
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
    for f in followers:
      try:
        f.wait(timeout=60)
      except subprocess.TimeoutExpired:
        f.kill()
        f.wait()
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
  summary.update(worker_exit_codes=codes, run_dir=run_dir,
                 learner_exit_codes=[learner.returncode] + [f.returncode for f in followers])
  print(json.dumps(summary), flush=True)


if __name__ == "__main__":
  app.run(main)
