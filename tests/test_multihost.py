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
  env = dict(os.environ, XLA_FLAGS=XLA_TEST_FLAGS, JAX_PLATFORMS="cpu",
             JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  mp = tmp_path / "two_processes"
  _two_processes(mp, 2, env)
  _two_processes(mp, 3, env)
  assert not any(p.name.endswith("-cache") for p in cache.rglob("*"))
  # Both processes wrote their shards of the checkpoint; only process 0 wrote metrics.
  assert (mp / "ckpt" / "3" / "state" / "ocdbt.process_1").is_dir()
  assert [s for s, _ in _losses(mp)] == [1, 2, 3]

  # One process of 8 devices (this one): restores version 3, makes updates 4 and 5.
  got = drv.run(str(mp), until=5)
  ref = drv.run(str(tmp_path / "one_process"), until=5)
  assert int(got["version"]) == int(ref["version"]) == 5

  from fr_jax.models import registry
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
jax.distributed.initialize("127.0.0.1:{port}", 1, 0)
multihost.POLL_MS = 200  # the follower's waits time out several times before the call comes
leader, follower = multihost.Group(0, 2), multihost.Group(1, 2)
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
