"""Held-out evaluation: the agent loop on a fixed test split, greedy or sampled.

`evaluate()` runs every task of the first `n` in the env's test split through the same agent
loop training uses (chat template, tool calls, turn and token limits) on an embedded engine.
With samples=1 decoding is greedy unless greedy=False (one sample at `temperature`); with
samples=k > 1 each task is sampled k times at `temperature` and avg@k (mean accuracy over
samples) and pass@k are reported too.

Accuracy is the env's score of each episode; `reward` is what training sees (the score minus
the env's tool charges, if it prices its tool). Envs whose tasks carry a `level` (difficulty)
also get `by_level`: accuracy and tool calls per difficulty.
"""

from __future__ import annotations

import time

import numpy as np

from fr_jax.rollout.agent import AgentConfig, AgentLoop
from fr_jax.rollout.embedded import EmbeddedEngine


def evaluate(model_config, params, tokenizer, env, agent: AgentConfig, *, n: int = 200,
             samples: int = 1, temperature: float = 1.0, num_slots: int = 32,
             seed: int = 0, engine=None, greedy: bool | None = None) -> dict:
  """`engine` defaults to an embedded engine on `params`. Decoding is greedy when `greedy`
  (default: when samples == 1), else sampled at `temperature` with per-task seeds from
  `seed`, so two evaluations of one model see the same draws."""
  size = env.split_size("test")
  if not 1 <= n <= size:
    raise ValueError(f"n={n} must be in [1, {size}] (the {env.name} test split's size)")
  if samples < 1:
    raise ValueError(f"samples={samples} must be >= 1")
  t0 = time.perf_counter()
  tasks = [env.task("test", i) for i in range(n)]
  greedy = samples == 1 if greedy is None else greedy
  if greedy and samples > 1:
    raise ValueError("greedy decoding with samples > 1 would repeat one answer")
  cfg = AgentConfig(**{**agent.__dict__, "temperature": 0.0 if greedy else temperature})
  if engine is None:
    engine = EmbeddedEngine(model_config, params, tokenizer=tokenizer,
                            num_slots=min(num_slots, n), max_len=cfg.engine_max_len)
  loop = AgentLoop(engine, tokenizer, env, cfg)
  scores = np.zeros((samples, n))
  trajs = []
  for s in range(samples):
    ts, eps = loop.run(tasks, [seed + s * n + i for i in range(n)])
    scores[s] = [e.score for e in eps]
    trajs += ts
  lengths = [t.completion_tokens.shape[0] for t in trajs]
  out = dict(env=env.name, n=n, samples=samples,
             decoding="greedy" if greedy else f"temperature {temperature}",
             accuracy=float(scores[0].mean()),
             reward=float(np.mean([t.reward for t in trajs])),
             tool_calls_per_trajectory=float(np.mean([t.num_tool_calls for t in trajs])),
             response_length=float(np.mean(lengths)),
             truncation_rate=float(np.mean([t.truncated for t in trajs])),
             turns=float(np.mean([t.num_turns for t in trajs])),
             seconds=round(time.perf_counter() - t0, 1),
             item_scores=scores[0].tolist())  # the first sample's score of each task, in order
  if samples > 1:
    out[f"avg@{samples}"] = float(scores.mean())
    out[f"pass@{samples}"] = float((scores.max(0) > 0).mean())
  levels = sorted({t.meta["level"] for t in tasks if "level" in t.meta})
  if levels:  # per difficulty, over every sample: accuracy and tool calls
    calls = np.array([t.num_tool_calls for t in trajs]).reshape(samples, n)
    out["by_level"] = {
        lv: dict(n=int(sel.sum()), accuracy=float(scores[:, sel].mean()),
                 tool_calls_per_trajectory=float(calls[:, sel].mean()))
        for lv in levels
        for sel in [np.array([t.meta.get("level") == lv for t in tasks])]}
  return out


def table(result: dict) -> str:
  """A two-column text table of a result (its per-task scores left out)."""
  rows = {k: v for k, v in result.items() if k != "item_scores"}
  w = max(len(k) for k in rows)
  return "\n".join(f"{k:<{w}}  {v:.4f}" if isinstance(v, float) else f"{k:<{w}}  {v}"
                   for k, v in rows.items())
