"""Shared by the learner-service tests: the tiny_test run config and synthetic records whose
ids follow the `producer/seq` rule."""

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
