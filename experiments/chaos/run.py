r"""The fault-injection run: exactly once, shown under crashes, cuts, full disks and poison.

  make chaos                                        # 10 minutes, the acceptance run
  python -m experiments.chaos.run --duration_s=20 --workers=2 --learner_kills=2 \
      --worker_faults=3 --enospc_windows=1 --enospc_s=4 --poison_rounds=1  # `make test`'s

A learner (`launch.learner`) and `--workers` rollout workers (`launch.worker`) run as separate
processes on loopback gRPC with the tiny model and the default asynchronous checkpointing
(`checkpoint.async_save=True`, a save every 2 updates). Workers reach the learner through a
TCP proxy that can cut every connection. Over `--duration_s` the run injects, at seeded random
times:
* learner SIGKILLs, half of them the moment an update's metrics row appears (its checkpoint
  save still in flight), half at random; the learner is restarted with the same command;
* worker faults: a SIGKILL and restart of a random worker, or a cut of every connection;
* full-disk windows: for `--enospc_s` (2 s), and then until at least one append has been
  refused (60 s more at most), every admission-log append writes half a frame and fails with
  ENOSPC (the `admission_log_enospc` point of `fr_jax.faults`);
* poison rounds: four records from a hostile client, three the validator must refuse (a
  reward beyond float32, a token past the vocabulary, a behaviour log-prob of -1e30) and one
  it admits (reward 3e38) whose update is non-finite and must be quarantined.

Every worker keeps a ledger of the acknowledgements it saw (`launch.worker --ack_ledger`,
written as each arrives, so it survives SIGKILL). At the end the learner is stopped cleanly
and each acknowledged record must be in exactly one of: an update row of metrics.jsonl (used),
the admission log (still queued), dead_letter.jsonl (with its reason). No update number may
repeat. A last restart of the learner replays the log and must queue exactly the records the
ledger counts as queued. Prints one JSON line; exits 1 if anything was lost or duplicated.
Progress goes to stderr.
"""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from absl import app, flags

from experiments.benchmarks.common import machine
from experiments.chaos.proxy import CuttingProxy

flags.DEFINE_float("duration_s", 600.0, "how long faults are injected")
flags.DEFINE_integer("workers", 4, "rollout worker processes")
flags.DEFINE_integer("learner_kills", 24, "learner SIGKILLs")
flags.DEFINE_integer("worker_faults", 60, "worker SIGKILLs plus connection cuts")
flags.DEFINE_float("worker_kill_fraction", 0.4, "share of worker faults that are SIGKILLs")
flags.DEFINE_integer("enospc_windows", 10, "full-disk windows on the admission log")
flags.DEFINE_float("enospc_s", 2.0, "how long each full-disk window lasts at least (it stays "
                   "open until an append has been refused, at most 60 s more)")
flags.DEFINE_integer("poison_rounds", 20, "rounds of four poison records")
flags.DEFINE_integer("seed", 0, "fault schedule seed")
flags.DEFINE_string("config", "experiments/configs/tiny_test.py", "experiment config")
flags.DEFINE_string("run_dir", "", "where the run writes (default: a fresh temporary dir)")
flags.DEFINE_bool("keep", True, "keep run_dir afterwards")
FLAGS = flags.FLAGS
ENOSPC_BOUND_S = 60.0  # how much longer than --enospc_s a full-disk window may wait for an append

def note(msg: str) -> None:
  print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Cluster:
  """The processes, the proxy, and what the run observed of them."""

  def __init__(self, run: Path):
    self.run = run
    self.faults_dir = run / "faults"
    self.faults_dir.mkdir(parents=True, exist_ok=True)
    (run / "ledger").mkdir(exist_ok=True)
    (run / "logs").mkdir(exist_ok=True)
    self.env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
                    JAX_COMPILATION_CACHE_DIR=str(run / "jax_cache"))
    import socket
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      self.learner_port = s.getsockname()[1]
    self.common = [f"--config={FLAGS.config}", f"--run_dir={run}",
                   "--config.checkpoint.async_save=True", "--config.checkpoint.every=2"]
    self.proxy = CuttingProxy(self.learner_port)
    self.learner = None
    self.learner_starts = 0
    self.workers: dict[int, subprocess.Popen] = {}
    self._ino, self._offset, self._rows, self._partial = None, 0, [], b""

  def _spawn(self, module, args, log_name, extra_env=None):
    log = open(self.run / "logs" / log_name, "a")
    return subprocess.Popen([sys.executable, "-m", module, *self.common, *args],
                            stdout=log, stderr=log, env=dict(self.env, **(extra_env or {})))

  def start_learner(self, *extra) -> subprocess.Popen:
    pf = self.run / "port"
    pf.unlink(missing_ok=True)
    self.learner_starts += 1
    self.learner = self._spawn(
        "launch.learner", [f"--address=127.0.0.1:{self.learner_port}", f"--port_file={pf}",
                           "--config.max_updates=100000000", "--linger_s=0", *extra],
        f"learner-{self.learner_starts}.log", {"FR_JAX_FAULT_DIR": str(self.faults_dir)})
    return self.learner

  def serving(self) -> bool:
    return (self.run / "port").exists()

  def start_worker(self, i: int) -> None:
    self.workers[i] = self._spawn(
        "launch.worker", [f"--learner=127.0.0.1:{self.proxy.port}", f"--worker_index={i}",
                          f"--num_workers={FLAGS.workers}",
                          f"--ack_ledger={self.run / 'ledger' / f'worker-{i}.txt'}"],
        f"worker-{i}.log")

  def update_rows(self) -> list[dict]:
    """metrics.jsonl's update rows, read incrementally (from the start again when a
    restarted learner has rewritten the file)."""
    p = self.run / "metrics.jsonl"
    try:
      st = p.stat()
    except FileNotFoundError:
      return self._rows
    if st.st_ino != self._ino or st.st_size < self._offset:
      self._ino, self._offset, self._rows, self._partial = st.st_ino, 0, [], b""
    if st.st_size > self._offset:
      with open(p, "rb") as f:
        f.seek(self._offset)
        data = self._partial + f.read()
      self._offset = st.st_size
      *lines, self._partial = data.split(b"\n")
      for line in lines:
        try:
          r = json.loads(line)
        except json.JSONDecodeError:
          continue
        if "loss" in r:
          self._rows.append(r)
    return self._rows


class Poisoner:
  """A hostile client: invalid records and one valid record that overflows the update."""

  def __init__(self, cluster: Cluster):
    from fr_jax.transport.client import GrpcClient
    self.ledger = open(cluster.run / "ledger" / "poison.txt", "a", buffering=1)
    self.client = GrpcClient(f"127.0.0.1:{cluster.proxy.port}", worker_id="poisoner",
                             backoff_min=0.2, on_ack=self._ack)
    self.producer = f"poisoner/{uuid.uuid4().hex[:8]}"
    self.seq = 0
    self.kind: dict[str, str] = {}
    self.answers = collections.Counter()

  def _ack(self, traj_id, admitted, reason):
    answer = "admitted" if admitted else reason
    self.ledger.write(f"{traj_id} {answer}\n")
    self.answers[f"{self.kind.get(traj_id, '?')}:{answer}"] += 1

  def stats(self, timeout: float = 15.0):
    """The learner's heartbeat (with its system metrics), retried through restarts."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
      hb = self.client.heartbeat(dict(engine_version=0, trajectories=0, tokens=0,
                                      uptime_s=0.0, inflight=0), timeout=2.0)
      if hb is not None:
        return dict(hb, **json.loads(hb["stats_json"]))
      time.sleep(0.2)
    return None

  def round(self) -> bool:
    from fr_jax.learner.synthetic import synthetic_trajectory
    hb = self.stats()
    if hb is None:
      return False
    kinds = {"huge_reward": dict(reward=1e39), "oov_token": {}, "logp_floor": {},
             "overflow": dict(reward=3e38)}
    for kind, over in kinds.items():
      t = synthetic_trajectory(self.seq, seed=77, vocab_size=300, version=max(hb["version"], 0))
      for k, v in over.items():
        setattr(t, k, v)
      if kind == "oov_token":
        t.completion_tokens[0] = 100_000
      if kind == "logp_floor":
        t.behavior_logp[int(t.action_mask.argmax())] = -1e30
      t.traj_id = f"{self.producer}/{self.seq}"
      t.prompt_id = f"poison-{kind}"
      self.kind[t.traj_id] = kind
      self.seq += 1
      self.client.push(t)
    return True

  def close(self, timeout: float = 60.0) -> bool:
    """Waits (with the learner up) until every poison record is answered; False if not."""
    answered = self.client.flush(timeout)
    self.client.close()
    self.ledger.close()
    return answered


def schedule(rng: random.Random, duration: float) -> list[tuple[float, str]]:
  """(time, kind) for every fault, spread evenly with jitter after a warm-up."""
  warm = min(15.0, duration * 0.15)
  events = []
  plan = [("learner_kill", FLAGS.learner_kills), ("worker_fault", FLAGS.worker_faults),
          ("enospc", FLAGS.enospc_windows), ("poison", FLAGS.poison_rounds)]
  for kind, n in plan:
    gap = (duration - warm) / max(n, 1)
    for k in range(n):
      events.append((warm + gap * (k + rng.uniform(0.1, 0.9)), kind))
  return sorted(events)


def read_ledger(run: Path) -> dict[str, str]:
  """traj_id -> the answer its sender saw (admitted, duplicate or a rejection reason)."""
  out = {}
  for f in sorted((run / "ledger").glob("*.txt")):
    for line in f.read_text().splitlines():
      parts = line.split(" ")
      if len(parts) == 2:
        out[parts[0]] = parts[1]
  return out


def audit(cluster: Cluster) -> dict:
  """The ledger against what the learner holds: used, queued (logged, neither used nor dead),
  dead-lettered."""
  from fr_jax.learner.admission import AdmissionLog, DeadLetters
  from fr_jax.transport import codec
  run = cluster.run
  answers = read_ledger(run)
  acked = {i for i, a in answers.items() if a in ("admitted", "duplicate")}
  from fr_jax.learner.metrics import read_jsonl
  rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
  steps = [r["step"] for r in rows]
  used = collections.Counter(i for r in rows for i in r["traj_ids"])
  dead_rows = DeadLetters(str(run / "dead_letter.jsonl")).rows()
  dead = collections.Counter(r["traj_id"] for r in dead_rows)
  raws, torn, _ = AdmissionLog.read(run / "admission.log")
  logged = {codec.decode_record(r).traj_id for r in raws}
  queued = logged - set(used) - set(dead)
  places = {i: used[i] + dead[i] + (i in queued) for i in acked}
  lost = sorted(i for i, n in places.items() if n == 0)
  twice = sorted(i for i in set(used) | set(dead) if used[i] + dead[i] > 1)
  return dict(
      acknowledged=len(acked), used=sum(1 for i in acked if used[i]),
      queued=sum(1 for i in acked if i in queued),
      dead_lettered=sum(1 for i in acked if dead[i]),
      dead_lettered_by_reason=dict(collections.Counter(
          r["reason"] for r in dead_rows if r["traj_id"] in acked)),
      lost=len(lost), duplicated=len(twice), lost_ids=lost[:10], duplicated_ids=twice[:10],
      updates=max(steps, default=0), repeated_updates=len(steps) - len(set(steps)),
      updates_contiguous=steps == list(range(1, len(steps) + 1)),
      answers_by_reason=dict(collections.Counter(answers.values())),
      queued_total=len(queued), log_torn_frames_at_end=torn)


def _stats(xs):
  return dict(n=len(xs), median=round(statistics.median(xs), 2) if xs else None,
              max=round(max(xs), 2) if xs else None)


def fresh_run_dir(prefix: str) -> Path:
  """--run_dir, or a new temporary folder; exits if it already holds something."""
  run = Path(FLAGS.run_dir or tempfile.mkdtemp(prefix=prefix)).absolute()
  if run.exists() and any(run.iterdir()):
    sys.exit(f"run_dir {run} is not empty; give a fresh one")
  return run


def main(argv):
  del argv
  t_start = time.time()
  run = fresh_run_dir("fr_jax_chaos_")
  cluster = Cluster(run)
  rng = random.Random(FLAGS.seed)
  faults = collections.Counter()
  recover_serving, recover_update, enospc_failures = [], [], []
  note(f"run_dir {run}; learner on :{cluster.learner_port}, proxy on :{cluster.proxy.port}")
  cluster.start_learner()
  t_end_start = time.monotonic() + 180
  while not cluster.serving():
    if cluster.learner.poll() is not None or time.monotonic() > t_end_start:
      sys.exit(f"learner did not start; see {run}/logs")
    time.sleep(0.1)
  for i in range(FLAGS.workers):
    cluster.start_worker(i)
  poisoner = Poisoner(cluster)
  while not cluster.update_rows():
    if cluster.learner.poll() is not None or time.monotonic() > t_end_start:
      sys.exit(f"no first update; see {run}/logs")
    time.sleep(0.2)
  note("first update done; injecting faults")
  t0 = time.monotonic()
  events = schedule(rng, FLAGS.duration_s)
  pending_recovery = None  # (kill time, started) while a killed learner has not updated yet
  unexpected_exits = 0

  def check_recovery():
    nonlocal pending_recovery
    if pending_recovery is None:
      return
    t_kill, serving_seen = pending_recovery
    if not serving_seen and cluster.serving():
      recover_serving.append(time.time() - t_kill)
      pending_recovery = (t_kill, True)
    rows = [r for r in cluster.update_rows() if r["time"] > t_kill]
    if rows and pending_recovery[1]:
      recover_update.append(rows[0]["time"] - t_kill)
      pending_recovery = None

  def kill_learner(mode):
    nonlocal pending_recovery
    if mode == "after_update":
      n0, t_wait = len(cluster.update_rows()), time.monotonic() + 20
      while len(cluster.update_rows()) == n0 and time.monotonic() < t_wait:
        time.sleep(0.005)
    cluster.learner.send_signal(signal.SIGKILL)
    cluster.learner.wait()
    t_kill = time.time()
    (run / "port").unlink(missing_ok=True)
    cluster.start_learner()
    pending_recovery = (t_kill, False)
    faults[f"learner_kill_{mode}"] += 1

  for at, kind in events:
    while time.monotonic() < t0 + at:
      check_recovery()
      for i, w in cluster.workers.items():
        if w.poll() is not None:  # a worker that exited on its own: note it, restart it
          unexpected_exits += 1
          note(f"worker {i} exited with {w.returncode}; restarting")
          cluster.start_worker(i)
      if cluster.learner.poll() is not None:
        unexpected_exits += 1
        note(f"learner exited with {cluster.learner.returncode}; restarting")
        cluster.start_learner()
      time.sleep(0.05)
    if kind == "learner_kill":
      t_wait = time.monotonic() + 90  # let the last restart train once before the next kill
      while pending_recovery is not None and time.monotonic() < t_wait:
        check_recovery()
        time.sleep(0.05)
      kill_learner("after_update" if faults["learner_kill_after_update"] <=
                   faults["learner_kill_random"] else "random")
    elif kind == "worker_fault":
      if rng.random() < FLAGS.worker_kill_fraction:
        i = rng.randrange(FLAGS.workers)
        cluster.workers[i].send_signal(signal.SIGKILL)
        cluster.workers[i].wait()
        cluster.start_worker(i)
        faults["worker_kill"] += 1
      else:
        cluster.proxy.cut()
        faults["connection_cut"] += 1
    elif kind == "enospc":
      # The disk stays full for --enospc_s and then until an append has been refused (no
      # append may fall in a short window while the learner restarts), within a bound.
      flag = cluster.faults_dir / "admission_log_enospc"
      def failures():
        return (poisoner.stats() or {}).get("log_write_failures", 0)

      base, refused = failures(), 0
      flag.touch()
      t_full = time.monotonic()
      while True:
        time.sleep(0.2)
        n = failures()
        if n < base:  # the learner restarted: its counter starts again at 0
          base = n
        refused = max(refused, n - base)
        if (time.monotonic() - t_full >= FLAGS.enospc_s and refused) or \
           time.monotonic() - t_full >= FLAGS.enospc_s + ENOSPC_BOUND_S:
          break
      flag.unlink()
      faults["enospc_window"] += 1
      enospc_failures.append(refused)
    elif kind == "poison":
      faults["poison_round"] += poisoner.round()
    note(f"{time.monotonic() - t0:6.1f}s {kind}; {dict(faults)}; version "
         f"{(cluster.update_rows() or [{'step': 0}])[-1]['step']}")
  t_wait = time.monotonic() + 90
  while pending_recovery is not None and time.monotonic() < t_wait:
    check_recovery()
    time.sleep(0.05)
  note("faults done; stopping the workers, then the learner, cleanly")
  if not poisoner.close():
    note(f"poison records still unanswered after 60 s: {poisoner.client.unacknowledged}")
  for w in cluster.workers.values():
    w.send_signal(signal.SIGTERM)  # each flushes what it holds, then exits
  t_kill = time.monotonic() + 5  # one still starting up is killed: its ledger is on disk
  for w in cluster.workers.values():
    try:
      w.wait(timeout=max(0.1, t_kill - time.monotonic()))
    except subprocess.TimeoutExpired:
      w.kill()
      w.wait()
  cluster.learner.send_signal(signal.SIGTERM)
  out = cluster.learner.wait(timeout=120)
  cluster.proxy.close()
  last_log = (run / "logs" / f"learner-{cluster.learner_starts}.log").read_text()
  last = json.loads([ln for ln in last_log.splitlines() if ln.startswith("{")][-1])
  result = audit(cluster)
  overflow = [i for i, k in poisoner.kind.items() if k == "overflow"]
  result["overflow_poison_used"] = sum(
      i in {t for r in cluster.update_rows() for t in r["traj_ids"]} for i in overflow)
  # The real restart path must owe exactly what the ledger says is still queued.
  note("auditing; restarting the learner once more to replay its log")
  verify = subprocess.run(
      [sys.executable, "-m", "launch.learner", *cluster.common, "--config.max_updates=1",
       "--linger_s=0", f"--address=127.0.0.1:{cluster.learner_port}"],
      capture_output=True, text=True, env=cluster.env, timeout=300)
  final = json.loads(verify.stdout.strip().splitlines()[-1]) if verify.returncode == 0 else {}
  result.update(
      chaos="fault injection", workers=FLAGS.workers, duration_s=FLAGS.duration_s,
      faults=dict(faults), unexpected_exits=unexpected_exits, learner_exit=out,
      recovery_to_serving_s=_stats(recover_serving),
      recovery_to_next_update_s=_stats(recover_update),
      replayed_by_restart=final.get("replayed"),
      replay_matches_ledger=final.get("replayed") == result["queued_total"],
      enospc_appends_refused=enospc_failures,
      last_learner={k: last.get(k) for k in (
          "version", "rejected_by_reason", "dead_lettered_by_reason", "log_write_failures",
          "log_torn_frames", "replayed", "producers")},
      poison_answers=dict(poisoner.answers), wall_s=round(time.time() - t_start, 1),
      run_dir=str(run), machine=machine())
  print(json.dumps(result), flush=True)
  if not FLAGS.keep:
    shutil.rmtree(run, ignore_errors=True)
  ok = (result["lost"] == 0 and result["duplicated"] == 0 and result["repeated_updates"] == 0
        and result["updates_contiguous"] and result["replay_matches_ledger"])
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  app.run(main)
