"""Deterministic synthetic trajectories, served by a grain dataset.

For learner tests, benchmarks and smoke runs where no rollout engine is involved. Trajectory
`i` is a pure function of (seed, i): its lengths, tokens, action mask (with tool-output spans
that are not actions), behaviour log-probs and 0/1 reward. The grain iterator's state is what
a checkpoint saves to resume the stream exactly.
"""

from __future__ import annotations

import grain
import numpy as np

from fr_jax.trajectory import Trajectory


def synthetic_trajectory(index: int, *, seed: int = 0, vocab_size: int = 256,
                         prompt_len=(4, 16), median_completion: float = 24.0,
                         sigma: float = 0.6, max_len: int = 128, version: int = 0,
                         fixed_completion: int = 0) -> Trajectory:
  """Trajectory `index` of the stream `seed` (lognormal completion lengths, capped)."""
  rng = np.random.default_rng([seed, index])
  P = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
  if fixed_completion:
    C = fixed_completion
  else:
    C = int(np.clip(rng.lognormal(np.log(median_completion), sigma), 2, max_len - P))
  mask = np.ones(C, bool)
  if C > 8:  # one tool-output span in the middle: not actions, log-prob 0
    a = int(rng.integers(2, C // 2))
    mask[a:a + int(rng.integers(1, C // 4 + 1))] = False
  blogp = np.where(mask, np.log(rng.uniform(0.05, 1.0, C)), 0.0).astype(np.float32)
  return Trajectory(
      prompt_id=f"s{seed}-{index}", prompt_tokens=rng.integers(0, vocab_size, P, np.int32),
      completion_tokens=rng.integers(0, vocab_size, C, np.int32), action_mask=mask,
      behavior_logp=blogp, reward=float(rng.integers(0, 2)), policy_version=version,
      finish_reason="stop", env="synthetic")


def dataset(seed: int = 0, size: int = 1 << 20, **kw) -> grain.MapDataset:
  """Shuffled, endlessly repeated synthetic trajectories (a grain MapDataset)."""
  return (grain.MapDataset.range(size).shuffle(seed=seed).repeat(None)
          .map(lambda i: synthetic_trajectory(int(i), seed=seed, **kw)))


def take(iterator, n: int) -> list[Trajectory]:
  return [next(iterator) for _ in range(n)]
