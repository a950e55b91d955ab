"""The multi-process learner: 2 processes x 4 CPU devices (jax.distributed, gloo collectives)
make the same updates as 1 process x 8 devices, and a checkpoint the two processes wrote
restores into one process that carries on (tests/multihost_driver.py)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import XLA_TEST_FLAGS
from tests import multihost_driver as drv

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _losses(workdir) -> list:
  rows = [json.loads(line) for line in open(Path(workdir) / "metrics.jsonl")]
  return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def _two_processes(workdir, until: int, env: dict) -> None:
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, "-m", "tests.multihost_driver", f"--workdir={workdir}",
       f"--until={until}", "--local_devices=4", "--num_processes=2", f"--process_id={i}",
       f"--coordinator=127.0.0.1:{port}"],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  try:
    outs = [p.communicate(timeout=300)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i} failed:\n{out[-3000:]}"


def test_two_processes_equal_one_and_their_checkpoint_restores_in_one(tmp_path):
  # The two processes run twice over one persistent compilation cache (every program written):
  # to version 2, then on from their checkpoint to 3. A CPU program with cross-process
  # collectives loaded from the cache aborted the second run in gloo ("Received data size
  # doesn't match expected size, 8192 vs 32"); multihost.initialize now turns the cache off
  # in a multi-process CPU learner (fr_jax.compile_cache), so nothing of theirs is written.
  cache = tmp_path / "xla"
  env = dict(os.environ, XLA_FLAGS=XLA_TEST_FLAGS, JAX_PLATFORMS="cpu", FR_JAX_TOKEN="s3cret",
             JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  mp = tmp_path / "two_processes"
  _two_processes(mp, 2, env)
  _two_processes(mp, 3, env)
  assert not any(p.name.endswith("-cache") for p in cache.rglob("*"))
  # Both processes wrote their shards of the checkpoint; only process 0 wrote metrics.
  assert (mp / "ckpt" / "3" / "state" / "ocdbt.process_1").is_dir()
  assert [s for s, _ in _losses(mp)] == [1, 2, 3]

  # The weights as a relay gets them: the two processes' own shards (nothing gathered), in
  # bfloat16, fetched from both into one file: bit-equal to the gathered weights' export.
  from fr_jax.models import hf_io, registry
  assert "host 1" in (mp / "shards.log").read_text()  # process 1 served part of it
  from tests.test_shards import BF16, assert_bit_equal, read_file
  two = np.load(mp / "params.npz")
  cfg = registry.load("tiny-qwen2").config.replace(param_dtype="bfloat16")
  tree = {}
  for k in two.files:
    if k == "version":
      continue
    *path, leaf = k.split("/")
    node = tree
    for p in path:
      node = node.setdefault(p, {})
    node[leaf] = two[k].astype(BF16)
  want = hf_io.save_hf(tmp_path / "gathered", tree, cfg)
  assert_bit_equal(read_file(mp / "shards.safetensors"), read_file(want / "model.safetensors"))

  # One process of 8 devices (this one): restores version 3, makes updates 4 and 5.
  got = drv.run(str(mp), until=5)
  ref = drv.run(str(tmp_path / "one_process"), until=5)
  assert int(got["version"]) == int(ref["version"]) == 5

  init = drv.flat_params(registry.load("tiny-qwen2").params)
  moved = max(float(np.abs(ref[k] - init[k]).max()) for k in init)
  assert moved > 1e-3  # the updates changed the weights well beyond the tolerance
  for k in init:
    np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=1e-5, err_msg=k)
  (steps, a), (steps_ref, b) = zip(*_losses(mp)), zip(*_losses(tmp_path / "one_process"))
  assert list(steps) == list(steps_ref) == [1, 2, 3, 4, 5]
  np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)



_IDLE = """
import json, threading, time
import jax
from fr_jax.learner import multihost, synthetic
multihost.initialize("127.0.0.1:{port}", 1, 0, secret="s3cret")
multihost.POLL_MS = 200  # the follower's waits time out several times before the call comes
leader, follower = multihost.Group(0, 2, session=b"r"), multihost.Group(1, 2, session=b"r")
trajs = [synthetic.synthetic_trajectory(i) for i in range(3)]
for t, i in zip(trajs, range(3)):
  t.traj_id = f"w/{{i}}"
def later():
  time.sleep(1.0)
  leader.announce("update", trajs, {{"log_ids": False}})
  leader.announce("close", None, {{}})
threading.Thread(target=later).start()
t0 = time.monotonic()
method, got, kwargs = follower.receive()
print(json.dumps([method, kwargs, time.monotonic() - t0]))
for a, b in zip(got, trajs):
  assert a.traj_id == b.traj_id and a.reward == b.reward
  assert (a.completion_tokens == b.completion_tokens).all()
  assert (a.behavior_logp == b.behavior_logp).all() and (a.action_mask == b.action_mask).all()
print(json.dumps(follower.receive()))
"""


def test_a_follower_waits_through_idle_time_and_gets_the_records_whole():
  """An announcement that comes after several of the follower's waits have timed out still
  arrives, in order, with its trajectories bit for bit."""
  r = subprocess.run([sys.executable, "-c", _IDLE.format(port=_free_port())], cwd=REPO,
                     env=dict(os.environ, XLA_FLAGS=XLA_TEST_FLAGS), capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 0, r.stderr[-3000:]
  (method, kwargs, waited), second = map(json.loads, r.stdout.strip().splitlines()[-2:])
  assert (method, kwargs) == ("update", {"log_ids": False}) and waited >= 0.9
  assert second == ["close", None, {}]


_OUTSIDER = """
import json, socket, threading
import jax
from fr_jax.learner import multihost
multihost.initialize("127.0.0.1:{port}", 1, 0, secret="s3cret")
multihost.POLL_MS = 200
leader, follower = multihost.Group(0, 2, session=b"run-1"), multihost.Group(1, 2, session=b"run-1")
kv = leader.client  # the outsider writes the store as a plain gRPC client could: no token
out = {{}}
# 1. A forged call where the follower will read next: it must not be made.
kv.key_value_set_bytes(multihost._PREFIX + "0", multihost.encode_call(
    "export_hf", None, {{"path": "/tmp/outsider"}}))
threading.Timer(0.5, lambda: leader.announce("close", None, {{}})).start()
out["first"] = follower.receive()
# 2. The outsider writes the leader's next key before the leader does.
kv.key_value_set_bytes(multihost._PREFIX + "1", b"x")
try:
  leader.announce("snapshot_params", None, {{}})
  out["second"] = follower.receive()
except Exception as e:
  out["second"] = type(e).__name__ + ": " + str(e)[:200]
# 3. A real announcement of another session (another run with the same secret), replayed.
other = multihost.Group(0, 2, session=b"run-0")
other._n = 2
other.announce("close", None, {{}})
threading.Timer(0.5, lambda: leader.announce("restore", None, {{"step_": 3}})).start()
out["third"] = follower.receive()
# 4. The coordinator listens only where it was told to.
with socket.socket() as s:
  s.settimeout(2)
  out["reachable_from_{ip}"] = s.connect_ex(("{ip}", {port})) == 0
print(json.dumps(out))
"""


def _non_loopback_ip() -> str:
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
    return s.getsockname()[0]


def test_outsiders_on_the_coordinator_port_cannot_make_or_block_learner_calls():
  """Whoever reaches the coordinator's key-value store (it needs no token) can neither have a
  follower make a call (forged or replayed from another run: every announcement carries an
  HMAC over the run's session and its number) nor block the leader by writing its next key
  first; and the coordinator binds only to the address it was given."""
  ip = _non_loopback_ip()
  r = subprocess.run([sys.executable, "-c", _OUTSIDER.format(port=_free_port(), ip=ip)],
                     cwd=REPO, env=dict(os.environ, XLA_FLAGS=XLA_TEST_FLAGS),
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["first"] == ["close", None, {}]
  assert out["second"] == ["snapshot_params", None, {}]
  assert out["third"] == ["restore", None, {"step_": 3}]
  if not ip.startswith("127."):
    assert out[f"reachable_from_{ip}"] is False


def test_only_the_listed_calls_with_typed_arguments_are_made(monkeypatch):
  """An authentic announcement is still checked: the method must be one a follower makes,
  carry trajectories exactly when that call takes them, and only arguments of its types."""
  from fr_jax.learner import multihost
  ok = [("update", True, {"lags": [0, 1], "log_ids": False}), ("find_offenders", True, {}),
        ("save", False, {"data_state": {"a": 1}, "force": True, "extra": None}),
        ("restore", False, {"step_": None}), ("close", False, {})]
  for call in ok:
    multihost.check_call(*call)
  bad = [("export_hf", False, {"path": "/tmp/x"}), ("update", False, {}),
         ("close", True, {}), ("update", True, {"lags": [1.5]}),
         ("save", False, {"force": "yes"}), ("restore", False, {"step_": "3"}),
         ("restore", False, {"path": "/x"}), ("__init__", False, {})]
  for call in bad:
    with pytest.raises(ValueError):
      multihost.check_call(*call)
  for k in multihost.SECRET_ENV:
    monkeypatch.delenv(k, raising=False)
  with pytest.raises(multihost.NoSecret, match="FR_JAX_TOKEN"):
    multihost.initialize("127.0.0.1:1", 2, 1)
  g = multihost.Group(1, 2, client=object(), secret="k", session=b"s")
  sealed = g.seal(5, b"payload")
  assert g.open(5, sealed) == b"payload"
  other_secret = multihost.Group(1, 2, client=object(), secret="k2", session=b"s")
  other_session = multihost.Group(1, 2, client=object(), secret="k", session=b"t")
  for forged in (sealed[:-1] + b"X", g.seal(6, b"payload"), b"short",
                 other_secret.seal(5, b"payload"), other_session.seal(5, b"payload")):
    with pytest.raises(multihost.ForgedAnnouncement):
      g.open(5, forged)
