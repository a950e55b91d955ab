"""The learning guard's run (tests/test_learning.py), in a process of its own: a tiny model
learns, through the production path, a task it learns in about a minute.

  python -m tests.learning_guard --out=/tmp/guard [--fault=advantage_sign|drop_truncated]

The task is `digits` (copy): the prompt "key: abcd 7" asks for its digit, and an episode cut
by the token limit earns 0. The warm start (`fr_jax.sft.warm_start`, the production SFT, on a
JSONL file written here as a user's would be) shows the digit first; in half of the
conversations a run of letters follows it, longer than the turn's 8 tokens. The warm-started
model therefore copies the digit (not always the right one) and then rambles about half of
the time: about 52% of held-out episodes are right, about 40% are cut. RL (40 updates of
`system.train_in_process`: the embedded engine, the agent loop, the learner service, the
packed learner and the objective, lr 1e-3 decaying to 1e-4) then has two things to learn,
each visible in the held-out evaluation: stop after the digit (truncation falls) and copy
the right digit.

The worker runs at `rollout.fixed_lag=1`: batch k is sampled with version k-1 (batch 0 with
version 0), waiting for it if it must. Which samples land in which batch, under which
weights, then does not depend on timing, so a run is the same on a quiet machine and under
the rest of `make test` (a free-running worker's lag here follows timing, and with it what
the run learns). Different CPUs can still round differently and draw other samples.

`--fault` injects a learner bug after the warm start, in this process only, for the test
that shows the guard can fail:
* `advantage_sign`: the objective's advantages with the wrong sign (rewards negated before
  the batch mean, so A_i becomes -(R_i - mean R));
* `drop_truncated`: truncated trajectories lose their zero reward: each update gives them
  the mean reward of the others, so their advantage is 0, as if they were left out.

Prints one JSON line: the held-out evaluation before and after RL (sampled at temperature 1,
200 tasks, fixed seeds), the per-update training curve and the seconds spent.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import time

from absl import app, flags

flags.DEFINE_string("out", "", "run directory (required)")
flags.DEFINE_enum("fault", "", ["", "advantage_sign", "drop_truncated"], "learner bug to inject")
flags.DEFINE_integer("updates", 40, "RL updates")
flags.DEFINE_integer("seed", 0, "model init, demonstrations, prompts and sampling")
flags.DEFINE_integer("rl_seed", -1, "env.seed (RL prompts and sampling) if >= 0, else --seed")
flags.DEFINE_multi_string("set", [], "RL config overrides, FIELD=VALUE (Python literals)")
flags.DEFINE_integer("fixed_lag", 1, "rollout.fixed_lag (-1: the lag follows timing)")
F = flags.FLAGS

EVAL_N = 200
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def config(run_dir: str, updates: int, seed: int, fixed_lag: int = 1):
  from fr_jax import config as rcfg
  c = rcfg.default_config()
  c.run_dir = run_dir
  c.model.name = "tiny-chat"
  c.model.seed = seed
  c.model.remat = False
  c.env.name = "digits"
  c.env.kwargs.tool = False
  c.env.seed = seed
  c.agent.max_turns = 1
  c.agent.max_new_tokens = 8
  c.agent.max_total_tokens = 48
  c.sft.steps = 300
  c.sft.batch_size = 32
  c.sft.lr = 3e-3
  c.sft.checkpoint_every = 10_000
  c.sft.data = os.path.join(run_dir, "demonstrations.jsonl")
  c.batch_size = 16
  c.max_updates = updates
  c.optim.lr = 1e-3
  c.optim.warmup_frac = 0.0
  c.optim.min_lr_ratio = 0.1  # cosine to 1e-4: at a constant 1e-3 a run can unlearn late
  c.objective.delta = 0.1  # a tiny model moves far per update (docs/replication.md)
  c.objective.temperature = 1.0
  c.max_policy_lag = 2
  c.packing.row_len = 256
  c.packing.row_buckets = (1, 2)
  c.rollout.num_workers = 1
  c.rollout.fixed_lag = fixed_lag
  c.rollout.inflight = 16
  c.rollout.num_slots = 16
  c.service.queue_capacity = 16
  c.checkpoint.every = 10_000
  c.checkpoint.async_save = False
  c.log.peak_flops = 1e11  # skip the start-up matmul measurement
  return rcfg.validate(c)


def demonstrations(n: int, seed: int) -> list[list[dict]]:
  """Conversations: the digit first; in half of them, 10 letters after it (past the limit)."""
  import numpy as np

  from fr_jax import envs
  env = envs.make("digits", tool=False)
  rng = np.random.default_rng([seed, 31])
  out = []
  for _ in range(n):
    task = env.task("train", int(rng.integers(env.split_size("train"))))
    tail = "".join(LETTERS[i] for i in rng.integers(0, 26, 10)) if rng.random() < 0.5 else ""
    out.append([{"role": "user", "content": task.prompt},
                {"role": "assistant", "content": f"{task.answer} {tail}".strip()}])
  return out


def inject(fault: str) -> None:
  """Patches the learner with `fault` (this process only)."""
  if fault == "advantage_sign":
    from fr_jax import objective
    reinforce = objective._reinforce

    def negated(layout, logp, behavior_logp, rewards_N, *args, **kwargs):
      return reinforce(layout, logp, behavior_logp, -rewards_N, *args, **kwargs)

    objective._reinforce = negated
  elif fault == "drop_truncated":
    import numpy as np

    from fr_jax.learner.learner import Learner
    update = Learner.update

    def without_truncated_zeros(self, trajs, **kwargs):
      done = [t.reward for t in trajs if not t.truncated]
      mean = float(np.mean(done)) if done else 0.0
      return update(self, [dataclasses.replace(t, reward=mean) if t.truncated else t
                           for t in trajs], **kwargs)

    Learner.update = without_truncated_zeros


def main(argv):
  del argv
  if not F.out:
    raise app.UsageError("--out is required")
  from fr_jax import config as rcfg
  from fr_jax import envs, sft, system
  from fr_jax.evaluate import evaluate
  from fr_jax.models import registry
  from fr_jax.sft import warm_start
  t0 = time.perf_counter()
  os.makedirs(F.out, exist_ok=True)
  c = config(F.out, F.updates, F.seed, F.fixed_lag)
  if F.rl_seed >= 0:
    c.env.seed = F.rl_seed
  for kv in F.set:
    k, v = kv.split("=", 1)
    c.update_from_flattened_dict({k: ast.literal_eval(v)})
  c = rcfg.validate(c)
  sft.write_jsonl(c.sft.data, demonstrations(2000, F.seed))
  model = registry.load_configured(c.model)
  # The warm start takes the run's schedule shape (optim.min_lr_ratio) with sft.lr: keep its
  # lr constant after the warm-up, as the guard was measured with.
  sc = c.copy_and_resolve_references()
  sc.optim.min_lr_ratio = 1.0
  warm = warm_start(sc, model, os.path.join(F.out, "sft"), progress=False)
  model = dataclasses.replace(model, params=warm.pop("params"))
  env = envs.make(c.env.name, **c.env.kwargs.to_dict())
  keys = ("accuracy", "truncation_rate", "response_length")

  def held_out(params):
    r = evaluate(model.config, params, model.tokenizer, env, system.agent_config(c), n=EVAL_N,
                 greedy=False, temperature=1.0, num_slots=64, seed=F.seed)
    return {k: r[k] for k in keys}

  start = held_out(model.params)
  t_rl = time.perf_counter()
  inject(F.fault)
  final: dict = {}
  summary = system.train_in_process(c, model=model, final=final)
  end = held_out(final["params"])
  from fr_jax.learner.metrics import read_jsonl
  curve = [{k: round(r[k], 4) for k in ("step", "reward_mean", "acceptance_rate",
                                         "truncation_rate", "response_length",
                                         "policy_lag_mean")}
           for r in read_jsonl(os.path.join(F.out, "metrics.jsonl")) if "reward_mean" in r]
  print(json.dumps(dict(fault=F.fault, seed=F.seed, start=start, end=end,
                        updates=summary["updates"], curve=curve,
                        sft_s=round(t_rl - t0, 1),
                        rl_s=round(time.perf_counter() - t_rl, 1))), flush=True)


if __name__ == "__main__":
  app.run(main)
