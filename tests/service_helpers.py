"""Shared by the learner-service tests: the tiny_test run config, synthetic records whose
ids follow the `producer/seq` rule, and routing-replay data for them."""

import numpy as np

from fr_jax.learner.synthetic import synthetic_trajectory


def cfg(run_dir=None, **over):
  """tiny_test's config with `run_dir` and flattened overrides ({"service.x": 1, ...})."""
  from experiments.configs import tiny_test
  c = tiny_test.get_config()
  c.run_dir = str(run_dir) if run_dir else ""
  c.update_from_flattened_dict(over)
  return c


def synth(i, version=0, producer="w/n", **kw):
  """Synthetic record `i` (tokens below tiny-chat's vocabulary), id `producer/i`."""
  t = synthetic_trajectory(i, seed=5, vocab_size=259, version=version, **kw)
  t.traj_id = f"{producer}/{i}"
  return t


def with_routing(t, layers=2, k=3, num_experts=40, dtype=np.int8, seed=0):
  """`t` carrying valid routed_experts [length - 1, layers, k] (k distinct experts per
  position and layer, as a router picks them), in `dtype`."""
  rng = np.random.default_rng(seed)
  scores = rng.random((t.length - 1, layers, num_experts))
  t.routed_experts = np.argsort(scores, axis=-1)[..., :k].astype(dtype)
  return t
