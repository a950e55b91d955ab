"""The learning guard: exactness tests cannot see a run that stops learning, this one can.

A tiny model is warm-started and then trained with FlashREINFORCE through the production
path (embedded engine, agent loop, learner service, packed learner, objective; see
tests/learning_guard.py), and its held-out accuracy must rise and its truncation rate fall
to a quarter.
The slow variants inject two learner bugs (a sign error in the advantage; truncated
trajectories losing their zero reward) and check that the guard fails on each.

Measured (2-core AMD EPYC, 2026-12-02; held-out accuracy and truncation rate, 200 tasks
sampled at temperature 1). The workers' lag (1 or 2) follows timing here, so results move
with CPU load, and the thresholds leave room for that:
* 20 updates, quiet: healthy 0.520 -> 0.810, truncation 0.405 -> 0.000 (about 70 s, 50 s of
  it the warm start); advantage_sign -> 0.000 / 0.980; drop_truncated -> 0.215 / 0.770.
* 20 updates under a demo and the rest of `make test`: healthy 0.520 -> 0.605 / 0.010.
* 30 updates (the guard now), the three runs at once on 2 cores: healthy 0.520 -> 0.690 /
  0.020; advantage_sign -> 0.000 / 0.975; drop_truncated -> 0.630 / 0.320 (its accuracy
  rose, but its replies still ran past the limit a third of the time: truncation catches it).
"""

import json
import os
import subprocess
import sys

import pytest

# One device, as `make demo` runs (the suite forces 8 host devices for the mesh tests).
ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")


def learning_run(tmp_path, fault: str = "") -> dict:
  out = tmp_path / (fault or "healthy")
  p = subprocess.run([sys.executable, "-m", "tests.learning_guard", f"--out={out}",
                      f"--fault={fault}"], capture_output=True, text=True, env=ENV,
                     timeout=900)
  assert p.returncode == 0, p.stderr[-3000:]
  return json.loads(p.stdout.strip().splitlines()[-1])


def learning_failures(r: dict) -> list[str]:
  """What a run that learned would not show (empty: it learned)."""
  s, e = r["start"], r["end"]
  out = []
  if e["accuracy"] < s["accuracy"] + 0.05:
    out.append(f"held-out accuracy {s['accuracy']:.3f} -> {e['accuracy']:.3f}: gained less "
               "than 0.05")
  if e["truncation_rate"] > 0.25 * s["truncation_rate"]:
    out.append(f"held-out truncation {s['truncation_rate']:.3f} -> {e['truncation_rate']:.3f}"
               ": did not fall to a quarter")
  return out


# Slow for now: in this tiny setup the workers' lag (1 or 2) follows timing, and under the
# other xdist worker's load a healthy run measured truncation 0.405 -> 0.175, short of the
# quarter. It goes back into `make test` once its schedule is deterministic (issue 31).
@pytest.mark.slow
def test_rl_raises_held_out_accuracy(tmp_path):
  r = learning_run(tmp_path)
  print(json.dumps({k: r[k] for k in ("start", "end", "sft_s", "rl_s")}))
  # The warm start leaves room to learn: it copies the digit, then rambles past the limit.
  assert 0.1 <= r["start"]["accuracy"] <= 0.65 and r["start"]["truncation_rate"] >= 0.3
  assert r["updates"] == 30
  assert learning_failures(r) == []


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["advantage_sign", "drop_truncated"])
def test_the_guard_catches_a_learner_bug(tmp_path, fault):
  r = learning_run(tmp_path, fault)
  print(json.dumps({k: r[k] for k in ("fault", "start", "end")}))
  assert learning_failures(r), f"the guard missed {fault}: {r['start']} -> {r['end']}"
