"""Wire format, the learner service's admission/queue/controller, and gRPC end to end in one
process (server thread + client): raw little-endian arrays, named rejections, backpressure,
weights by version in chunks, token auth and the loopback rule."""

import collections
import functools
import math
import subprocess
import sys
import threading
import time

import grpc
import jax
import ml_dtypes
import numpy as np
import pytest

from fr_jax import config as rcfg
from fr_jax import system
from fr_jax.learner.inflight import InflightController
from fr_jax.learner.learner import Learner
from fr_jax.learner.synthetic import synthetic_trajectory
from fr_jax.learner.trajectory_queue import TrajectoryQueue
from fr_jax.trajectory import TrajectoryError
from fr_jax.transport import codec, rpc
from fr_jax.transport import fr_jax_pb2 as pb
from fr_jax.transport import server as srv
from fr_jax.transport.client import GrpcClient, LocalClient
from tests import helpers
from tests.helpers import with_routing


# --- wire format ---
def test_tensor_bytes_are_little_endian_raw():
  a = np.array([1, -2, 0x01020304], np.int32)
  t = codec.to_tensor(a)
  assert t.dtype == "int32" and list(t.shape) == [3]
  assert t.data == a.astype("<i4").tobytes() == b"\x01\0\0\0\xfe\xff\xff\xff\x04\x03\x02\x01"
  big = a.astype(">i4")  # a big-endian array is sent little-endian all the same
  assert codec.to_tensor(big).data == t.data
  np.testing.assert_array_equal(codec.from_tensor(t), a)
  bf = np.array([[1.5, -2.0]], ml_dtypes.bfloat16)
  back = codec.from_tensor(codec.to_tensor(bf))
  assert back.dtype == bf.dtype and back.shape == (1, 2)
  np.testing.assert_array_equal(back.astype(np.float32), [[1.5, -2.0]])


@pytest.mark.parametrize("bad", [
    pb.Tensor(dtype="int32", shape=[3], data=b"\0" * 8),
    pb.Tensor(dtype="complex64", shape=[1], data=b"\0" * 8),
    pb.Tensor(dtype="int32", shape=[-1], data=b""),
])
def test_malformed_tensor_is_a_named_error(bad):
  with pytest.raises(TrajectoryError) as e:
    codec.from_tensor(bad)
  assert e.value.reason == "bad_field"


def test_trajectory_round_trip():
  t = synthetic_trajectory(3, seed=1, version=7)
  t.num_tool_calls, t.num_turns = 2, 3
  back = codec.trajectory_from_proto(
      pb.Trajectory.FromString(codec.trajectory_to_proto(t, "w").SerializeToString()))
  for f in ("prompt_tokens", "completion_tokens", "action_mask", "behavior_logp",
            "policy_version"):
    np.testing.assert_array_equal(getattr(back, f), getattr(t, f))
    assert getattr(back, f).dtype == getattr(t, f).dtype
  assert (back.reward, back.traj_id, back.num_tool_calls, back.num_turns) == \
         (t.reward, t.traj_id, 2, 3)


def assert_same_routing(got, want):
  """Byte-identical routed_experts: dtype, shape and values (None stays None)."""
  if want is None:
    assert got is None
    return
  assert got.dtype == want.dtype and got.shape == want.shape
  assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype,num_experts", [(np.int8, 128), (np.int16, 300), (None, 0)])
def test_routed_experts_round_trip(dtype, num_experts):
  t = synthetic_trajectory(4, seed=2, version=1)
  if dtype is not None:
    with_routing(t, layers=3, k=4, num_experts=num_experts, dtype=dtype)
    t.routed_experts[0, 0] = [num_experts - 1, 0, 1, 2]  # the extremes of the dtype's use
  msg = codec.trajectory_to_proto(t, "w")
  assert msg.HasField("routed_experts") == (dtype is not None)
  if dtype is not None:  # sent as its own compact dtype, not widened
    assert msg.routed_experts.dtype == np.dtype(dtype).name
    assert len(msg.routed_experts.data) == t.routed_experts.size * np.dtype(dtype).itemsize
  back = codec.trajectory_from_proto(pb.Trajectory.FromString(msg.SerializeToString()))
  assert_same_routing(back.routed_experts, t.routed_experts)
  # The admission log's and dead-letter file's bytes restore it the same way.
  again = codec.decode_record(codec.encode_record(t))
  assert_same_routing(again.routed_experts, t.routed_experts)
  np.testing.assert_array_equal(again.completion_tokens, t.completion_tokens)
  assert again.traj_id == t.traj_id


def test_malformed_routed_experts_is_a_decode_error():
  msg = codec.trajectory_to_proto(with_routing(synthetic_trajectory(1, seed=2)))
  msg.routed_experts.data = msg.routed_experts.data[:-1]
  with pytest.raises(TrajectoryError, match="routed_experts: .* bytes do not hold") as e:
    codec.trajectory_from_proto(msg)
  assert e.value.reason == "bad_field"


def test_weight_chunks_reassemble_exactly():
  rng = np.random.default_rng(0)
  tree = {"embed": rng.normal(size=(37, 11)).astype(np.float32),
          "layers": {"wq": rng.normal(size=(2, 5, 7)).astype(ml_dtypes.bfloat16),
                     "norm": np.ones((2, 5), np.float32)}, "empty": np.zeros((0,), np.int32)}
  flat = codec.flatten(tree)
  chunks = list(codec.weight_chunks(9, flat, chunk_bytes=100))
  assert len(chunks) > len(flat)  # big tensors were split
  v, got, _ = codec.assemble_weights(chunks)
  assert v == 9 and set(got) == set(flat)
  for k in flat:
    np.testing.assert_array_equal(got[k], flat[k])
    assert got[k].dtype == flat[k].dtype
  with pytest.raises(ValueError, match="missing bytes"):
    codec.assemble_weights(chunks[:1] + chunks[2:])


# --- queue and controller ---
def test_queue_blocks_when_full_and_keeps_order():
  q = TrajectoryQueue(2)
  assert q.put("a") and q.put("b")
  assert not q.put("c", timeout=0.05)  # full: backpressure
  threading.Timer(0.1, q.pop).start()
  assert q.put("c", timeout=120.0)  # unblocked once the learner took one (a hang guard)
  assert [q.pop(0.1), q.pop(0.1), q.pop(0.01)] == ["b", "c", None]


def test_inflight_controller_aimd():
  c = InflightController(8, target_rejection=0.1, max_lag=4)
  # rejection 0.2 > 0.1: 8 * 0.75 -> 6; lag 5 > 4: 6 * .75 -> 4; calm: +1; in between: hold.
  seq = [c.observe(1, 0.8, 0), c.observe(2, 1.0, 5), c.observe(3, 0.99, 1),
         c.observe(4, 0.93, 1)]
  assert seq == [6, 4, 5, 5]
  assert [h["new"] for h in c.history] == [6, 4, 5]
  lo = InflightController(1)
  assert lo.observe(1, 0.0, 0) == 1  # never below the minimum


# --- the service around a real tiny learner ---
tiny_run_config = helpers.cfg
synth = functools.partial(helpers.synth, producer="")  # ids t<i>
def test_admission_counts_named_reasons(tiny_model):
  learner, service = system.build_service(tiny_run_config(max_policy_lag=1), tiny_model)
  try:
    ok = synth(0)
    assert service.offer(ok) == (True, "")
    assert service.offer(ok) == (False, "duplicate")
    bad = synth(1)
    bad.action_mask[:] = False
    bad.behavior_logp[:] = 0
    assert service.offer(bad) == (False, "no_action_tokens")
    assert service.offer(synth(2, version=3)) == (False, "future_version")
    service._version = 5  # as if five updates had happened
    assert service.offer(synth(3, version=3)) == (False, "stale")  # lag 2 > 1
    assert service.offer(synth(4, version=4)) == (True, "")  # lag 1
    assert dict(service.rejected) == {"duplicate": 1, "no_action_tokens": 1,
                                      "future_version": 1, "stale": 1}
    # t0 (version 0) went stale while queued: dropped at take time, t4 is taken.
    service.learner.config.batch_size = service.B = 1
    assert [t.traj_id for t in service.next_batch(threading.Event())] == ["t4"]
    assert service.rejected["stale"] == 2
  finally:
    service.close()
    learner.close()


def test_updates_take_arrivals_in_order_without_replay(tiny_model):
  c = tiny_run_config(batch_size=2)
  learner, service = system.build_service(c, tiny_model)
  client = LocalClient(service)
  for i in range(7):
    client.push(synth(i))
  stop = threading.Event()
  try:
    b1 = service.next_batch(stop)
    service.step(b1)
    b2 = service.next_batch(stop)
    service.step(b2)
    assert [t.traj_id for t in b1 + b2] == ["t0", "t1", "t2", "t3"]
    assert service.version == 2 and len(service.queue) == 3
    assert service.offer(synth(1)) == (False, "duplicate")  # already used
    v, params = service.weights(2)
    jax.tree.map(np.testing.assert_array_equal, params, learner.params)
    assert service.weights(3) is None
  finally:
    service.close()
    learner.close()


# --- gRPC end to end, in one process ---
def test_grpc_stream_weights_heartbeat_and_malformed(tiny_model):
  c = tiny_run_config(batch_size=2)
  learner, service = system.build_service(c, tiny_model)
  server, port = srv.serve(service, "127.0.0.1:0")
  client = GrpcClient(f"127.0.0.1:{port}", worker_id="w0")
  try:
    for i in range(3):
      client.push(synth(i))
    bad = codec.trajectory_to_proto(synth(9))
    bad.behavior_logp.data = bad.behavior_logp.data[:-4]  # byte count disagrees with shape
    client.push(bad)
    client.push(synth(0))  # a duplicate
    assert client.flush(20)
    assert client.acks == collections.Counter(admitted=3, decode=1, duplicate=1)
    assert service.rejected == collections.Counter(decode=1, duplicate=1)
    assert len(service.queue) == 3
    hb = client.heartbeat(dict(engine_version=0, trajectories=5, tokens=10, uptime_s=1.0,
                               inflight=2))
    assert hb["version"] == 0 and hb["queue_depth"] == 3 and not hb["shutdown"]
    assert service.workers["w0"]["trajectories"] == 5
    service.step(service.next_batch(threading.Event()))
    v, params, _ = client.get_weights(1)
    assert v == 1
    jax.tree.map(np.testing.assert_array_equal, params, jax.device_get(learner.params))
    assert client.get_weights(2) is None
  finally:
    client.close()
    srv.stop(server)
    service.close()
    learner.close()


def test_grpc_carries_routing_into_the_learner_and_its_log(tmp_path, tiny_model, monkeypatch):
  """A worker's routed_experts reach the learner byte for byte, through the real client and
  server, and come back the same from the admission log after a restart; a learner that
  replays routing (`routing` in its record_limits) refuses records without or with bad
  routing."""
  routing = (2, 3, 40)  # sparse layers, k, experts
  limits = Learner.record_limits.fget
  monkeypatch.setattr(Learner, "record_limits",
                      property(lambda self: dict(limits(self), routing=routing)))
  c = tiny_run_config(tmp_path, batch_size=2)
  learner, service = system.build_service(c, tiny_model, admission_log=True)
  assert service.limits["routing"] == routing  # the service takes the learner's limits
  server, port = srv.serve(service, "127.0.0.1:0")
  client = GrpcClient(f"127.0.0.1:{port}", worker_id="w0")
  good = [with_routing(synth(0, producer="w/n"), *routing, dtype=np.int8, seed=1),
          with_routing(synth(1, producer="w/n"), *routing, dtype=np.int16, seed=2)]
  dup = with_routing(synth(2, producer="w/n"), *routing, seed=3)
  dup.routed_experts[5, 1] = [7, 9, 7]
  wide = with_routing(synth(3, producer="w/n"), *routing, seed=4)
  wide.routed_experts[0, 0, 0] = 40  # expert 40 of 40
  short = with_routing(synth(4, producer="w/n"), *routing, seed=5)
  short.routed_experts = short.routed_experts[1:]
  try:
    for t in good + [dup, wide, short, synth(5, producer="w/n")]:
      client.push(t)
    assert client.flush(30)
    assert client.acks == collections.Counter(admitted=2, bad_routing=3, missing_routing=1)
    assert service.rejected == collections.Counter(bad_routing=3, missing_routing=1)
    admitted = [service.queue.pop(1.0) for _ in good]
    assert len(service.queue) == 0
  finally:
    client.close()
    srv.stop(server)
    service.close()
    learner.close()
  for got, want in zip(admitted, good, strict=True):
    assert got.traj_id == want.traj_id
    assert_same_routing(got.routed_experts, want.routed_experts)
  # A restart replays the admission log (the server logged the bytes it received).
  learner, service = system.build_service(c, tiny_model, admission_log=True)
  try:
    replayed = [service.queue.pop(0) for _ in good]
    assert service.replayed == 2 and len(service.queue) == 0
    for got, want in zip(replayed, good, strict=True):
      assert got.traj_id == want.traj_id
      assert_same_routing(got.routed_experts, want.routed_experts)
  finally:
    service.close()
    learner.close()


def test_token_auth_and_loopback_rule(tiny_model):
  assert srv.is_loopback("127.0.0.1:1") and srv.is_loopback("[::1]:5")
  assert srv.is_loopback("localhost:9") and not srv.is_loopback("0.0.0.0:1")
  learner, service = system.build_service(tiny_run_config(), tiny_model)
  try:
    with pytest.raises(srv.BindError, match="beyond loopback"):
      srv.serve(service, "0.0.0.0:0")
    server, port = srv.serve(service, "127.0.0.1:0", token="s3cret")
    try:
      stats = dict(engine_version=0, trajectories=0, tokens=0, uptime_s=0.0, inflight=0)
      anon = GrpcClient(f"127.0.0.1:{port}")
      with pytest.raises(grpc.RpcError) as e:
        anon.stub.Heartbeat(pb.WorkerStats(**stats), timeout=5)
      assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
      assert anon.get_weights(0) is None
      anon.close()
      ok = GrpcClient(f"127.0.0.1:{port}", token="s3cret")
      assert ok.heartbeat(stats)["queue_capacity"] == service.queue.capacity
      ok.close()
    finally:
      srv.stop(server)
  finally:
    service.close()
    learner.close()


def test_config_errors_are_named():
  c = tiny_run_config()
  c.service.queue_capacity = 1
  with pytest.raises(rcfg.ConfigError, match="queue_capacity"):
    rcfg.validate(c)
  c = tiny_run_config()
  c.env.name = "chess"
  with pytest.raises(rcfg.ConfigError, match="chess"):
    rcfg.validate(c)


def test_generated_stubs_match_the_proto(tmp_path):
  """The checked-in message classes are what `make proto` produces from the checked-in .proto,
  and rpc.METHODS / rpc.SHARD_METHODS declare exactly the .proto's services."""
  out = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.",
                        f"--python_out={tmp_path}", "fr_jax/transport/fr_jax.proto"],
                       capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  assert set(pb.DESCRIPTOR.services_by_name) == {"Learner", "Shards"}
  for name, full, methods in (("Learner", rpc.SERVICE, rpc.METHODS),
                              ("Shards", rpc.SHARDS, rpc.SHARD_METHODS)):
    svc = pb.DESCRIPTOR.services_by_name[name]
    assert svc.full_name == full
    kinds = {m.name: ("stream" if m.client_streaming else "unary") + "_" +
             ("stream" if m.server_streaming else "unary") for m in svc.methods}
    assert kinds == {n: k for n, (k, _, _) in methods.items()}
    for m in svc.methods:
      _, req, resp = methods[m.name]
      assert (m.input_type.full_name, m.output_type.full_name) == \
             (req.DESCRIPTOR.full_name, resp.DESCRIPTOR.full_name)
  for name in ("fr_jax_pb2.py",):
    got = (tmp_path / "fr_jax/transport" / name).read_text()
    assert got == open(f"fr_jax/transport/{name}").read(), f"{name} is stale: run make proto"


def test_in_process_training_runs_lag_bounded(tmp_path, tiny_model):
  """launch.train's path: worker threads on the embedded engine feed the learner."""
  c = tiny_run_config(tmp_path, max_updates=3, max_policy_lag=1)
  s = system.train_in_process(c, model=tiny_model)
  assert s["updates"] == 3 and s["version"] == 3 and not s["worker_errors"]
  assert s["max_lag"] <= 1 and s["trajectories_used"] == 3 * c.batch_size
  from fr_jax.learner.metrics import read_jsonl
  rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert all(r["policy_lag_max"] <= 1 for r in rows)
  assert math.isfinite(rows[-1]["loss"])


def test_in_process_workers_draw_the_same_samples_for_the_same_seed(tiny_model):
  """A fresh in-process run repeats its draws (`make demo SEED=...`); a worker started
  without a sample tag (a separate worker process) draws new ones each start."""

  class Collect:  # the worker's client interface, in this process: keeps what is pushed
    def __init__(self, n):
      self.n, self.got, self.stop = n, [], threading.Event()

    def heartbeat(self, stats):
      return None

    def push(self, traj, stop):
      self.got.append(traj)
      if len(self.got) >= self.n:
        self.stop.set()

  c = tiny_run_config(**{"rollout.num_workers": 1})

  def draw(tag):
    client = Collect(8)
    w = system.build_worker(c, client, tiny_model, index=0, num_shards=1, sample_tag=tag)
    w.run(client.stop)
    return [(t.prompt_id, t.completion_tokens.tolist()) for t in client.got[:8]]

  a, b = draw("v0.r0"), draw("v0.r0")
  assert a == b
  assert draw("v0.r1") != a  # a restarted worker: the same prompts, new samples
  assert draw(None) != a
  assert [p for p, _ in draw(None)] == [p for p, _ in a]


def test_published_versions_are_kept_by_number_for_a_fixed_lag(tiny_model):
  """`rollout.fixed_lag=L` keeps the last L+1 published versions, each under its number."""
  c = tiny_run_config(**{"rollout.num_workers": 1, "rollout.fixed_lag": 1})
  learner, service = system.build_service(c, tiny_model)
  try:
    for v in (1, 2):  # as if the learner had updated
      service._version = v
      service.publish()
    assert service.weights(0)[0] == 2
    assert service.weights_at(0) == ("gone", None)
    assert [service.weights_at(v)[0] for v in (1, 2, 3)] == ["ok", "ok", "not_yet"]
    ok = service.weights_at(2)[1]
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), ok,
                                     service.weights(0)[1]))
    service._version = 1  # a restored learner publishes an older version again
    service.publish()
    assert service.weights(0)[0] == 1 and service.weights_at(2) == ("not_yet", None)
  finally:
    service.close()
    learner.close()


def test_fixed_lag_configs_are_checked():
  for over, match in (({"rollout.num_workers": 2}, "num_workers=1"),
                      ({"service.publish_every": 2}, "publish_every=1"),
                      ({"max_policy_lag": 0}, "exceeds max_policy_lag")):
    c = tiny_run_config(**{"rollout.num_workers": 1, "rollout.fixed_lag": 1, **over})
    with pytest.raises(rcfg.ConfigError, match=match):
      rcfg.validate(c)


def _run_fixed_lag_worker(tiny_model, inflight, gone_below=0):
  """A worker at `rollout.fixed_lag=1`, batches of 2, for 12 pushes, against the in-process
  client's interface with versions 0-9 published and those below `gone_below` no longer kept
  (the newest is 9). Returns (the versions it asked for, its engine's version at each push)."""

  class Versions:
    def __init__(self):
      self.asked, self.loaded, self.stop = [], [], threading.Event()

    def heartbeat(self, stats):
      return None

    def weights_at(self, v):
      self.asked.append(v)
      return ("gone", None) if v < gone_below else ("ok", tiny_model.params)

    def get_weights(self, min_version):
      return 9, tiny_model.params, ""

    def push(self, traj, stop):
      self.loaded.append(w.engine.version)
      if len(self.loaded) >= 12:
        self.stop.set()

  c = tiny_run_config(**{"rollout.num_workers": 1, "rollout.fixed_lag": 1, "agent.max_turns": 1,
                         "rollout.inflight": inflight, "batch_size": 2})
  client = Versions()
  w = system.build_worker(c, client, tiny_model, index=0, num_shards=1, sample_tag="t")
  w.run(client.stop)
  return client.asked, client.loaded


def test_a_fixed_lag_worker_follows_its_schedule_and_recovers_when_the_learner_is_ahead(
    tiny_model):
  """The schedule asks for version (pushed // B) - L; a version the learner no longer keeps
  (it is ahead, as after records were replayed at a restart) makes the worker load the newest
  and count on from there."""
  asked, loaded = _run_fixed_lag_worker(tiny_model, inflight=2, gone_below=4)
  # Batches 0 and 1 (pushes 0-3) at version 0; then version 1 is asked for and gone: the
  # newest (9) serves batch 2, and batch k after it version 9 + (k - 2).
  assert asked == [1, 10, 11, 12]
  assert loaded == [0] * 4 + [9] * 2 + [10] * 2 + [11] * 2 + [12] * 2


def test_a_fixed_lag_worker_starts_no_episode_beyond_its_batch(tiny_model):
  """With `rollout.inflight` above what the batch still needs (3 in flight, batches of 2),
  the worker starts only the current batch's episodes, so batch k is sampled with version
  k - 1 exactly. (It used to top up to 3, and batch 2 came from version 0.)"""
  _, loaded = _run_fixed_lag_worker(tiny_model, inflight=3)
  assert loaded == [0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_a_worker_process_refuses_a_fixed_lag():
  r = subprocess.run([sys.executable, "-m", "launch.worker",
                      "--config=experiments/configs/tiny_test.py", "--learner=127.0.0.1:1",
                      "--config.rollout.fixed_lag=1", "--config.rollout.num_workers=1"],
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 2 and "in-process worker" in r.stderr, r.stderr[-2000:]


def test_fixed_lag_runs_do_not_depend_on_timing(tmp_path, tiny_model, monkeypatch):
  """At rollout.fixed_lag=1 the worker samples batch k with version k-1 whatever the timing:
  a run whose worker is slowed at every push trains on the same batches, update for update.
  (A free-running worker, fixed_lag=-1, samples batch 3 at lag 2 here, and at lag 1 when
  slowed.)"""
  from fr_jax.learner.metrics import read_jsonl
  keys = ("loss", "reward_mean", "response_length", "policy_lag_mean", "policy_lag_max",
          "grad_norm")
  push = LocalClient.push

  def run(name, push_delay=0.0):
    def slow_push(self, traj, stop=None):
      time.sleep(push_delay)
      return push(self, traj, stop)

    monkeypatch.setattr(LocalClient, "push", slow_push)
    c = tiny_run_config(tmp_path / name, max_updates=4, max_policy_lag=4, **{
        "rollout.num_workers": 1, "rollout.fixed_lag": 1, "agent.max_turns": 1,
        "rollout.inflight": 4, "service.queue_capacity": 4, "checkpoint.every": 100})
    s = system.train_in_process(c, model=tiny_model)
    assert s["updates"] == 4 and not s["worker_errors"]
    return [{k: r[k] for k in keys} for r in read_jsonl(tmp_path / name / "metrics.jsonl")
            if "loss" in r]

  quiet = run("quiet")
  # Batch 0 is sampled with version 0 and used at version 0; batch k with k-1, used at k.
  assert [r["policy_lag_max"] for r in quiet] == [0, 1, 1, 1]
  assert run("slow_worker", push_delay=0.1) == quiet
