"""One replication run: a warm-started tiny model, then N updates of the real learner on
rollouts of the real agent loop and embedded engine, with the policy lag set exactly.

Why not the threaded asynchronous system (`fr_jax.system`)? There, thread timing decides
which policy version sampled each trajectory, so lag is whatever the run produced and two arms
never see the same lag. Here rollouts for update t are sampled by the snapshot of version
max(0, t - lag) (kept on the host), so "lag 4" means every trajectory is exactly 4 versions
old: the same staleness the asynchronous pipeline produces at an in-flight depth of ~4
batches, made repeatable. Everything else (packing, the jitted step, the objective, the gate,
AdamW, the agent loop, the engine's behaviour log-probs) is the production code.

Warm start: a tiny random model cannot earn reward on anything, and the paper starts from
instruct models that know the format. `warm_start` fine-tunes the random model with the
production warm start (`fr_jax.sft.warm_start`) on demonstrations (`Digits.demonstration`:
random filler lengths, some past the token limit; the tool called in a set share of them)
until it can copy a digit it sees, so RL starts from a model that
answers ~50-75% of held-out tasks and has length and tool-use habits to change. The warm
start is deterministic per (setting, seed) and shared by the arms of a comparison, so arms
differ only in what the comparison varies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fr_jax import config as rcfg
from fr_jax import objective as obj
from fr_jax import sft
from fr_jax.envs.base import prompt_dataset
from fr_jax.envs.digits import Digits
from fr_jax.evaluate import evaluate
from fr_jax.learner import config as lcfg
from fr_jax.learner.learner import Learner
from fr_jax.models import decoder, registry
from fr_jax.rollout.agent import AgentConfig, AgentLoop
from fr_jax.rollout.embedded import EmbeddedEngine
from fr_jax.trajectory import validate

MODEL = "tiny-chat"


def load_model(seed: int, width: int):
  """tiny-chat (byte-level tokenizer, 2 layers) at hidden size `width`, random init."""
  m = registry.load(MODEL, seed=seed)
  if width == m.config.hidden_size:
    return m
  cfg = m.config.replace(hidden_size=width, intermediate_size=2 * width,
                         head_dim=width // m.config.num_heads)
  return dataclasses.replace(m, config=cfg,
                             params=decoder.init_params(cfg, jax.random.key(seed)))


@dataclasses.dataclass(frozen=True)
class Setting:
  """Everything one arm of a comparison fixes."""

  tool: bool = False  # Digits(tool=...): lookup task with a tool, or copy task
  updates: int = 60  # optimizer steps
  batch_size: int = 16  # B trajectories per step
  group_size: int = 1  # G rollouts per prompt (GRPO groups when > 1)
  minibatches: int = 1  # k > 1: sample k*B at once, then k consecutive steps
  lag: int = 0  # every rollout is sampled by the policy `lag` versions old
  loss: str = "flash_reinforce"  # or grpo
  reduction: str = "sample_mean"
  trust: str = "sequence"
  advantage: str = "batch_centered"
  delta: float = obj.DELTA
  lr: float = 1e-3
  temperature: float = 1.0
  max_turns: int = 1
  max_new_tokens: int = 10
  eval_n: int = 200
  width: int = 64  # model hidden size
  # warm start
  sft_steps: int = 600  # at least this many supervised steps ...
  sft_max_steps: int = 3000  # ... and then more, 200 at a time, until the model copies:
  copy_check: float = 0.8  # greedy copy-task accuracy among finished episodes (0: no check)
  sft_batch: int = 32
  sft_lr: float = 3e-3
  tool_rate: float = 0.5
  correct_rate: float = 1.0
  max_filler: int = 10
  copy_mix: float = 0.0  # tool task: fraction of warm-start demos drawn from the copy task

  def agent(self, temperature: float | None = None) -> AgentConfig:
    return AgentConfig(max_turns=self.max_turns, max_new_tokens=self.max_new_tokens,
                       max_total_tokens=self.max_total_tokens,
                       temperature=self.temperature if temperature is None else temperature,
                       template="chatml")

  @property
  def max_total_tokens(self) -> int:
    return 32 + self.max_turns * (self.max_new_tokens + 24)

  def env(self) -> Digits:
    return Digits(tool=self.tool)

  def warm_key(self) -> tuple:
    return (self.width, self.tool, self.max_turns, self.max_new_tokens, self.sft_steps,
            self.sft_max_steps, self.copy_check, self.sft_batch, self.sft_lr, self.tool_rate,
            self.correct_rate, self.max_filler, self.copy_mix)


# --- warm start -------------------------------------------------------------------------------

def demonstrations(setting: Setting, seed: int) -> list[list[dict]]:
  """The warm start's conversations: sft_steps * sft_batch demonstrations
  (`Digits.demonstration`) of random train tasks, each calling the tool with probability
  tool_rate. The tool task's can mix in copy demonstrations (`copy_mix`): copying a digit from
  the context is then a skill the model has, and calling the tool is what puts the digit
  there."""
  rng = np.random.default_rng([seed, 404])
  envs = (setting.env(), Digits(tool=False))
  out = []
  for i in rng.integers(0, envs[0].split_size("train"), setting.sft_steps * setting.sft_batch):
    env = envs[bool(rng.random() < setting.copy_mix)]
    out.append(env.demonstration(env.task("train", int(i)), bool(rng.random() < setting.tool_rate),
                                 correct_rate=setting.correct_rate,
                                 max_filler=setting.max_filler))
  return out


def sft_config(setting: Setting, seed: int, data: str):
  """The warm start's run config (`fr_jax.sft.warm_start`): AdamW at a constant sft_lr without
  weight decay or clipping, every assistant token weighed the same, one checkpoint at the
  end."""
  c = rcfg.default_config()
  c.model.remat, c.model.seed = False, seed
  c.agent.template = "chatml"
  s = c.sft
  s.steps = setting.sft_max_steps if setting.copy_check > 0 else setting.sft_steps
  s.data, s.batch_size, s.lr, s.warmup_frac = data, setting.sft_batch, setting.sft_lr, 0.0
  s.seed = seed
  s.reduction, s.checkpoint_every = "token_mean", s.steps
  c.optim.min_lr_ratio, c.optim.weight_decay = 1.0, 0.0
  c.optim.clip_norm = float("inf")  # no clipping
  c.checkpoint.async_save = False
  c.packing.row_len = 128  # a demonstration has at most ~105 tokens; short rows are faster here
  c.packing.row_buckets = (1, 2, 4, 8, 12, 16, 24, 32)
  c.log.peak_flops = 1e11  # no start-up matmul measurement
  return c


_WARM: dict = {}
CACHE_DIR: str | None = None  # if set, warm starts are kept there (the runner resumes them)


def warm_start(setting: Setting, seed: int):
  """(host params, info) of the warm-started model for (setting's warm-start fields, seed),
  kept in this process and, when CACHE_DIR is set, found there again by a later process.
  info: supervised steps taken and the copy skill reached."""
  key = (setting.warm_key(), seed)
  if key in _WARM:
    return _WARM[key]
  if CACHE_DIR:
    digest = hashlib.sha1(repr(key).encode()).hexdigest()[:16]
    _WARM[key] = _warm_start(setting, seed, Path(CACHE_DIR) / f"warm-{digest}")
  else:  # its checkpoint and export are not kept
    with tempfile.TemporaryDirectory(prefix="fr_jax_warm-") as d:
      _WARM[key] = _warm_start(setting, seed, Path(d))
  return _WARM[key]


def _warm_start(setting: Setting, seed: int, out: Path):
  """The production warm start (`fr_jax.sft.warm_start`) on `demonstrations`: at least sft_steps
  steps, then more, checked every 200, until the model copies (copy_check) or sft_max_steps."""
  model = load_model(seed, setting.width)
  copy = dataclasses.replace(setting, tool=False)
  out.mkdir(parents=True, exist_ok=True)
  data = out / "demonstrations.jsonl"
  if not data.exists():
    sft.write_jsonl(data, demonstrations(setting, seed))

  def copies(step, params):
    # Copying a digit from the context is learned suddenly, after a seed-dependent number of
    # steps; a warm start that has not got there would make its seed a different experiment.
    return (step >= setting.sft_steps and (step - setting.sft_steps) % 200 == 0
            and copy_skill(model.config, params, model.tokenizer, copy) >= setting.copy_check)

  w = sft.warm_start(sft_config(setting, seed, str(data)), model, str(out), progress=False,
                     done_when=copies if setting.copy_check > 0 else None)
  params = jax.device_get(w["params"])
  skill = (copy_skill(model.config, params, model.tokenizer, copy)
           if setting.copy_check > 0 else None)
  return params, dict(steps=w["steps"], copy_skill=skill)


def copy_skill(cfg, params, tok, copy: Setting, n: int = 64) -> float:
  """Greedy accuracy on n copy-task test episodes that ended before the token limit."""
  env = copy.env()
  engine = EmbeddedEngine(cfg, params, tokenizer=tok, num_slots=n,
                          max_len=copy.agent().engine_max_len)
  loop = AgentLoop(engine, tok, env, copy.agent(temperature=0.0))
  trajs, _ = loop.run([env.task("test", i) for i in range(n)], list(range(n)))
  done = [t for t in trajs if not t.truncated]
  return sum(t.reward for t in done) / max(1, len(done))


# --- one run ----------------------------------------------------------------------------------

def learner_config(s: Setting, seed: int):
  c = lcfg.default_config()
  c.model.name = MODEL
  c.model.remat = False
  c.model.seed = seed
  c.batch_size = s.batch_size
  c.minibatches = s.minibatches
  o = c.objective
  o.loss, o.reduction, o.trust, o.advantage = s.loss, s.reduction, s.trust, s.advantage
  o.delta = float(s.delta)
  o.temperature = s.temperature
  c.optim.lr = s.lr
  c.optim.warmup_frac = 0.0
  c.optim.min_lr_ratio = 1.0  # constant learning rate: arms with different step counts match
  c.optim.total_steps = max(1, s.updates)
  c.packing.row_len = 256
  c.packing.row_buckets = (1, 2, 4, 8, 16, 32)
  c.log.peak_flops = 1e11  # no start-up matmul measurement
  return c


def _eval(s: Setting, model_cfg, params, tok) -> dict:
  """Held-out test tasks, two samples each at the training temperature (greedy decoding
  hides what sampling does, and RL changes the sampling distribution)."""
  r = evaluate(model_cfg, params, tok, s.env(), s.agent(), n=s.eval_n, samples=2,
               temperature=s.temperature, num_slots=64)
  out = {k: r[k] for k in ("tool_calls_per_trajectory", "response_length", "truncation_rate")}
  out["accuracy"] = r["avg@2"]
  return out


# The learner's per-record diagnostics kept in each curve point (the mechanism plots of
# `experiments.replication.mechanism`): the gate by length and advantage sign, the stop
# token's log-prob, the Bernoulli KL by behaviour probability.
DIAGNOSTIC_PREFIXES = ("gate/", "eos/", "d_by_p/")


def open_results(out: str, empty: dict) -> tuple:
  """A replication output directory: created, warm starts cached under it, and its
  results.json read (or `empty`). Returns (path of results.json, results)."""
  global CACHE_DIR
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  CACHE_DIR = str(out / "warm")
  path = out / "results.json"
  return path, (json.loads(path.read_text()) if path.exists() else empty)


def save_json(results: dict, path) -> None:
  """results.json written whole or not at all (a temporary file, then a rename)."""
  path = Path(path)
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(results, separators=(",", ":"), default=float))
  tmp.replace(path)


def curve_point(m: dict, version: int) -> dict:
  """One update's training figures, from the learner's metrics."""
  return dict(version=version, reward=m["reward_mean"], acceptance=m["acceptance_rate"],
              entropy=m["entropy"], kl_proxy_mean=m["kl_proxy_mean"],
              kl_proxy_max=m["kl_proxy_max"], ratio_max=m["ratio_max"],
              length=m["response_length"], truncation=m["truncation_rate"],
              tool_calls=m["tool_calls"], policy_lag=m["policy_lag_mean"], finite=m["finite"],
              token_kl=m["token_kl_mean"], grad_norm=m["grad_norm"],
              **{k: v for k, v in m.items() if k.startswith(DIAGNOSTIC_PREFIXES)})


def log_point(log: Callable[[str], None], p: dict):
  log(f"  v{p['version']}: reward {p['reward']:.2f} acceptance {p['acceptance']:.2f} entropy "
      f"{p['entropy']:.2f} length {p['length']:.1f} tool calls {p['tool_calls']:.2f}")


def rl_loop(learner, engine, loop, env, *, updates: int, lag: int, batch_size: int,
            seed: int, minibatches: int = 1, group_size: int = 1, params0=None,
            log: Callable[[str], None] | None = None,
            on_update: Callable[[int], None] | None = None) -> dict:
  """Updates `learner` to version `updates` on rollouts sampled at an exact policy lag: the
  rollouts for update t come from the snapshot of version max(0, t - lag). Returns the
  per-update curve (with the rollouts consumed and the training seconds so far), the prompts
  covered, the rollouts made and the training seconds. `on_update(point)` runs after each
  update with its curve point (a held-out evaluation); its time is not counted as training
  time."""
  t_train = time.perf_counter()
  paused = 0.0
  snapshots = {0: jax.device_get(learner.policy_params()) if params0 is None else params0}
  prompts = iter(prompt_dataset(env, "train", seed=seed))
  covered: set = set()
  curve = []
  n_prompts = batch_size * minibatches // group_size
  rollouts = 0
  while learner.version < updates:
    v = learner.version
    vb = max(0, v - lag)
    engine.update_weights(snapshots[vb], vb)
    tasks = [next(prompts) for _ in range(n_prompts)]
    covered.update(t.task_id for t in tasks)
    tasks = [t for t in tasks for _ in range(group_size)]
    seeds = [(seed * 1_000_003 + v * 4099 + i) % 2**31 for i in range(len(tasks))]
    trajs, _ = loop.run(tasks, seeds)
    for i, t in enumerate(trajs):
      t.traj_id = f"{t.traj_id}@{v}.{i}"
      validate(t, **learner.record_limits)  # this loop's admission
    rollouts += len(trajs)
    m = learner.update(trajs, log_ids=False)
    snapshots[learner.version] = jax.device_get(learner.policy_params())
    for old in [k for k in snapshots if k < learner.version - lag]:
      del snapshots[old]
    curve.append(dict(curve_point(m, learner.version), rollouts=rollouts,
                      wall_s=round(time.perf_counter() - t_train - paused, 2)))
    if log and (learner.version % 10 == 0 or learner.version >= updates):
      log_point(log, curve[-1])
    if on_update is not None:
      t0 = time.perf_counter()
      on_update(curve[-1])
      paused += time.perf_counter() - t0
  return dict(curve=curve, prompts_covered=len(covered), rollouts=rollouts,
              train_wall_s=round(time.perf_counter() - t_train - paused, 2))


def run(s: Setting, seed: int, *, log: Callable[[str], None] | None = None) -> dict:
  """One arm, one seed. Returns the per-update curve and the held-out evaluations."""
  t0 = time.perf_counter()
  model = load_model(seed, s.width)
  params0, warm = warm_start(s, seed)
  model = dataclasses.replace(model, params=jax.tree.map(jnp.asarray, params0))
  tok, cfg = model.tokenizer, model.config
  learner = Learner(learner_config(s, seed), model=model)
  env = s.env()
  engine = EmbeddedEngine(cfg, model.params, tokenizer=tok, num_slots=64,
                          max_len=s.agent().engine_max_len)
  loop = AgentLoop(engine, tok, env, s.agent())
  start = _eval(s, cfg, model.params, tok)
  r = rl_loop(learner, engine, loop, env, updates=s.updates, lag=s.lag,
              batch_size=s.batch_size, seed=seed, minibatches=s.minibatches,
              group_size=s.group_size, params0=params0, log=log)
  end = _eval(s, cfg, learner.policy_params(), tok)
  learner.close()
  return dict(seed=seed, warm_start=warm, start=start, end=end, **r,
              wall_s=round(time.perf_counter() - t0, 2))
