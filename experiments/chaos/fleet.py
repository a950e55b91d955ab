r"""The fleet fault-injection run: exactly once, and a fleet that keeps up, when the path users
take beyond one machine breaks.

  make chaos-fleet                                  # 10 minutes, the acceptance run
  make chaos-fleet ENGINE=vllm                      # the same with 2 real vLLM servers
  python -m experiments.chaos.fleet --duration_s=60 --learner_kills=1 --server_restarts=1 \
      --relay_kills=1 --worker_faults=1 --refusal_windows=1 --poison_rounds=1   # make test's

On loopback with the tiny model: a learner of 2 processes (`launch.learner`, jax.distributed
with gloo, one CPU device each, one (data=2) mesh, the default asynchronous checkpointing),
2 SGLang servers (STAND-INS: `tests/sglang_standin.py` as processes; SGLang needs CUDA) with
an API key, the real sglang-router in front of them (`launch.router`), a weight relay beside
each server (`launch.weight_relay`, its --dir private to the run) and `--workers` rollout
workers (`launch.worker` with the SGLang engine, through the router). Workers and relays reach
the learner through a TCP proxy that can cut every connection. Over `--duration_s`, at seeded
random times, it injects:
* learner kills: SIGKILL of both learner processes, restarted with the same commands (the
  version goes back to the last checkpoint);
* server restarts: SIGKILL of one stand-in, restarted on its port 1-3 s later with the weights
  it was launched with;
* relay kills: SIGKILL of one relay, while it writes a version when one is caught in time;
* worker faults: a cut of every worker and relay connection, or a SIGKILL and restart of a
  random worker (`--worker_kill_fraction`);
* refusal windows: one server refuses every weight load for 3 s;
* poison rounds: the single-learner run's four hostile records, and a record with routing of
  the wrong shape (this model is dense: admission drops the routing and admits the record).

With `--engine=vllm` the servers are REAL vLLM 0.32 servers (`launch.vllm_server`, .venv-vllm
from `make vllm-tools`) serving tiny-chat-hd64 (vLLM's CPU attention needs 64-wide heads;
learner, relays and workers use the same model), each with its relay (`--engine=vllm`:
versions written untied, loaded in place with pause/reload/resume). No router: sglang-router
forwards SGLang's routes, not vLLM's `/inference/v1/generate`, so worker i talks to server
i mod 2 directly. A server restart SIGKILLs the server's whole process group (API server and
engine) and starts it again on its port. Refusal windows need a server that can be told to
refuse (the stand-in's `--refuse_file`); vLLM cannot, so none are injected there (the JSON
says `refusal_windows: "n/a (vllm)"`).

It prints one JSON line, the ledger (`experiments/chaos/run.py`'s audit of every
acknowledged record against metrics.jsonl, the admission log and the dead letters) and:
* `stalls`: faults after which no update came within `--stall_s`, and by fault kind the time
  from the fault to the next update (`next_update_after_fault_s`);
* `convergence_s`: after every learner restart, how long until both servers held a version
  in [the restored version, the learner's current one] (`/model_info`), against
  `--converge_bound_s`;
* `unexpected_exits`: workers, relays or servers that ended on their own (restarted);
and exits 1 unless nothing acknowledged was lost or used twice, every fault was followed by an
update, and the fleet converged within the bound after every learner and server restart.
"""

from __future__ import annotations

import collections
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
from absl import app, flags

from experiments.benchmarks.common import machine
from experiments.chaos import run as single
from experiments.chaos.proxy import CuttingProxy
from launch import vllm_server

VLLM_MODEL = "tiny-chat-hd64"

flags.DEFINE_enum("engine", "sglang", ["sglang", "vllm"], "the servers: SGLang stand-ins "
                  "behind sglang-router, or real vLLM servers")
flags.DEFINE_integer("server_restarts", 10, "server SIGKILLs and restarts")
flags.DEFINE_integer("relay_kills", 10, "weight relay SIGKILLs (mid-write when caught)")
flags.DEFINE_integer("refusal_windows", 6, "3-s windows in which one server refuses loads")
flags.DEFINE_float("stall_s", 300.0, "a fault not followed by an update within this is a "
                   "stall (a learner restart recompiles: no compilation cache across processes)")
flags.DEFINE_float("converge_bound_s", None, "after a learner or server restart, the servers "
                   "must hold the learner's version within this (default 90 s; 150 s with "
                   "--engine=vllm, whose server takes 25 s to start on an idle 2-core machine "
                   "and 65 s beside a training learner, measured)")
FLAGS = flags.FLAGS
note = single.note


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Fleet:
  """The processes, the proxy, and what the run observed of them."""

  def __init__(self, run: Path):
    self.run = run
    for d in ("ledger", "logs", "faults"):
      (run / d).mkdir(parents=True, exist_ok=True)
    self.key = secrets.token_hex(16)
    self.vllm = FLAGS.engine == "vllm"
    self.env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
                    JAX_COMPILATION_CACHE_DIR=str(run / "jax_cache"),
                    FR_JAX_LEARNER_SECRET=secrets.token_hex(16), SGLANG_API_KEY=self.key,
                    VLLM_API_KEY=self.key)
    self.learner_port = free_port()
    self.proxy = CuttingProxy(self.learner_port)
    self.server_ports = [free_port(), free_port()]
    self.router_port = free_port()
    self.model = [f"--config.model.name={VLLM_MODEL}"] if self.vllm else []
    self.common = [f"--config={FLAGS.config}", f"--run_dir={run}",
                   "--config.checkpoint.async_save=True", "--config.checkpoint.every=2",
                   *self.model]
    if self.vllm:  # the servers' launch weights: the learner's version 0
      self.model_dir = vllm_server.export_model(VLLM_MODEL, run / "models")
    self.learners: list[subprocess.Popen] = []
    self.learner_starts = 0
    self.servers: dict[int, subprocess.Popen] = {}
    self.relays: dict[int, subprocess.Popen] = {}
    self.workers: dict[int, subprocess.Popen] = {}
    self.router = None
    self.exits = collections.Counter()  # unexpected exits by kind
    self._ino, self._offset, self._rows, self._partial = None, 0, [], b""

  update_rows = single.Cluster.update_rows  # metrics.jsonl's update rows, incrementally

  def _spawn(self, args, log_name, env=None):
    log = open(self.run / "logs" / log_name, "a")
    return subprocess.Popen([sys.executable, *args], stdout=log, stderr=log,
                            env=env or self.env)

  # --- the learner: two processes, one mesh ---
  def start_learner(self) -> None:
    (self.run / "port").unlink(missing_ok=True)
    self.learner_starts += 1
    coord = f"127.0.0.1:{free_port()}"
    args = [*self.common, f"--coordinator_address={coord}", "--num_processes=2",
            "--config.mesh.data=2", "--config.mesh.fsdp=1", "--config.packing.row_buckets=(2,)",
            "--config.max_updates=100000000", "--linger_s=0"]
    self.learners = [self._spawn(
        ["-m", "launch.learner", *args, f"--process_id={i}",
         *([f"--address=127.0.0.1:{self.learner_port}", f"--port_file={self.run / 'port'}"]
           if i == 0 else [])],
        f"learner{i}-{self.learner_starts}.log") for i in range(2)]

  def kill_learner(self) -> None:
    for p in self.learners:
      p.send_signal(signal.SIGKILL)
    for p in self.learners:
      p.wait()
    self.start_learner()

  def serving(self) -> bool:
    return (self.run / "port").exists()

  # --- the fleet ---
  def start_server(self, i: int) -> None:
    if self.vllm:  # its own process group: a kill takes the API server and its engine
      self.servers[i] = vllm_server.start(
          self.model_dir, port=self.server_ports[i], api_key=self.key,
          log=self.run / "logs" / f"server-{i}.log")
      return
    self.servers[i] = self._spawn(
        ["-m", "tests.sglang_standin", f"--port={self.server_ports[i]}",
         f"--refuse_file={self.run / 'faults' / f'refuse-{i}'}"], f"server-{i}.log")

  def kill_server(self, i: int) -> None:
    if self.vllm:
      vllm_server.kill(self.servers[i])
    else:
      self.servers[i].send_signal(signal.SIGKILL)
      self.servers[i].wait()

  def server_url(self, i: int) -> str:
    return f"http://127.0.0.1:{self.server_ports[i]}"

  def start_router(self) -> None:
    self.router = self._spawn(
        ["-m", "launch.router", "--worker-urls",
         *[f"http://127.0.0.1:{p}" for p in self.server_ports], "--host", "127.0.0.1",
         "--port", str(self.router_port), "--policy", "round_robin", "--log-level", "warn",
         "--worker-startup-timeout-secs", "600"], "router.log")

  def start_relay(self, i: int) -> None:
    self.relays[i] = self._spawn(
        ["-m", "launch.weight_relay", f"--config={FLAGS.config}", *self.model,
         f"--learner=127.0.0.1:{self.proxy.port}", f"--engine={FLAGS.engine}",
         f"--server={self.server_url(i)}",
         f"--dir={self.run / f'relay-{i}'}", "--poll_s=0.5"], f"relay-{i}.log")

  def start_worker(self, i: int) -> None:
    self.workers[i] = self._spawn(
        ["-m", "launch.worker", *self.common, f"--learner=127.0.0.1:{self.proxy.port}",
         f"--worker_index={i}", f"--num_workers={FLAGS.workers}",
         f"--config.rollout.engine={FLAGS.engine}",
         # vLLM: no router in front (module docstring); worker i uses server i mod 2
         f"--config.rollout.server_url="
         f"{self.server_url(i % 2) if self.vllm else f'http://127.0.0.1:{self.router_port}'}",
         "--config.rollout.server_timeout_s=60",
         f"--ack_ledger={self.run / 'ledger' / f'worker-{i}.txt'}"], f"worker-{i}.log")

  def server_version(self, i: int):
    """What server i says it holds (None: "default", or it does not answer)."""
    route = "/weight_info" if self.vllm else "/model_info"
    req = urllib.request.Request(self.server_url(i) + route,
                                 headers={"Authorization": f"Bearer {self.key}"})
    try:
      with urllib.request.urlopen(req, timeout=2) as r:
        v = json.loads(r.read()).get("weight_version")
      return int(v)
    except (OSError, ValueError):
      return None

  def restart_dead(self) -> None:
    """Restarts whatever ended on its own (the launcher's job), counting it."""
    for kind, procs, start in (("server", self.servers, self.start_server),
                               ("relay", self.relays, self.start_relay),
                               ("worker", self.workers, self.start_worker)):
      for i, p in list(procs.items()):
        if p.poll() is not None:
          self.exits[kind] += 1
          note(f"{kind} {i} exited with {p.returncode}; restarting")
          start(i)
    if any(p.poll() is not None for p in self.learners):
      self.exits["learner"] += 1
      note("a learner process exited on its own; restarting both")
      self.kill_learner()


def main(argv):
  del argv
  t_start = time.time()
  if FLAGS.converge_bound_s is None:
    FLAGS.converge_bound_s = 150.0 if FLAGS.engine == "vllm" else 90.0
  run = single.fresh_run_dir("fr_jax_chaos_fleet_")
  fleet = Fleet(run)
  rng = random.Random(FLAGS.seed)
  faults = collections.Counter()
  note(f"run_dir {run}; learner :{fleet.learner_port} via proxy :{fleet.proxy.port}, "
       f"servers {fleet.server_ports}, router :{fleet.router_port}")
  fleet.start_learner()
  for i in range(2):
    fleet.start_server(i)
  if not fleet.vllm:
    fleet.start_router()
  t_limit = time.monotonic() + 600
  while not fleet.serving():
    if any(p.poll() is not None for p in fleet.learners) or time.monotonic() > t_limit:
      sys.exit(f"the learner did not start; see {run}/logs")
    time.sleep(0.2)
  for i in range(2):
    fleet.start_relay(i)
  for i in range(FLAGS.workers):
    fleet.start_worker(i)
  poisoner = single.Poisoner(fleet)
  while not fleet.update_rows():
    fleet.restart_dead()
    if time.monotonic() > t_limit:
      sys.exit(f"no first update; see {run}/logs")
    time.sleep(0.5)
  note("first update done; injecting faults")
  plan = [("learner_kill", FLAGS.learner_kills), ("server_restart", FLAGS.server_restarts),
          ("relay_kill", FLAGS.relay_kills), ("worker_fault", FLAGS.worker_faults),
          ("refusal", 0 if fleet.vllm else FLAGS.refusal_windows),
          ("poison", FLAGS.poison_rounds)]
  events = []
  for kind, n in plan:
    gap = FLAGS.duration_s / max(n, 1)
    events += [(gap * (k + rng.uniform(0.1, 0.9)), kind) for k in range(n)]
  events.sort()
  t0 = time.monotonic()
  checks = []  # (kind, time of the fault, update rows before it)
  convergence, server_convergence, diverged = [], [], []

  def updated_since(t_wall):
    return any(r["time"] > t_wall for r in fleet.update_rows())

  def await_convergence(t_kill):
    """After a learner restart: the time until both servers hold a version the learner has
    (between the restored one and its current), or None past the bound."""
    t_limit = time.monotonic() + FLAGS.converge_bound_s + 600  # the restart itself first
    while not fleet.serving() and time.monotonic() < t_limit:
      fleet.restart_dead()
      time.sleep(0.2)
    hb = poisoner.stats(timeout=120)
    restored = hb["version"] if hb else 0
    t_serving = time.time()
    while time.time() - t_serving < FLAGS.converge_bound_s:
      hb = poisoner.stats(timeout=10)
      now = hb["version"] if hb else restored
      held = [fleet.server_version(i) for i in range(2)]
      if all(v is not None and restored <= v <= now for v in held):
        return time.time() - t_serving, restored, held
      fleet.restart_dead()
      time.sleep(0.5)
    return None, restored, [fleet.server_version(i) for i in range(2)]

  for at, kind in events:
    while time.monotonic() < t0 + at:
      fleet.restart_dead()
      time.sleep(0.1)
    t_fault = time.time()
    if kind == "learner_kill":
      fleet.kill_learner()
      took, restored, held = await_convergence(t_fault)
      (convergence if took is not None else diverged).append(
          round(took, 1) if took is not None else dict(restored=restored, held=held))
    elif kind == "server_restart":
      i = rng.randrange(2)
      fleet.kill_server(i)
      time.sleep(rng.uniform(1.0, 3.0))
      hb = poisoner.stats(timeout=30)
      floor = hb["version"] if hb else 0  # what the learner had when the server came back
      fleet.start_server(i)
      t_up = time.time()
      while time.time() - t_up < FLAGS.converge_bound_s:  # back on the learner's weights
        v = fleet.server_version(i)
        hb = poisoner.stats(timeout=10)
        if v is not None and floor <= v <= (hb["version"] if hb else v):
          server_convergence.append(round(time.time() - t_up, 1))
          break
        fleet.restart_dead()
        time.sleep(0.5)
      else:
        diverged.append(dict(server=i, floor=floor, held=fleet.server_version(i)))
    elif kind == "relay_kill":
      i = rng.randrange(2)
      t_wait = time.monotonic() + 5  # catch it mid-write if a write comes soon
      d = run / f"relay-{i}"
      while time.monotonic() < t_wait and not any(
          p.name.startswith(".v") for p in (d.iterdir() if d.exists() else [])):
        time.sleep(0.01)
      fleet.relays[i].send_signal(signal.SIGKILL)
      fleet.relays[i].wait()
      fleet.start_relay(i)
    elif kind == "worker_fault":
      if rng.random() < FLAGS.worker_kill_fraction:
        i = rng.randrange(FLAGS.workers)
        fleet.workers[i].send_signal(signal.SIGKILL)
        fleet.workers[i].wait()
        fleet.start_worker(i)
        kind = "worker_kill"
      else:
        fleet.proxy.cut()
        kind = "connection_cut"
    elif kind == "refusal":
      flag = run / "faults" / f"refuse-{rng.randrange(2)}"
      flag.touch()
      time.sleep(3.0)
      flag.unlink()
    elif kind == "poison":
      poisoner.round()
      from fr_jax.learner.synthetic import synthetic_trajectory
      hb = poisoner.stats() or {"version": 0}
      t = synthetic_trajectory(poisoner.seq, seed=78, vocab_size=300,
                               version=max(hb["version"], 0))
      t.routed_experts = np.zeros((t.length - 1, 3, 7), np.int8)  # not this model's shape
      t.traj_id, t.prompt_id = f"{poisoner.producer}/{poisoner.seq}", "poison-routing"
      poisoner.kind[t.traj_id] = "routing_on_dense"
      poisoner.seq += 1
      poisoner.client.push(t)
    faults[kind] += 1
    checks.append((kind, t_fault))
    rows = fleet.update_rows()
    note(f"{time.monotonic() - t0:6.1f}s {kind}; {dict(faults)}; version "
         f"{rows[-1]['step'] if rows else 0}")
  # Every fault must be followed by an update within --stall_s (the last ones get that long
  # to show it).
  t_limit = time.monotonic() + FLAGS.stall_s
  while time.monotonic() < t_limit and not all(updated_since(t) for _, t in checks):
    fleet.restart_dead()
    time.sleep(0.5)
  recovery = collections.defaultdict(list)  # fault kind -> seconds to the next update
  stalls = []
  for kind, t in checks:
    after = [r["time"] for r in fleet.update_rows() if r["time"] > t]
    if after:
      recovery[kind].append(min(after) - t)
    if not after or min(after) - t > FLAGS.stall_s:
      stalls.append(kind)
  note("faults done; stopping the workers, relays and servers, then the learner")
  if not poisoner.close():
    note(f"poison records still unanswered: {poisoner.client.unacknowledged}")
  alive_at_end = {f"worker-{i}": p.poll() is None for i, p in fleet.workers.items()}
  for p in [*fleet.workers.values(), *fleet.relays.values()]:
    p.send_signal(signal.SIGTERM)
  for p in [*fleet.workers.values(), *fleet.relays.values()]:
    try:
      p.wait(timeout=10)
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()
  fleet.learners[0].send_signal(signal.SIGTERM)
  codes = [p.wait(timeout=180) for p in fleet.learners]
  for i in fleet.servers:
    fleet.kill_server(i)
  if fleet.router is not None:
    fleet.router.kill()
    fleet.router.wait()
  fleet.proxy.close()
  result = single.audit(fleet)
  relay_failures = collections.Counter()
  for i in range(2):
    for line in (run / "logs" / f"relay-{i}.log").read_text().splitlines():
      if line.startswith("{") and '"failures"' in line:
        relay_failures.update(json.loads(line)["failures"])
  result.update(
      chaos="fleet fault injection", engine=FLAGS.engine,
      servers="2 vLLM 0.32 (real), direct URLs" if fleet.vllm else
      "2 SGLang stand-ins behind sglang-router",
      refusal_windows="n/a (vllm)" if fleet.vllm else FLAGS.refusal_windows,
      workers=FLAGS.workers, duration_s=FLAGS.duration_s,
      faults=dict(faults), stalls=len(stalls), stalled_after=stalls,
      next_update_after_fault_s={k: single._stats(v) for k, v in sorted(recovery.items())},
      convergence_s=single._stats(convergence),
      server_convergence_s=single._stats(server_convergence), diverged=diverged,
      converge_bound_s=FLAGS.converge_bound_s, unexpected_exits=dict(fleet.exits),
      workers_alive_at_end=all(alive_at_end.values()), learner_exit=codes,
      learner_starts=fleet.learner_starts, relay_failures=dict(relay_failures),
      poison_answers=dict(poisoner.answers), wall_s=round(time.time() - t_start, 1),
      run_dir=str(run), machine=machine())
  print(json.dumps(result), flush=True)
  if not FLAGS.keep:
    shutil.rmtree(run, ignore_errors=True)
  ok = (result["lost"] == 0 and result["duplicated"] == 0 and result["repeated_updates"] == 0
        and result["updates_contiguous"] and not stalls and not diverged)
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  app.run(main)
