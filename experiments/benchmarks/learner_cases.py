"""The learner benchmark's fixed and ragged cases (experiments/benchmarks/learner.py), also run
by the device check (experiments/device_check.py): flag-free, so both can import them."""

import numpy as np

CASES = {
    "fixed": dict(B=8, row_len=256, buckets=(8,)),
    "ragged": dict(B=16, row_len=1024, buckets=(1, 2, 3, 4, 5, 6, 7, 8)),
    # An agent's turns: a long context (prompt, earlier turns, tool output), a short action.
    "agent": dict(B=16, row_len=1024, buckets=(1, 2, 3, 4, 5, 6, 7, 8)),
}


def make_trajectories(case, vocab, rng):
  from fr_jax.trajectory import Trajectory
  out = []
  for i in range(CASES[case]["B"]):
    if case == "fixed":
      P, C = 64, 192
    elif case == "agent":
      P = int(rng.integers(300, 701))
      C = int(np.clip(rng.lognormal(np.log(48), 0.6), 8, 300))
    else:
      P = int(rng.integers(30, 121))
      C = int(np.clip(rng.lognormal(np.log(160), 0.8), 8, 900))
    mask = rng.random(C) >= 0.1
    mask[0] = True
    out.append(Trajectory(f"{case}{i}", rng.integers(0, vocab, P), rng.integers(0, vocab, C),
                          mask, np.zeros(C, np.float32), float(rng.integers(0, 2)), 0))
  return out
