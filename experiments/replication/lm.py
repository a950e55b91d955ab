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

The headline (`--only=headline_lm`, slow) runs `make demo`'s recipe (`cpu_default`: the base
model, no warm start, greedy held-out accuracy on 200 problems) in three arms at an equal
rollout budget: the asynchronous system exactly as `make demo` runs it (`system=True`:
`fr_jax.system.train_in_process`, the worker sampling at the config's fixed lag of 2 while the
learner updates), the same recipe synchronous (lag 0, `driver.rl_loop`), and GRPO with G = 8
siblings per prompt (synchronous, the same learning-rate schedule). Held-out evaluations every
`eval_every` updates give the accuracy curve against rollouts consumed and against training
seconds; evaluation time is not counted as training time.
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
  group_size: int = 1  # G rollouts per prompt (GRPO groups when > 1)
  loss: str = "flash_reinforce"  # or grpo
  # True: the asynchronous system as `make demo` runs it (`system.train_in_process`), the
  # worker sampling at a fixed lag of `lag`; False: `driver.rl_loop` at an exact lag.
  system: bool = False
  eval_every: int = 0  # held-out evaluations every this many updates too (0: start and end)
  schedule: int = 0  # optim.total_steps (0: `updates`): a longer one cuts a run short on it
  # Further config changes, applied last: ((dotted key, value), ...), e.g.
  # (("objective.temperature", 1.0),). Left out of the settings record when empty.
  overrides: tuple = ()

  def run_config(self, seed: int):
    c = _config(self.config)
    c.objective.advantage = self.advantage
    c.objective.loss = self.loss
    if self.system:
      c.rollout.fixed_lag = self.lag
      c.max_policy_lag = max(c.max_policy_lag, self.lag)
    c.batch_size = self.batch_size
    c.max_updates = self.updates
    c.optim.total_steps = self.schedule or self.updates
    c.env.seed = seed
    c.run_dir = c.checkpoint.dir = c.log.dir = ""
    c.log.peak_flops = 1e11  # no start-up matmul measurement
    for key, value in self.overrides:
      *path, leaf = key.split(".")
      node = c
      for part in path:
        node = getattr(node, part)
      if not hasattr(node, leaf):
        raise KeyError(f"override {key!r}: the config has no {leaf!r} under {'.'.join(path)}")
      setattr(node, leaf, value)
    # Validated as every launcher validates it (derived fields too, such as constant_length's
    # length_norm): the synchronous arm builds its Learner from this config directly.
    from fr_jax import config as rcfg
    return rcfg.validate(c)

  def run(self, seed: int, *, log: Callable[[str], None] | None = None) -> dict:
    return run(self, seed, log=log)


def _levels(r: dict) -> dict:
  out = {k: r[k] for k in ("accuracy", "tool_calls_per_trajectory", "reward",
                           "response_length", "truncation_rate") if k in r}
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
  out.mkdir(parents=True, exist_ok=True)
  if c.sft.steps:
    if log:
      log(f"  warm start: {c.sft.steps} SFT steps in {out}")
    w = warm_start(c, model, str(out), progress=False)
    model = dataclasses.replace(model, params=w.pop("params"))
  else:  # the config's base model, as `make demo` starts
    w = dict(steps=0, loss_last=None)
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
  """One arm, one seed: the curve (per update: training figures, rollouts consumed, training
  seconds), the held-out evaluations (`evals`: version, rollouts, training seconds, figures)
  and the start and end evaluations."""
  from fr_jax import envs
  t0 = time.perf_counter()
  c = s.run_config(seed)
  model, ev_start, warm = warm_model(s, log)
  env = envs.make(c.env.name, **c.env.kwargs.to_dict())
  evals = [dict(version=0, rollouts=0, wall_s=0.0, **_levels(ev_start))]

  def evaluate_at(point: dict, params):
    if s.eval_every and point["version"] % s.eval_every == 0 and point["version"] < s.updates:
      ev = _levels(_evaluate(c, s, model, params, env))
      evals.append(dict(version=point["version"], rollouts=point["rollouts"],
                        wall_s=point["wall_s"], **ev))
      if log:
        log(f"  v{point['version']}: held-out accuracy {ev['accuracy']:.3f} "
            f"({point['wall_s']:.0f} training seconds)")

  runner = _run_system if s.system else _run_driver
  r, params = runner(c, s, seed, model, env, evaluate_at, log)
  ev_end = _levels(_evaluate(c, s, model, params, env))
  last = r["curve"][-1]
  evals.append(dict(version=last["version"], rollouts=last["rollouts"],
                    wall_s=last["wall_s"], **ev_end))
  return dict(seed=seed, warm_start=warm, start=_levels(ev_start), end=ev_end,
              gain={"accuracy": ev_end["accuracy"] - ev_start["accuracy"]}, evals=evals, **r,
              wall_s=round(time.perf_counter() - t0, 2))


def _run_driver(c, s: LMSetting, seed: int, model, env, evaluate_at, log):
  """Synchronous (or exact-lag) updates: `driver.rl_loop`. The clock starts before the learner
  and the engine are built, as the system's does."""
  from fr_jax import system
  from fr_jax.learner.learner import Learner
  from fr_jax.rollout.agent import AgentLoop
  from fr_jax.rollout.embedded import EmbeddedEngine
  t0 = time.perf_counter()
  agent = system.agent_config(c)
  learner = Learner(c, model=model)
  engine = EmbeddedEngine(model.config, model.params, tokenizer=model.tokenizer,
                          num_slots=c.rollout.num_slots, max_len=agent.engine_max_len)
  loop = AgentLoop(engine, model.tokenizer, env, agent)
  setup = time.perf_counter() - t0

  def on_update(p):  # the curve's clock starts at rl_loop: add the set-up
    evaluate_at(dict(p, wall_s=round(p["wall_s"] + setup, 2)), learner.policy_params())

  r = driver.rl_loop(learner, engine, loop, env, updates=s.updates, lag=s.lag,
                     batch_size=s.batch_size, seed=seed, group_size=s.group_size,
                     params0=jax.device_get(model.params), log=log, on_update=on_update)
  for p in r["curve"]:
    p["wall_s"] = round(p["wall_s"] + setup, 2)
  r["train_wall_s"] = round(r["train_wall_s"] + setup, 2)
  params = learner.policy_params()
  learner.close()
  return r, params


def _run_system(c, s: LMSetting, seed: int, model, env, evaluate_at, log):
  """The asynchronous system, as `make demo` runs it (`system.train_in_process`). Rollouts
  consumed are the learner's (B per update); the worker's queued extra ones are not counted.
  While an evaluation runs the learner waits and the worker may fill its lag's worth of
  batches ahead (it would have anyway: the loop is learner-bound)."""
  from fr_jax import system
  curve: list = []
  clock = dict(t0=time.perf_counter(), paused=0.0)

  def on_update(m, service):
    v = service.version
    curve.append(dict(driver.curve_point(m, v), rollouts=v * s.batch_size,
                      wall_s=round(time.perf_counter() - clock["t0"] - clock["paused"], 2)))
    if log and (v % 10 == 0 or v >= s.updates):
      driver.log_point(log, curve[-1])
    t = time.perf_counter()
    evaluate_at(curve[-1], service.weights(0)[1])
    clock["paused"] += time.perf_counter() - t

  final: dict = {}
  summary = system.train_in_process(c, model=model, on_update=on_update, final=final)
  if summary.get("worker_errors"):
    raise RuntimeError(f"rollout worker failed: {summary['worker_errors'][-3:]}")
  return dict(curve=curve, prompts_covered=summary["trajectories_used"],
              rollouts=summary["trajectories_admitted"],
              train_wall_s=curve[-1]["wall_s"]), final["params"]
