"""One owner per config check: one ConfigError, validation once at load (and again only for a
config changed since), `optim.total_steps` derived from `max_updates`, and the tool's sandbox
limits taken from the config."""

import pytest

from experiments.configs import cpu_default, tiny_test
from fr_jax import config as rcfg
from fr_jax import system
from fr_jax.envs.sandbox import Limits
from fr_jax.learner import config as lcfg
from fr_jax.models import config as mcfg


def test_one_config_error_class():
  assert rcfg.ConfigError is lcfg.ConfigError is mcfg.ConfigError
  c = cpu_default.get_config()
  c.model.attention = "fast"  # checked by the models' own check, raised as the one class
  with pytest.raises(rcfg.ConfigError, match="model.attention='fast'"):
    rcfg.validate(c)


def test_validated_once_unless_changed():
  c = rcfg.validate(cpu_default.get_config())
  calls = []

  def counting(cfg):
    calls.append(1)
    return rcfg.validate(cfg)

  # What the Learner and build_service do with a config loaded by a launch command.
  assert lcfg.ensure_valid(c, counting) is c and lcfg.ensure_valid(c) is c
  assert calls == []
  c.batch_size = 0  # changed after validation: checked again, and refused
  with pytest.raises(rcfg.ConfigError, match="batch_size=0"):
    lcfg.ensure_valid(c, counting)
  assert calls == [1]
  # A config that was never validated is validated (a learner-only config: learner checks).
  fresh = lcfg.default_config()
  fresh.objective.trust = "seq"
  with pytest.raises(lcfg.ConfigError, match="objective.trust='seq'"):
    lcfg.ensure_valid(fresh)


def test_total_steps_derived_from_max_updates_unless_set():
  c = cpu_default.get_config()
  assert c.optim.total_steps == 0  # unset in the recipe
  c.max_updates = 37
  assert rcfg.validate(c).optim.total_steps == 37
  t = rcfg.validate(tiny_test.get_config())
  assert (t.max_updates, t.optim.total_steps) == (5, 100)  # set explicitly: kept
  c = cpu_default.get_config()
  c.optim.total_steps = -3
  with pytest.raises(rcfg.ConfigError, match="total_steps"):
    rcfg.validate(c)


def test_tool_limits_come_from_the_config():
  c = cpu_default.get_config()
  c.agent.tool_limits.wall_seconds = 3.5
  c.agent.tool_limits.memory_bytes = 2**28
  c.agent.allow_limits_only = True
  got = system.agent_config(rcfg.validate(c)).tool_limits
  assert got == Limits(wall_seconds=3.5, memory_bytes=2**28, allow_limits_only=True)
  assert got.cpu_seconds == 5 and got.max_code_bytes == 256 * 1024  # Limits' own defaults
  c.agent.tool_limits.cpu_seconds = 0
  with pytest.raises(rcfg.ConfigError, match="cpu_seconds"):
    rcfg.validate(c)
