"""Exactly once under faults: every trajectory the learner acknowledges is used by exactly one
update, still queued, or dead-lettered with a reason, whatever crashes, full disks, cut
connections, poison records and hostile clients do. One test per review finding (issue 13);
each failed on the code before the fix.

Disk-full is real: the admission log's descriptor is pointed at /dev/full, whose writes fail
with ENOSPC in the kernel."""

import base64
import collections
import hmac
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from fr_jax import system
from fr_jax.learner.metrics import read_jsonl
from fr_jax.transport import codec
from fr_jax.transport import fr_jax_pb2 as pb
from fr_jax.transport import server as srv
from fr_jax.transport.client import STREAM_UP_S, GrpcClient
from tests import XLA_TEST_FLAGS, tls_certs
from tests.helpers import cfg, synth, wait_for, with_routing

# One device per child process.
ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=XLA_TEST_FLAGS)
STATS = dict(engine_version=0, trajectories=0, tokens=0, uptime_s=0.0, inflight=0)


def raw(t):
  return codec.trajectory_to_proto(t).SerializeToString()


def offer(service, t, **kw):
  return service.offer(t, raw=raw(t), **kw)


def drain(service):
  """Ids of the queued records, in order (empties the queue)."""
  out = []
  while (t := service.queue.pop(0)) is not None:
    out.append(t.traj_id)
  return out


def used_ids(run_dir, upto):
  rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r]
  return [i for r in rows if r["step"] <= upto for i in r["traj_ids"]]


def dead_letters(run_dir):
  p = os.path.join(run_dir, "dead_letter.jsonl")
  return read_jsonl(p) if os.path.exists(p) else []


def close(learner, service):
  service.close()
  learner.close()


# --- 1. an asynchronous checkpoint still being written is not a committed one ---
CRASH_AFTER_UPDATE = r"""
import json, os, signal, sys, threading
from experiments.configs import tiny_test
from fr_jax import system
from fr_jax.learner.synthetic import synthetic_trajectory
from fr_jax.transport import codec
c = tiny_test.get_config()
c.run_dir = sys.argv[1]
c.checkpoint.async_save = True  # the default configuration
c.checkpoint.every = 1
learner, service = system.build_service(c, admission_log=True)
ids = []
for i in range(6):
  t = synthetic_trajectory(i, seed=3, vocab_size=259)
  t.traj_id = f"w/n/{i}"
  ok, why = service.offer(t, raw=codec.trajectory_to_proto(t).SerializeToString())
  assert ok, why
  ids.append(t.traj_id)
service.step(service.next_batch(threading.Event()))
saving = learner.checkpointer.manager.is_saving_in_progress()
print(json.dumps({"ids": ids, "saving": saving}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # right after the update, its save still in flight
"""


def test_sigkill_during_async_save_loses_no_acknowledged_record(tmp_path, tiny_model):
  out = subprocess.run([sys.executable, "-c", CRASH_AFTER_UPDATE, str(tmp_path)], env=ENV,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
  child = json.loads(out.stdout.strip().splitlines()[-1])
  assert child["saving"], "the save finished before the kill: the race was not exercised"
  learner, service = system.build_service(cfg(tmp_path), tiny_model, admission_log=True)
  try:
    v = service.version
    held = used_ids(tmp_path, v) + drain(service)
    assert sorted(held) == sorted(child["ids"]), f"restored at version {v}, holding {held}"
  finally:
    close(learner, service)


# --- 2. a worker's client across stream breaks and learner restarts ---
def test_client_loses_nothing_across_learner_restarts(tiny_model):
  learner, service = system.build_service(cfg(batch_size=2, **{"service.queue_capacity": 64}),
                                          tiny_model)
  server, port = srv.serve(service, "127.0.0.1:0")
  client = GrpcClient(f"127.0.0.1:{port}", worker_id="w", backoff_min=0.05)
  sent, k = [], 0
  try:
    for _ in range(4):
      for _ in range(3):
        t = synth(k)
        client.push(t)
        sent.append(t.traj_id)
        k += 1
      assert client.flush(30)
      srv.stop(server, grace=0)  # the learner goes away mid-stream and comes back
      server, _ = srv.serve(service, f"127.0.0.1:{port}")
      # The client has reconnected before the next records come.
      wait_for(lambda: srv.open_streams(server) == 1, 120, "the client's new stream")  # noqa: B023
    for _ in range(3):
      t = synth(k)
      client.push(t)
      sent.append(t.traj_id)
      k += 1
    assert client.flush(30), "records stayed unacknowledged"
    assert client.acks["admitted"] == len(sent)
    assert drain(service) == sent  # every acknowledged record arrived, in order
  finally:
    client.close()
    srv.stop(server)
    close(learner, service)


# --- 3. a full disk under the admission log ---
def _fd_of(path) -> int:
  for fd in os.listdir("/proc/self/fd"):
    try:
      if os.readlink(f"/proc/self/fd/{fd}") == str(path):
        return int(fd)
    except OSError:
      continue
  raise AssertionError(f"{path} is not open")


def test_disk_full_on_the_admission_log_loses_nothing(tmp_path, tiny_model):
  learner, service = system.build_service(cfg(tmp_path), tiny_model, admission_log=True)
  log_path = tmp_path / "admission.log"
  t = synth(0)
  fd = _fd_of(log_path)
  saved, full = os.dup(fd), os.open("/dev/full", os.O_WRONLY)
  os.dup2(full, fd)  # every write through the log's descriptor now fails with ENOSPC
  try:
    try:
      first = offer(service, t, timeout=1)
    except OSError as e:
      first = ("raised", e.strerror)
  finally:
    try:
      still_full = os.readlink(f"/proc/self/fd/{fd}") == "/dev/full"
    except OSError:  # the log closed that descriptor
      still_full = False
    if still_full:  # the log did not reopen its file: undo
      os.dup2(saved, fd)
    os.close(saved)
    os.close(full)
  second = offer(service, t, timeout=1)  # the worker retries once the disk has room
  close(learner, service)
  assert first == (False, "log_unavailable"), first
  assert second == (True, ""), second  # not "duplicate": the first was never durable
  learner, service = system.build_service(cfg(tmp_path), tiny_model, admission_log=True)
  try:
    assert drain(service) == [t.traj_id]  # logged once, whole
  finally:
    close(learner, service)


# --- 4. compaction racing admissions ---
class _Preempted:
  """A lock whose holder, in one thread, is descheduled right after each release: the
  widest window another thread can get between two critical sections."""

  def __init__(self, lock, thread):
    self._lock, self._thread = lock, thread

  def acquire(self, *a, **kw):
    return self._lock.acquire(*a, **kw)

  def release(self):
    self._lock.release()
    if threading.current_thread() is self._thread:
      time.sleep(0.02)

  __enter__ = acquire

  def __exit__(self, *exc):
    self.release()


def _preempt_locks(obj, thread):
  lock_types = (type(threading.Lock()), type(threading.RLock()))
  for name, value in list(vars(obj).items()):
    if isinstance(value, lock_types):
      setattr(obj, name, _Preempted(value, thread))


def test_records_admitted_while_the_log_compacts_stay_logged(tmp_path, tiny_model):
  over = {"service.queue_capacity": 4096}
  learner, service = system.build_service(cfg(tmp_path, **over), tiny_model,
                                          admission_log=True)
  _preempt_locks(service, threading.current_thread())
  _preempt_locks(service.log, threading.current_thread())
  recs = [synth(i) for i in range(200)]
  raws = [raw(t) for t in recs]
  done = threading.Event()

  def admit():
    for t, r in zip(recs, raws):
      assert service.offer(t, raw=r) == (True, "")
    done.set()

  th = threading.Thread(target=admit)
  try:
    th.start()
    while not done.is_set():
      service.compact_log()  # what each committed checkpoint triggers
    th.join()
  finally:
    close(learner, service)
  learner, service = system.build_service(cfg(tmp_path, **over), tiny_model,
                                          admission_log=True)
  try:
    assert drain(service) == [t.traj_id for t in recs]  # every admitted record, once
  finally:
    close(learner, service)


# --- 5. poison records ---
def test_poison_records_are_refused_with_named_reasons(tiny_model):
  learner, service = system.build_service(cfg(), tiny_model)
  try:
    huge = synth(0)
    huge.reward = 1e39  # finite as float64, inf as float32
    oov = synth(1)
    oov.completion_tokens[0] = tiny_model.config.vocab_size  # one past the vocabulary
    low = synth(2)
    low.behavior_logp[np.argmax(low.action_mask)] = -1e30  # finite, but exp() underflows
    got = [service.offer(t) for t in (huge, oov, low)]
    assert got == [(False, "reward_out_of_range"), (False, "token_out_of_vocab"),
                   (False, "behavior_logp_below_floor")]
    assert len(service.queue) == 0
  finally:
    close(learner, service)


def test_nonfinite_batch_quarantines_the_offender_and_gives_the_rest_back(tmp_path, tiny_model):
  learner, service = system.build_service(cfg(tmp_path), tiny_model, admission_log=True)
  try:
    recs = [synth(i) for i in range(5)]
    recs[2].reward = 3e38  # passes validation (finite in float32), overflows the gradient
    for t in recs:
      assert offer(service, t) == (True, "")
    stop = threading.Event()
    timer = threading.Timer(300, stop.set)  # a guard against a hang, not a time limit: the
    timer.start()  # bisection compiles, and a loaded 2-core machine has taken over 20 s
    try:
      m = service.step(service.next_batch(stop))
      assert not m["finite"] and service.version == 0
      batch = service.next_batch(stop)
      assert batch is not None, "the rest of the poisoned batch was consumed"
      assert [t.traj_id for t in batch] == [recs[i].traj_id for i in (0, 1, 3, 4)]
      m = service.step(batch)
    finally:
      timer.cancel()  # also when an assertion fails: the timer thread would hold the exit
    assert m["finite"] and service.version == 1
    dl = dead_letters(tmp_path)
    assert [(r["traj_id"], r["reason"]) for r in dl] == [(recs[2].traj_id, "nonfinite_update")]
    back = pb.Trajectory.FromString(base64.b64decode(dl[0]["record"]))
    assert back.reward == 3e38  # the offender is kept whole for inspection
  finally:
    close(learner, service)


def _moe_service(run_dir):
  from fr_jax.models import registry
  c = cfg(run_dir, **{"model.name": "tiny-qwen3-moe", "routing_replay": False})
  return system.build_service(c, registry.load("tiny-qwen3-moe"), admission_log=True)


def _routed(i, k=2, experts=8, seed=0):
  t = synth(i)
  t.completion_tokens %= 256  # tiny-qwen3-moe's vocabulary
  t.prompt_tokens %= 256
  return with_routing(t, layers=4, k=k, num_experts=experts, seed=seed)


def test_moe_routing_is_checked_without_replay_and_from_the_log(tmp_path, tiny_model):
  """An MoE learner without routing replay still packs the routing records carry, so
  admission checks it whole: a (layers, k+1) record used to be admitted and then crash every
  update (`pack`: could not broadcast (n,4,3) into (n,4,2)), and be replayed from the log
  after each restart; an expert id >= E used to pack silently. A record a dense learner gets
  with routing is admitted without it."""
  learner, service = _moe_service(tmp_path)
  wide, out_of_range = _routed(1, k=3), _routed(2)
  out_of_range.routed_experts[3, 1, 0] = 8  # expert 8 of 8
  try:
    got = [offer(service, t) for t in (_routed(0), wide, out_of_range, synth(3))]
  finally:
    close(learner, service)
  assert [ok for ok, _ in got] == [True, False, False, True]
  assert [why for _, why in got[1:3]] == ["bad_routing", "bad_routing"]
  # A log an older learner wrote with the bad record in it: the restart refuses it.
  from fr_jax.learner.admission import AdmissionLog
  log, bad = AdmissionLog(tmp_path / "admission.log"), _routed(9, k=3)
  log.append(bad.traj_id, raw(bad))
  log.close()
  learner, service = _moe_service(tmp_path)
  try:
    assert service.replayed == 2 and len(service.queue) == 2
    assert [(r["traj_id"], r["reason"]) for r in dead_letters(tmp_path)] == \
        [("w/n/9", "invalid_record")]
  finally:
    close(learner, service)
  dense, dense_service = system.build_service(cfg(), tiny_model)
  try:
    assert dense_service.offer(with_routing(synth(4), layers=2, k=3)) == (True, "")
    assert dense_service.queue.pop(1.0).routed_experts is None
  finally:
    close(dense, dense_service)


def test_an_update_that_raises_dead_letters_its_batch_and_training_goes_on(tmp_path,
                                                                          tiny_model):
  learner, service = system.build_service(cfg(tmp_path, batch_size=2), tiny_model,
                                          admission_log=True)
  real = learner.update
  calls = {"n": 0}

  def update_once_raising(batch, **kw):  # the fault: an update that raises on one batch
    calls["n"] += 1
    if calls["n"] == 1:
      raise ValueError("could not broadcast input array from shape (6,4,3) into (6,4,2)")
    return real(batch, **kw)

  learner.update = update_once_raising
  try:
    for i in range(4):
      assert offer(service, synth(i)) == (True, "")
    stop = threading.Event()
    m = service.step(service.next_batch(stop))
    assert not m["finite"] and "could not broadcast" in m["update_failed"]
    assert service.version == 0
    assert [(r["traj_id"], r["reason"]) for r in dead_letters(tmp_path)] == \
        [("w/n/0", "update_failed"), ("w/n/1", "update_failed")]
    assert "could not broadcast" in dead_letters(tmp_path)[0]["detail"]
    m = service.step(service.next_batch(stop))
    assert m["finite"] and service.version == 1
  finally:
    close(learner, service)


# --- 6. bounded state ---
def test_huge_string_fields_are_refused(tiny_model):
  learner, service = system.build_service(cfg(), tiny_model)
  server, port = srv.serve(service, "127.0.0.1:0")
  client = GrpcClient(f"127.0.0.1:{port}", worker_id="w")
  try:
    t = synth(0)
    t.prompt_id = "p" * (8 << 20)
    client.push(t)
    assert client.flush(30)
    assert client.acks == collections.Counter(field_too_long=1)
    assert len(service.queue) == 0
  finally:
    client.close()
    srv.stop(server)
    close(learner, service)


def _meta_bytes(ckpt_dir, step):
  d = os.path.join(ckpt_dir, str(step), "meta")
  return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def test_checkpointed_admission_state_does_not_grow_with_updates(tmp_path, tiny_model):
  learner, service = system.build_service(cfg(tmp_path, batch_size=2), tiny_model,
                                          admission_log=True)
  try:
    sizes, k = {}, 0
    for v in range(1, 13):
      for _ in range(2):
        assert offer(service, synth(k, producer=f"w{k % 2}/n")) == (True, "")
        k += 1
      service.step(service.next_batch(threading.Event()))
      sizes[v] = _meta_bytes(tmp_path / "checkpoints", v)
    # 24 records used, from two workers: the record of what was used stays the same size.
    assert sizes[12] - sizes[3] < 64, sizes
  finally:
    close(learner, service)


def test_workers_that_stop_heartbeating_are_forgotten(tiny_model):
  learner, service = system.build_service(cfg(), tiny_model)
  try:
    service.workers.timeout_s = 0.3
    for i in range(50):
      service.heartbeat(f"gone-{i}", dict(STATS))
    time.sleep(0.5)
    service.heartbeat("alive", dict(STATS))
    assert list(service.workers) == ["alive"]
    assert service.system_metrics()["workers"] == 1
  finally:
    close(learner, service)


def test_records_stale_at_take_are_dead_lettered_and_leave_the_log(tmp_path, tiny_model):
  learner, service = system.build_service(cfg(tmp_path, batch_size=1, max_policy_lag=0),
                                          tiny_model, admission_log=True)
  try:
    for i in range(3):
      assert offer(service, synth(i)) == (True, "")
    service.step(service.next_batch(threading.Event()))  # uses w/n/0: version 1
    fresh = synth(3, version=1)
    assert offer(service, fresh) == (True, "")
    batch = service.next_batch(threading.Event())  # w/n/1, w/n/2 are stale now
    assert [t.traj_id for t in batch] == [fresh.traj_id]
    service.step(batch)  # version 2: checkpoint, compaction
  finally:
    close(learner, service)
  assert [(r["traj_id"], r["reason"]) for r in dead_letters(tmp_path)] == \
         [("w/n/1", "stale"), ("w/n/2", "stale")]
  learner, service = system.build_service(cfg(tmp_path, batch_size=1, max_policy_lag=0),
                                          tiny_model, admission_log=True)
  try:
    assert service.version == 2 and drain(service) == []  # nothing left to replay
    assert os.path.getsize(tmp_path / "admission.log") == 0
  finally:
    close(learner, service)


# --- 7. torn writes ---
def test_torn_log_frames_are_skipped_and_counted(tmp_path, tiny_model):
  learner, service = system.build_service(cfg(tmp_path), tiny_model, admission_log=True)
  log_path = tmp_path / "admission.log"
  sizes = []
  for i in range(3):
    assert offer(service, synth(i)) == (True, "")
    sizes.append(os.path.getsize(log_path))
  close(learner, service)
  data = bytearray(log_path.read_bytes())
  data[sizes[0] + 8:sizes[1]] = bytes(sizes[1] - sizes[0] - 8)  # record 1's bytes zeroed
  data = data[:sizes[2] - 5]  # record 2 cut short, as a crash mid-write leaves it
  log_path.write_bytes(bytes(data))
  learner, service = system.build_service(cfg(tmp_path), tiny_model, admission_log=True)
  try:
    assert drain(service) == ["w/n/0"]
    assert service.summary()["log_torn_frames"] == 2
  finally:
    close(learner, service)


def test_torn_last_metrics_line_does_not_stop_a_restart(tmp_path, tiny_model):
  c = cfg(tmp_path, batch_size=1)
  learner, service = system.build_service(c, tiny_model, admission_log=True)
  assert offer(service, synth(0)) == (True, "")
  service.step(service.next_batch(threading.Event()))
  close(learner, service)
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 2, "loss": 0.1, "traj_ids": ["w/n')  # killed mid-line
  learner, service = system.build_service(c, tiny_model, admission_log=True)
  try:
    assert service.version == 1
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1]
  finally:
    close(learner, service)


# --- 8. many streaming workers ---
def test_heartbeats_answer_while_many_workers_hold_streams(tiny_model):
  learner, service = system.build_service(cfg(), tiny_model)
  server, port = srv.serve(service, "127.0.0.1:0")
  streams = [GrpcClient(f"127.0.0.1:{port}", worker_id=f"s{k}") for k in range(80)]
  probe = GrpcClient(f"127.0.0.1:{port}", worker_id="probe")
  try:
    # Every client, the probe too, has opened its trajectory stream.
    wait_for(lambda: srv.open_streams(server) == 81, 120, "every client's trajectory stream")
    t0 = time.monotonic()
    hb = probe.heartbeat(dict(STATS), timeout=5.0)
    assert hb is not None and time.monotonic() - t0 < 1.0
    got = probe.get_weights(0, timeout=5.0)
    assert got is not None and got[0] == 0
  finally:
    for c in [probe, *streams]:
      c.close()
    srv.stop(server, grace=0)
    close(learner, service)


# --- 9. authentication ---
@pytest.fixture(scope="module")
def certs(tmp_path_factory):
  return tls_certs.make(tmp_path_factory.mktemp("tls"))


def test_server_only_tls_beyond_loopback_is_refused(tiny_model, certs):
  learner, service = system.build_service(cfg(), tiny_model)
  try:
    with pytest.raises(srv.BindError, match="client"):
      server, _ = srv.serve(service, "0.0.0.0:0", tls_cert=certs["server_cert"],
                            tls_key=certs["server_key"])
      srv.stop(server, grace=0)  # (only reached on the old code)
  finally:
    close(learner, service)


def test_token_is_compared_in_constant_time(tiny_model, monkeypatch):
  calls = []
  real = hmac.compare_digest

  def spy(a, b):
    calls.append((a, b))
    return real(a, b)

  monkeypatch.setattr(hmac, "compare_digest", spy)
  learner, service = system.build_service(cfg(), tiny_model)
  server, port = srv.serve(service, "127.0.0.1:0", token="s3cret")
  client = GrpcClient(f"127.0.0.1:{port}", token="wrong")
  try:
    assert client.heartbeat(dict(STATS)) is None
    assert calls, "the token was not compared with hmac.compare_digest"
  finally:
    client.close()
    srv.stop(server, grace=0)
    close(learner, service)


def test_concurrent_first_weight_fetches_share_one_host_copy(tiny_model, monkeypatch):
  learner, service = system.build_service(cfg(), tiny_model)
  server, port = srv.serve(service, "127.0.0.1:0")
  copies, real = [], codec.flatten

  def slow_flatten(tree, prefix=""):
    if not prefix:
      copies.append(1)
      time.sleep(0.3)
    return real(tree, prefix)

  monkeypatch.setattr(codec, "flatten", slow_flatten)
  clients = [GrpcClient(f"127.0.0.1:{port}", worker_id=f"w{k}") for k in range(4)]
  try:
    got = [None] * 4
    ths = [threading.Thread(target=lambda k=k: got.__setitem__(k, clients[k].get_weights(0)))
           for k in range(4)]
    for th in ths:
      th.start()
    for th in ths:
      th.join(30)
    assert all(g is not None and g[0] == 0 for g in got)
    assert len(copies) == 1, f"{len(copies)} host copies of the same version"
  finally:
    for c in clients:
      c.close()
    srv.stop(server, grace=0)
    close(learner, service)


# --- 10. errors keep their cause ---
def test_a_crash_during_a_run_keeps_its_traceback():
  code = ("from launch import common\n"
          "def main(argv):\n"
          "  raise ValueError('boom at update 1234')\n"
          "common.run(main)\n")
  out = subprocess.run([sys.executable, "-c", code,
                        "--config=experiments/configs/tiny_test.py"],
                       capture_output=True, text=True, env=ENV, timeout=120)
  assert out.returncode == 1, out.stderr[-2000:]
  assert "Traceback" in out.stderr and "ValueError: boom at update 1234" in out.stderr
  assert "bad --config override" not in out.stderr


def test_missing_tls_file_is_one_line_before_the_model_loads(tmp_path):
  t0 = time.monotonic()
  out = subprocess.run([sys.executable, "-m", "launch.learner",
                        "--config=experiments/configs/tiny_test.py", f"--run_dir={tmp_path}",
                        "--tls_cert=/no/such/cert.pem", "--tls_key=/no/such/key.pem",
                        "--auth_token=t"],
                       capture_output=True, text=True, env=ENV, timeout=120)
  assert out.returncode == 2, out.stderr[-2000:]
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith("error:") and "/no/such/cert.pem" in last, out.stderr[-2000:]
  assert "Traceback" not in out.stderr
  assert not (tmp_path / "metrics.jsonl").exists()  # nothing was built
  assert time.monotonic() - t0 < 60


# --- a reconnect after a long-lived stream starts from the shortest backoff ---
def test_backoff_restarts_after_a_stream_that_was_up(tiny_model, caplog):
  """An idle client (the chaos run's poisoner, a worker between rollouts) gets no acks, so the
  backoff must not ride on acks alone: after a learner restart it would otherwise wait the
  longest backoff on every later break (the chaos test's empty poison answers in CI)."""
  learner, service = system.build_service(cfg(), tiny_model)
  server, port = srv.serve(service, "127.0.0.1:0")
  client = GrpcClient(f"127.0.0.1:{port}", worker_id="idle", backoff_min=0.1, backoff_max=2.0)
  caplog.set_level("WARNING", logger="fr_jax.transport")
  try:
    time.sleep(0.5)
    srv.stop(server, grace=0)  # down long enough for the backoff to grow
    time.sleep(2.0)
    server, _ = srv.serve(service, f"127.0.0.1:{port}")
    # The pending backoff ends and the stream opens, then stays up past STREAM_UP_S.
    wait_for(lambda: srv.open_streams(server) == 1, 120, "the idle client's stream")
    time.sleep(STREAM_UP_S + 0.5)
    caplog.clear()
    srv.stop(server, grace=0)
    time.sleep(0.3)
    waits = [float(r.getMessage().rsplit("retrying in ", 1)[1].rstrip("s"))
             for r in caplog.records if "retrying in" in r.getMessage()]
    assert waits and waits[0] == 0.1, waits
  finally:
    client.close()
    srv.stop(server)
    close(learner, service)


def test_a_repeated_id_in_flight_gets_its_own_answer(tiny_model):
  """Each push gets one answer. A record pushed again while the first copy is unacknowledged
  (a worker bug, or a resend after its own restart) used to share the first copy's pending
  slot: it was never sent, and one answer settled both (the CI flake of
  test_grpc_stream_weights_heartbeat_and_malformed: no `duplicate` ack)."""
  learner, service = system.build_service(cfg(), tiny_model)
  offer_ = service.offer
  first = threading.Event()

  def slow_first(*a, **kw):  # the learner holds the first answer back
    if not first.is_set():
      first.set()
      time.sleep(1.0)
    return offer_(*a, **kw)
  service.offer = slow_first
  server, port = srv.serve(service, "127.0.0.1:0")
  answers = []
  client = GrpcClient(f"127.0.0.1:{port}", worker_id="w",
                      on_ack=lambda i, ok, why: answers.append((i, ok, why)))
  try:
    client.push(synth(0))
    assert first.wait(10)
    client.push(synth(0))  # again, while the first copy is in flight
    assert client.flush(20)
    assert [(i, ok) for i, ok, _ in answers] == [("w/n/0", True), ("w/n/0", False)], answers
    assert answers[1][2] == "duplicate"
    assert client.acks == collections.Counter(admitted=1, duplicate=1)
    assert service.rejected == collections.Counter(duplicate=1)
  finally:
    client.close()
    srv.stop(server)
    close(learner, service)


def test_flush_returns_after_the_answers_are_counted(tiny_model):
  """flush() means every pushed record's answer was counted and handed to on_ack; it used to
  return as soon as the pending slot emptied, before either."""
  learner, service = system.build_service(cfg(), tiny_model)
  server, port = srv.serve(service, "127.0.0.1:0")
  answers = []

  def slow_on_ack(i, ok, why):
    time.sleep(0.5)
    answers.append(i)
  client = GrpcClient(f"127.0.0.1:{port}", worker_id="w", on_ack=slow_on_ack)
  try:
    for i in range(3):
      client.push(synth(i))
    assert client.flush(20)
    assert answers == ["w/n/0", "w/n/1", "w/n/2"] and sum(client.acks.values()) == 3, (answers,
                                                                             client.acks)
  finally:
    client.close()
    srv.stop(server)
    close(learner, service)
