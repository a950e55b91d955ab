"""The asynchronous system as separate processes on loopback gRPC, with the tiny model:
a worker SIGKILLed and restarted, the learner SIGKILLed and restarted from its checkpoint,
a malformed trajectory on the wire, strict on-policy updates at lag bound 0, and 16 flooding
workers against a bounded queue (peak RSS)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from fr_jax.learner.metrics import read_jsonl
from fr_jax.learner.synthetic import synthetic_trajectory
from fr_jax.transport import codec
from fr_jax.transport.client import GrpcClient
from tests import XLA_TEST_FLAGS
from tests.helpers import wait_for

CONFIG = "--config=experiments/configs/tiny_test.py"
ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=XLA_TEST_FLAGS)  # one device per process


def spawn(module, *args, log_path):
  return subprocess.Popen([sys.executable, "-m", module, CONFIG, *args],
                          stdout=subprocess.PIPE, stderr=open(log_path, "a"), text=True,
                          env=ENV)


def update_rows(run_dir):
  p = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(p):
    return []
  try:
    return [r for r in read_jsonl(p) if "loss" in r]
  except json.JSONDecodeError:  # a line being written
    return []


def version(run_dir):
  rows = update_rows(run_dir)
  return rows[-1]["step"] if rows else 0


def start_learner(run_dir, port, *extra):
  pf = os.path.join(run_dir, "port")
  if os.path.exists(pf):
    os.remove(pf)
  p = spawn("launch.learner", f"--run_dir={run_dir}", f"--port_file={pf}",
            f"--address=127.0.0.1:{port}", *extra, log_path=os.path.join(run_dir, "learner.log"))
  wait_for(lambda: os.path.exists(pf), 120, "learner start", [p])
  return p, int(open(pf).read())


def start_worker(run_dir, port, i, *extra):
  return spawn("launch.worker", f"--run_dir={run_dir}", f"--learner=127.0.0.1:{port}",
               f"--worker_index={i}", "--num_workers=2", *extra,
               log_path=os.path.join(run_dir, f"worker-{i}.log"))


def finish(learner, workers, timeout=240):
  """The learner's summary and each worker's final JSON line (None if it printed none)."""
  out, _ = learner.communicate(timeout=timeout)
  reports = []
  for w in workers:
    try:
      wout, _ = w.communicate(timeout=30)
    except subprocess.TimeoutExpired:
      w.kill()
      wout, _ = w.communicate()
    lines = (wout or "").strip().splitlines()
    reports.append(json.loads(lines[-1]) if lines else None)
  assert learner.returncode == 0
  return json.loads(out.strip().splitlines()[-1]), reports


def free_port():
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# test_chaos (in make test) runs the same launchers through learner and worker SIGKILLs,
# malformed records and the exactly-once ledger; this older, narrower run is kept for test-all.
@pytest.mark.slow
def test_worker_and_learner_crashes_lose_nothing_and_repeat_nothing(tmp_path):
  run = str(tmp_path)
  N = 8
  learner, port = start_learner(run, free_port(), f"--config.max_updates={N}")
  workers = [start_worker(run, port, i) for i in range(2)]
  try:
    wait_for(lambda: version(run) >= 2, 180, "two updates", [learner])
    # A malformed record on the wire: rejected with its reason, the learner goes on.
    bad = codec.trajectory_to_proto(synthetic_trajectory(0, vocab_size=259))
    bad.traj_id = "malformed"
    bad.completion_tokens.data = bad.completion_tokens.data[:-3]
    probe = GrpcClient(f"127.0.0.1:{port}", worker_id="probe")
    probe.push(bad)
    assert probe.flush(30) and probe.acks["decode"] == 1
    probe.close()
    # SIGKILL worker 0 mid-run: training continues on worker 1 alone.
    workers[0].send_signal(signal.SIGKILL)
    workers[0].wait()
    v = version(run)
    wait_for(lambda: version(run) >= v + 2, 120, "updates without worker 0", [learner])
    workers[0] = start_worker(run, port, 0)  # rejoins
    # SIGKILL the learner mid-run, restart it on the same port from its checkpoint.
    wait_for(lambda: version(run) >= 5, 180, "five updates", [learner])
    learner.send_signal(signal.SIGKILL)
    learner.wait()
    killed_at = version(run)
    learner, _ = start_learner(run, port, f"--config.max_updates={N}")
    summary, reports = finish(learner, workers)
  finally:
    for p in [learner, *workers]:
      if p.poll() is None:
        p.kill()
  rows = update_rows(run)
  steps = [r["step"] for r in rows]
  assert steps == list(range(1, N + 1)), steps  # the count continued; nothing repeated
  ids = [i for r in rows for i in r["traj_ids"]]
  assert len(ids) == len(set(ids)) == N * 4  # no trajectory used twice
  # Nothing admitted was lost: every record the learner acknowledged before its crash was
  # either used by a checkpointed update or queued again from the admission log.
  assert "queued again" in open(os.path.join(run, "learner.log")).read()
  assert "malformed" not in ids and summary["rejected_by_reason"].get("decode", 0) >= 1
  # The restarted worker 0 rejoined: the learner admitted its records, and it (like worker 1)
  # reconnected after the learner restart and exited cleanly at the end of the run.
  assert reports[0] is not None and reports[0]["acks"].get("admitted", 0) >= 1, reports
  assert reports[1] is not None and reports[1]["reconnects"] >= 1, reports
  # The restart resumed from the last checkpoint: killed_at, or one before if the kill came
  # between an update's metrics row and its checkpoint (that row was dropped and redone).
  assert N - killed_at <= summary["updates"] <= N - killed_at + 1
  assert summary["version"] == N


def test_lag_bound_zero_is_strictly_on_policy(tmp_path):
  run = str(tmp_path)
  learner, port = start_learner(run, free_port(), "--config.max_updates=4",
                                "--config.max_policy_lag=0")
  workers = [start_worker(run, port, i, "--config.max_policy_lag=0") for i in range(2)]
  try:
    summary, _ = finish(learner, workers)
  finally:
    for p in [learner, *workers]:
      if p.poll() is None:
        p.kill()
  rows = update_rows(run)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert all(r["policy_lag_max"] == 0 for r in rows)
  assert summary["max_lag"] == 0 and summary["lag_histogram"] == {"0": 16}


def test_sixteen_flooding_workers_keep_memory_bounded(tmp_path):
  """16 simulated workers push 1k-token records as fast as they can at a learner whose queue
  holds 8. The queue never exceeds its capacity, and once the learner has compiled its step
  its RSS stays flat however much the flooders offer."""
  run = str(tmp_path)
  learner, port = start_learner(
      run, free_port(), "--config.max_updates=1000000", "--config.service.queue_capacity=8",
      "--config.packing.row_len=1024", "--config.agent.max_total_tokens=1024",
      "--config.packing.row_buckets=(1,2,4)", "--config.checkpoint.every=1000")
  proc = psutil.Process(learner.pid)
  clients = [GrpcClient(f"127.0.0.1:{port}", worker_id=f"flood-{k}", outbox_size=4)
             for k in range(16)]
  stop = threading.Event()
  sent = [0] * 16

  def flood(k):
    i = 0
    while not stop.is_set():
      t = synthetic_trajectory(i, seed=100 + k, vocab_size=259, fixed_completion=990,
                               prompt_len=(16, 32), max_len=1024)
      t.traj_id = f"f{k}-{i}"
      clients[k].push(t)
      sent[k] += 1
      i += 1

  rss_idle = proc.memory_info().rss
  threads = [threading.Thread(target=flood, args=(k,), daemon=True) for k in range(16)]
  for t in threads:
    t.start()
  wait_for(lambda: version(run) >= 2, 120, "the first updates (compiled)", [learner])
  sent0 = sum(sent)
  samples, depth, t0 = [], 0, time.monotonic()
  while time.monotonic() < t0 + 24:
    samples.append((time.monotonic() - t0, proc.memory_info().rss))
    hb = clients[0].heartbeat(dict(engine_version=0, trajectories=0, tokens=0, uptime_s=0,
                                   inflight=0))
    if hb:
      depth = max(depth, hb["queue_depth"])
    time.sleep(0.05)
  stop.set()
  v_end = version(run)
  admitted = sum(c.acks["admitted"] for c in clients)
  learner.send_signal(signal.SIGTERM)
  for c in clients:
    c.close()
  learner.communicate(timeout=60)
  first = max(r for t, r in samples if t < 8)
  last = max(r for t, r in samples if t >= 8)
  mb = lambda b: round(b / 2**20, 1)  # noqa: E731
  print(json.dumps(dict(load_test="16 flooding workers", queue_capacity=8,
                        max_queue_depth=depth, admitted=admitted, updates=v_end,
                        offered_while_measured=sum(sent) - sent0,
                        record_mb=round(1014 * 17 / 2**20, 3),
                        learner_rss_idle_mb=mb(rss_idle), learner_rss_peak_first_8s_mb=mb(first),
                        learner_rss_peak_last_16s_mb=mb(last),
                        learner_rss_peak_mb=mb(max(first, last)))))
  assert depth <= 8
  assert admitted >= 8  # the flood got through to a full queue, and was held there
  # The step's own buffers make RSS swing by a few hundred MB; what must not happen is a
  # trend: an unbounded queue would keep growing by offered * record_mb.
  assert last - first < 64 * 2**20


def test_ctrl_c_then_the_same_command_resumes(tmp_path):
  """launch.train: SIGINT stops after the current update with a checkpoint; rerunning the same
  command continues from it to max_updates, without repeating an update."""
  run, N = str(tmp_path), 8
  # held-out evaluations: all 6 tasks at the start and end, the first 3 every 3 updates
  cmd = [sys.executable, "-m", "launch.train", CONFIG, f"--run_dir={run}",
         f"--config.max_updates={N}", "--config.eval.n=6", "--config.eval.every=3",
         "--config.eval.every_n=3"]
  p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
  wait_for(lambda: version(run) >= 2, 180, "two updates", [p])
  p.send_signal(signal.SIGINT)
  out, err = p.communicate(timeout=120)
  assert p.returncode == 0 and "interrupted at version" in err, err[-2000:]
  stopped = json.loads(out.strip().splitlines()[-1])["version"]
  assert 2 <= stopped < N
  out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  s = json.loads(out.stdout.strip().splitlines()[-1])
  assert s["version"] == N and s["updates"] == N - stopped
  # where this invocation's time went: the stages add up to no more than its wall time
  t = s["stage_seconds"]
  assert {"load", "rl"} <= set(t) and min(t.values()) >= 0, t
  assert sum(t.values()) <= s["wall_s"] + 0.5 and "time per stage: load" in out.stderr
  assert [r["step"] for r in update_rows(run)] == list(range(1, N + 1))
  evals = [json.loads(line) for line in open(os.path.join(run, "evals.jsonl"))]
  assert [(r["version"], r["n"]) for r in evals] == [(0, 6), (3, 3), (6, 3), (N, 6)]
  assert "held_out=" in out.stderr  # the progress line shows the last held-out figure


def test_bad_config_fails_fast_with_one_line(tmp_path):
  for args, needle in [(["--config.objective.trust=bad"], "objective.trust"),
                       (["--config.model.name=/no/such/model"], "/no/such/model"),
                       (["--config.no_such_field=1"], "no_such_field")]:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "launch.train", CONFIG, *args],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 2, out.stderr[-1000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and needle in last, out.stderr[-1000:]
    assert time.monotonic() - t0 < 30


def test_help_shows_no_secret_values():
  """`--help` of every command that takes a credential from the environment names the
  variable, never its value (the defaults used to be the values: `--help` printed them)."""
  secrets = {"FR_JAX_TOKEN": "tok-3f9a1c", "SGLANG_API_KEY": "key-77b2e0",
             "FR_JAX_LEARNER_SECRET": "sec-c41d08", "FR_JAX_GATEWAY_KEY": "gw-5e21aa"}
  procs = {m: subprocess.Popen([sys.executable, "-m", m, "--help"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=dict(ENV, **secrets))
           for m in ("launch.learner", "launch.worker", "launch.weight_relay", "launch.router",
                     "launch.gateway")}
  for m, p in procs.items():
    out = p.communicate(timeout=120)[0]
    assert "usage" in out.lower() or "flags" in out.lower(), (m, out[-500:])
    for value in secrets.values():
      assert value not in out, (m, value)
  for m in ("launch.learner", "launch.worker", "launch.weight_relay"):
    assert "$FR_JAX_TOKEN" in subprocess.run([sys.executable, "-m", m, "--helpfull"],
                                             capture_output=True, text=True, env=ENV,
                                             timeout=120).stdout
