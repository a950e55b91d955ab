"""Every experiment config loads and validates (the GPU recipes too: their model paths are
not loaded here), and ablations are one-field overrides."""

import importlib
import math
import pkgutil

import pytest

import experiments.configs as configs_pkg
from fr_jax import config as rcfg

NAMES = [m.name for m in pkgutil.iter_modules(configs_pkg.__path__) if not m.name.startswith("_")]


def test_all_recipes_are_present():
  assert {"tiny_test", "cpu_default", "qwen25_math_1p5b", "r1_distill_1p5b_longcot",
          "qwen25_7b_tool", "alfworld_like"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_config_validates_and_documents_itself(name):
  mod = importlib.import_module(f"experiments.configs.{name}")
  doc = mod.__doc__ or ""
  assert "python -m launch." in doc or "make " in doc, "docstring must state the command"
  assert "Hardware" in doc and "time" in doc.lower()
  c = rcfg.validate(mod.get_config())
  assert c.batch_size >= 1


def test_paper_recipe_numbers():
  get = lambda n: importlib.import_module(f"experiments.configs.{n}").get_config()  # noqa
  m, r, t, a = (get("qwen25_math_1p5b"), get("r1_distill_1p5b_longcot"), get("qwen25_7b_tool"),
                get("alfworld_like"))
  assert (m.objective.delta, m.batch_size) == (3e-3, 128)
  assert (r.objective.delta, r.max_policy_lag) == (5e-3, 4)
  assert t.objective.delta == 1e-3 and t.agent.max_turns > 1
  assert (a.batch_size, a.objective.delta, a.env.name) == (64, 1e-3, "textworld")


@pytest.mark.parametrize("field,value,error", [
    ("objective.reduction", "token_mean", None), ("objective.trust", "token", None),
    ("objective.trust", "none", None), ("objective.advantage", "positive_only", None),
    ("objective.delta", math.inf, None), ("minibatches", 4, None), ("objective.loss", "grpo", None),
    ("objective.trust", "bogus", "objective.trust"), ("rollout.engine", "vllm", "rollout.engine"),
    ("agent.max_total_tokens", 10**6, "row_len"), ("model.attention", "flash", None),
    ("model.attention", "cudnn", "model.attention='cudnn'")])
def test_ablations_are_one_field(field, value, error):
  c = importlib.import_module("experiments.configs.cpu_default").get_config()
  c.update_from_flattened_dict({field: value})
  if field == "minibatches":
    c.service.queue_capacity = 4 * c.batch_size
  if error is None:
    rcfg.validate(c)
  else:
    with pytest.raises(rcfg.ConfigError, match=error):
      rcfg.validate(c)
