"""Every experiment config loads and validates (the GPU recipes too: their model paths are
not loaded here), and ablations are one-field overrides."""

import importlib
import math
import pkgutil

import pytest

import experiments.configs as configs_pkg
import fr_jax.envs
from fr_jax import config as rcfg

NAMES = [m.name for m in pkgutil.iter_modules(configs_pkg.__path__) if not m.name.startswith("_")]


def test_all_recipes_are_present():
  assert {"tiny_test", "cpu_default", "qwen25_math_1p5b", "r1_distill_1p5b_longcot",
          "qwen25_7b_tool", "alfworld_like", "qwen3_30b_a3b_tool"} <= set(NAMES)


# The figures each config's docstring states (quoted), read by hand, as (what the config
# computes, the stated value); and the schedule length validate leaves in optim.total_steps
# (max_updates, unless the config plans a longer schedule: tiny_test stops at 5 of 100).
DOCUMENTED = {
    "alfworld_like": {"B=64": (lambda c: c.batch_size, 64),
                      "200 steps": (lambda c: c.max_updates, 200),
                      "12.8k trajectories": (lambda c: c.batch_size * c.max_updates, 12_800)},
    "cpu_agent": {"40 updates of 16": (lambda c: (c.max_updates, c.batch_size), (40, 16)),
                  "0.4 per tool call": (lambda c: c.env.kwargs.tool_cost, 0.4),
                  "fixed policy lag of 2": (lambda c: c.rollout.fixed_lag, 2),
                  # base evaluation, then every eval.every updates through the last
                  "three evaluations": (lambda c: 1 + c.max_updates // c.eval.every, 3)},
    "cpu_agent_bins": {"40 updates of 16": (lambda c: (c.max_updates, c.batch_size), (40, 16)),
                       "fixed lag of 2": (lambda c: c.rollout.fixed_lag, 2),
                       "tool price 0.4": (lambda c: c.env.kwargs.tool_cost, 0.4),
                       "five difficulty": (lambda c: len(c.env.kwargs.levels.split(",")), 5),
                       "every stage evaluation is calibrated": (
                           lambda c: c.eval.calibration, True)},
    "cpu_default": {"36 updates of B=32": (lambda c: (c.max_updates, c.batch_size), (36, 32)),
                    "lr 1e-5": (lambda c: c.optim.lr, 1e-5),
                    "the `constant_length` reduction": (
                        lambda c: c.objective.reduction, "constant_length"),
                    "5-update": (lambda c: round(c.optim.warmup_frac * c.max_updates), 5),
                    "200 test problems": (lambda c: c.eval.n, 200),
                    "first 64 every 9": (lambda c: (c.eval.every_n, c.eval.every), (64, 9))},
    "cpu_lora": {"rank-16 adapters (alpha 32": (
                     lambda c: (c.model.lora.rank, c.model.lora.alpha), (16, 32.0)),
                 "so 5e-5 against the 5e-6": (lambda c: c.optim.lr, 5e-5),
                 "The reduction stays sample_mean": (
                     lambda c: c.objective.reduction, "sample_mean")},
    "qwen25_7b_tool": {"600 steps": (lambda c: c.max_updates, 600),
                       "8+ GPUs for the learner (fsdp)": (lambda c: c.mesh.fsdp >= 8, True)},
    "qwen25_7b_tool_lora": {"rank-16 adapters (alpha 32)": (
                                lambda c: (c.model.lora.rank, c.model.lora.alpha), (16, 32.0)),
                            "bfloat16 base": (lambda c: c.model.param_dtype, "bfloat16"),
                            "one H100": (lambda c: (c.mesh.data, c.mesh.fsdp), (1, 1)),
                            "10x the full recipe's": (lambda c: c.optim.lr, 1e-5)},
    "qwen3_30b_a3b_tool": {"800 steps": (lambda c: c.max_updates, 800),
                           "delta=1e-2": (lambda c: c.objective.delta, 1e-2),
                           "lag about 8": (lambda c: c.max_policy_lag, 8),
                           "102.4k rollouts (B=128 a step)": (
                               lambda c: (c.batch_size * c.max_updates, c.batch_size),
                               (102_400, 128)),
                           "fsdp over 16": (lambda c: c.mesh.fsdp, 16),
                           "router_aux_loss_coef=0": (
                               lambda c: c.objective.router_aux_loss_coef, 0.0)},
    "qwen25_math_1p5b": {"2000 steps": (lambda c: c.max_updates, 2000),
                         "data=2 x fsdp=4": (lambda c: (c.mesh.data, c.mesh.fsdp), (2, 4)),
                         "8 GPUs": (lambda c: c.mesh.data * c.mesh.fsdp, 8)},
    "r1_distill_1p5b_longcot": {"6000 async updates": (lambda c: c.max_updates, 6000),
                                "16k-token responses": (lambda c: c.agent.max_total_tokens,
                                                        16 * 1024),
                                "lag about 4": (lambda c: c.max_policy_lag, 4)},
    "tiny_test": {"5 updates": (lambda c: c.max_updates, 5)},
    "gateway_smollm2": {"Batches of 8": (lambda c: c.batch_size, 8),
                        "2 updates": (lambda c: c.max_updates, 2)},
    "tiny_moe": {"800 steps": (lambda c: c.sft.steps, 800),
                 "60 updates": (lambda c: c.max_updates, 60),
                 "batches of 8": (lambda c: c.batch_size, 8),
                 "4 workers x 16 episodes": (lambda c: (c.rollout.num_workers,
                                                        c.rollout.inflight), (4, 16)),
                 "older than 8 are dropped": (lambda c: c.max_policy_lag, 8)},
}
SCHEDULE = {"alfworld_like": 200, "cpu_agent": 40, "cpu_agent_bins": 40, "cpu_default": 36,
            "cpu_lora": 36,
            "qwen25_7b_tool": 600, "qwen25_7b_tool_lora": 600,
            "qwen25_math_1p5b": 2000, "r1_distill_1p5b_longcot": 6000, "tiny_test": 100,
            "gateway_smollm2": 2,
            "qwen3_30b_a3b_tool": 800, "tiny_moe": 60}


@pytest.mark.parametrize("name", NAMES)
def test_config_validates_and_documents_itself(name):
  mod = importlib.import_module(f"experiments.configs.{name}")
  doc = mod.__doc__ or ""
  assert "python -m launch." in doc or "make " in doc, "docstring must state the command"
  assert "Hardware" in doc and "time" in doc.lower()
  assert name in DOCUMENTED, f"add {name}'s documented figures to DOCUMENTED"
  c = rcfg.validate(mod.get_config())
  words = " ".join(doc.split())
  for figure, (computed, stated) in DOCUMENTED[name].items():
    assert figure in words, f"{name}: the docstring no longer says {figure!r}"
    assert computed(c) == stated, f"{name}: the docstring says {figure!r}"
  assert c.optim.total_steps == SCHEDULE[name]


def test_paper_recipe_numbers():
  get = lambda n: importlib.import_module(f"experiments.configs.{n}").get_config()  # noqa
  m, r, t, a = (get("qwen25_math_1p5b"), get("r1_distill_1p5b_longcot"), get("qwen25_7b_tool"),
                get("alfworld_like"))
  assert (m.objective.delta, m.batch_size) == (3e-3, 128)
  assert (r.objective.delta, r.max_policy_lag) == (5e-3, 4)
  assert t.objective.delta == 1e-3 and t.agent.max_turns > 1
  assert (a.batch_size, a.objective.delta, a.env.name) == (64, 1e-3, "textworld")
  moe = get("qwen3_30b_a3b_tool")
  assert (moe.objective.delta, moe.max_policy_lag, moe.service.lag_bound) == (1e-2, 8, 8)
  assert moe.routing_replay and moe.objective.router_aux_loss_coef == 0.0
  assert moe.model.compute_dtype == "bfloat16" and moe.rollout.engine == "sglang"
  assert "python" in fr_jax.envs.make(moe.env.name).tools and moe.agent.max_turns > 1


@pytest.mark.parametrize("field,value,error", [
    ("objective.reduction", "token_mean", None), ("objective.reduction", "sample_mean", None),
    ("objective.length_norm", -1.0, "objective.length_norm > 0"),  # the demo's constant_length
    ("objective.trust", "token", None),
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
  if field == "objective.reduction":  # the demo's constant_length: L is the longest reply
    assert c.objective.length_norm == (c.agent.max_new_tokens if value == "constant_length"
                                       else 0.0)


def test_constant_length_needs_a_positive_length_and_only_it():
  c = importlib.import_module("experiments.configs.cpu_default").get_config()
  assert c.objective.reduction == "constant_length"
  rcfg.validate(c)
  assert c.objective.length_norm == c.agent.max_new_tokens == 64  # derived: 0 means L = 64
  c = importlib.import_module("experiments.configs.cpu_default").get_config()
  c.objective.length_norm = -2.0
  with pytest.raises(rcfg.ConfigError, match="objective.length_norm > 0"):
    rcfg.validate(c)
  c.objective.reduction = "sample_mean"  # unused there
  rcfg.validate(c)
