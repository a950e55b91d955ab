"""The tool-use comparison on a real model (`--only=tool_use_lm`, slow): SmolLM2-135M-Instruct
on the agent demo's task (`tool_arithmetic`: easy items answered directly, hard ones needing
the tool, 0.1 reward per call), signed against positive-only advantages.

Every run starts from one supervised warm start (the agent demo's, `fr_jax.sft.warm_start`
with the `cpu_agent` config), computed once and shared by every arm and seed, so arms differ
only in the advantage. RL is the production learner (the cpu_agent config's objective,
optimiser and packing) on rollouts of the real agent loop and embedded engine, sampled at an
exact policy lag (`driver.rl_loop`). Seeds change the prompts' order and the sampling.
Held-out evaluations are the demo's: one sample per item at the training temperature (fixed
seeds), on the test split's first `eval_n` items, per difficulty.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import jax

from experiments.replication import driver


def _config(name: str):
  return importlib.import_module(f"experiments.configs.{name}").get_config()


@dataclasses.dataclass(frozen=True)
class LMSetting:
  """One arm: the config's recipe with these changes."""

  config: str = "cpu_agent"  # experiments/configs/<config>.py
  advantage: str = "batch_centered"
  updates: int = 6
  batch_size: int = 16
  lag: int = 0
  eval_n: int = 50
  minibatches: int = 1  # (the runner's log line reads these)
  group_size: int = 1

  def run_config(self, seed: int):
    c = _config(self.config)
    c.objective.advantage = self.advantage
    c.batch_size = self.batch_size
    c.max_updates = c.optim.total_steps = self.updates
    c.env.seed = seed
    c.run_dir = c.checkpoint.dir = c.log.dir = ""
    c.log.peak_flops = 1e11  # no start-up matmul measurement
    return c

  def run(self, seed: int, *, log: Callable[[str], None] | None = None) -> dict:
    return run(self, seed, log=log)


def _levels(r: dict) -> dict:
  out = {"accuracy": r["accuracy"], "tool_calls_per_trajectory": r["tool_calls_per_trajectory"],
         "reward": r["reward"]}
  for lv, x in r.get("by_level", {}).items():
    out[f"{lv}_accuracy"] = x["accuracy"]
    out[f"{lv}_tool_calls"] = x["tool_calls_per_trajectory"]
  return out


def _evaluate(c, s: LMSetting, model, params, env) -> dict:
  """The config's held-out evaluation (the agent demo's: one sample per item at
  eval.temperature, fixed seeds) on the first eval_n test items."""
  from fr_jax import system
  from fr_jax.evaluate import evaluate
  t = c.eval.temperature
  return evaluate(model.config, params, model.tokenizer, env, system.agent_config(c),
                  n=s.eval_n, num_slots=c.eval.num_slots, greedy=t == 0,
                  temperature=t or 1.0)


_WARM: dict = {}


def warm_model(s: LMSetting, log=None):
  """The shared warm start: (model with the SFT parameters, greedy held-out evaluation of it),
  kept in this process and under driver.CACHE_DIR (or computed in a temporary folder)."""
  import tempfile

  from fr_jax import envs
  from fr_jax.models import registry
  from fr_jax.sft import warm_start
  c = s.run_config(0)
  key = f"lm-{s.config}"
  if key in _WARM:
    return _WARM[key]
  root = Path(driver.CACHE_DIR) if driver.CACHE_DIR else Path(tempfile.mkdtemp())
  out = root / key
  model = registry.load_configured(c.model)
  if log:
    log(f"  warm start: {c.sft.steps} SFT steps in {out}")
  w = warm_start(c, model, str(out), progress=False)
  model = dataclasses.replace(model, params=w.pop("params"))
  path = out / f"eval_start_n{s.eval_n}_t{c.eval.temperature:g}.json"
  if path.exists():
    ev = json.loads(path.read_text())
  else:
    env = envs.make(c.env.name, **c.env.kwargs.to_dict())
    ev = _evaluate(c, s, model, model.params, env)
    path.write_text(json.dumps(ev))
  _WARM[key] = (model, ev, {k: w[k] for k in ("steps", "loss_last")})
  return _WARM[key]


def run(s: LMSetting, seed: int, *, log: Callable[[str], None] | None = None) -> dict:
  from fr_jax import envs, system
  from fr_jax.learner.learner import Learner
  from fr_jax.rollout.agent import AgentLoop
  from fr_jax.rollout.embedded import EmbeddedEngine
  t0 = time.perf_counter()
  c = s.run_config(seed)
  model, ev_start, warm = warm_model(s, log)
  env = envs.make(c.env.name, **c.env.kwargs.to_dict())
  agent = system.agent_config(c)
  learner = Learner(c, model=model)
  engine = EmbeddedEngine(model.config, model.params, tokenizer=model.tokenizer,
                          num_slots=c.rollout.num_slots, max_len=agent.engine_max_len)
  loop = AgentLoop(engine, model.tokenizer, env, agent)
  r = driver.rl_loop(learner, engine, loop, env, updates=s.updates, lag=s.lag,
                     batch_size=s.batch_size, seed=seed,
                     params0=jax.device_get(model.params), log=log)
  ev_end = _evaluate(c, s, model, learner.params, env)
  learner.close()
  return dict(seed=seed, warm_start=warm, start=_levels(ev_start), end=_levels(ev_end), **r,
              wall_s=round(time.perf_counter() - t0, 2))
