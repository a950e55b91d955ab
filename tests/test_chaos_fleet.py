"""The fleet fault-injection run, short: `python -m experiments.chaos.fleet` with a learner of
2 processes, 2 servers, 2 weight relays and 4 workers, and 40 s of faults (one each: both
learner processes SIGKILLed, a server SIGKILLed and restarted, a relay SIGKILLed, poison with
routing on a dense model, a refused-load window where the server can be told to refuse; two
worker faults). Twice: with SGLang stand-ins behind the real sglang-router (about 4 minutes on
2 cores, most of it starting the processes), and with 2 real vLLM servers (about 3.5 minutes).
`make chaos-fleet [ENGINE=vllm]` is the 10-minute run."""

import json
import os
import subprocess
import sys

import pytest

ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")  # one device per child process


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_short_fleet_chaos_run_loses_nothing_and_keeps_up(tmp_path, engine):
  out = subprocess.run(
      [sys.executable, "-m", "experiments.chaos.fleet", f"--engine={engine}", "--duration_s=40",
       "--workers=4", "--learner_kills=1", "--server_restarts=1", "--relay_kills=1",
       "--worker_faults=2", "--refusal_windows=1", "--poison_rounds=1", "--seed=1",
       f"--run_dir={tmp_path / 'run'}"],
      capture_output=True, text=True, env=ENV, timeout=1200)
  lines = out.stdout.strip().splitlines()
  assert lines, out.stderr[-3000:]
  r = json.loads(lines[-1])
  print(json.dumps(r))
  assert out.returncode == 0, (r, out.stderr[-3000:])
  assert r["engine"] == engine
  assert r["lost"] == 0 and r["duplicated"] == 0, r
  assert r["repeated_updates"] == 0 and r["updates_contiguous"]
  assert r["acknowledged"] == r["used"] + r["queued"] + r["dead_lettered"] and r["used"] > 0
  f = r["faults"]
  assert (f["learner_kill"], f["server_restart"], f["relay_kill"], f["poison"]) == (1, 1, 1, 1)
  # vLLM cannot be told to refuse a load: no refusal window there (experiments/chaos/fleet.py)
  assert f.get("refusal", 0) == (0 if engine == "vllm" else 1)
  assert f.get("worker_kill", 0) + f.get("connection_cut", 0) == 2
  # Training went on after every fault; the fleet came back to the learner's version after
  # its restart; every worker was alive at the end.
  assert r["stalls"] == 0 and r["diverged"] == [] and r["convergence_s"]["n"] == 1, r
  assert r["server_convergence_s"]["n"] == 1, r  # the restarted server got the weights back
  assert r["workers_alive_at_end"] and r["learner_starts"] == 2
  assert r["learner_exit"] == [0, 0]
  # The poison: three refused by name, the routing record's routing dropped (dense model).
  p = r["poison_answers"]
  assert p["huge_reward:reward_out_of_range"] == 1 and p["oov_token:token_out_of_vocab"] == 1
  assert p["logp_floor:behavior_logp_below_floor"] == 1
  assert set(k for k in p if k.startswith("routing_on_dense:")) <= {
      "routing_on_dense:admitted", "routing_on_dense:future_version",
      "routing_on_dense:duplicate"}, p
