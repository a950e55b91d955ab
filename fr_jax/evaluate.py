"""Held-out evaluation: the agent loop on a fixed test split, greedy or sampled.

`evaluate()` runs every task of the first `n` in the env's test split through the same agent
loop training uses (chat template, tool calls, turn and token limits) on an embedded engine.
With samples=1 decoding is greedy unless greedy=False (one sample at `temperature`); with
samples=k > 1 each task is sampled k times at `temperature` and avg@k (mean accuracy over
samples) and pass@k are reported too.

Accuracy is the env's score of each episode; `reward` is what training sees (the score minus
the env's tool charges, if it prices its tool). Envs whose tasks carry a `level` (difficulty)
also get `by_level`: accuracy, tool calls and reward per difficulty.

Calibration (`calibration=True`, issue 60): does the agent call its tool where it would fail
without it? Three measures of what the model knows by itself, per level in `by_level`:
* `accuracy_direct`, in the agent's own context (the tool offered): each task's answer when
  the agent answers without calling, from the first such episode among the evaluation's
  samples and then up to `DIRECT_TRIES` more first replies sampled (at the evaluation's
  temperature, 1.0 when it is greedy) for the tasks still without one, so a sample of the
  agent's answer given that it does not call. Over the tasks that got one
  (`direct_resolved`, their fraction); None where none did (it always calls).
* `accuracy_no_tool`, with the tool taken away (the env with `tools=()`: no tool in the
  system turn, no call executed): another prompt, which a warm start never trained on, so it
  can read as the base model's skill (docs/agent_demo.md); `tool_attempts_no_tool` counts the
  replies that still wrote a call (scored 0).
* `accuracy_forced`, for envs that say how a direct answer begins (`env.direct_prefix`): every
  task once more, the agent's reply prefilled with that beginning (tool_arithmetic: the
  restated problem, "37 + 45 =", as its direct demonstrations begin) and the rest sampled
  as the evaluation samples (greedy when it is greedy): what it answers if it does not call,
  measured on every task even where it always calls (where `accuracy_direct` has few or
  no answers to read).
The fixed policies' rewards: `reward_never` (never calling: the forced accuracy; for envs
without a forced pass the direct one, the no-tool one where no task answered directly),
`reward_always` (the accuracy of the episodes that called, less the tool's price; None where
none called), and `regret` (the better of the two, less the agent's reward). `calibration`
sums it up: `need_vs_calls`, the correlation over levels between need (1 - reward_never)
and the tool-call rate (1: it calls exactly where it needs to), and the mean regret over
levels.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from fr_jax.rollout.agent import AgentConfig, AgentLoop, parse_tool_call
from fr_jax.rollout.embedded import EmbeddedEngine


def evaluate(model_config, params, tokenizer, env, agent: AgentConfig, *, n: int = 200,
             samples: int = 1, temperature: float = 1.0, num_slots: int = 32,
             seed: int = 0, engine=None, greedy: bool | None = None,
             calibration: bool = False) -> dict:
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
  levels = list(dict.fromkeys(t.meta["level"] for t in tasks if "level" in t.meta))
  if levels:  # per difficulty, over every sample: accuracy and tool calls
    calls = np.array([t.num_tool_calls for t in trajs]).reshape(samples, n)
    rewards = np.array([t.reward for t in trajs]).reshape(samples, n)
    out["by_level"] = {
        lv: dict(n=int(sel.sum()), accuracy=float(scores[:, sel].mean()),
                 tool_calls_per_trajectory=float(calls[:, sel].mean()),
                 reward=float(rewards[:, sel].mean()))
        for lv in levels
        for sel in [np.array([t.meta.get("level") == lv for t in tasks])]}
  if calibration:
    if not levels or "python" not in getattr(env, "tools", ()):
      raise ValueError(f"calibration needs an env with the python tool and levels; {env.name} "
                       "has " + ("no levels" if not levels else "no tool"))
    _calibrate(out, env, tasks, loop, cfg, engine, tokenizer, scores, calls,
               [seed + s * n + i for s in range(samples) for i in range(n)], samples)
  return out


DIRECT_TRIES = 4  # first replies sampled per task still without a direct answer


def _direct_scores(tasks, loop_cfg, engine, tokenizer, env, scores, calls, seed, samples):
  """Per task, the score of an answer given without calling (module docstring), NaN where
  none came."""
  n = len(tasks)
  direct = np.full(n, np.nan)
  for s in range(samples):  # the evaluation's own episodes that did not call
    todo = np.isnan(direct) & (calls[s] == 0)
    direct[todo] = scores[s][todo]
  cfg = dataclasses.replace(loop_cfg, max_turns=1,
                            temperature=loop_cfg.temperature or 1.0)
  first = AgentLoop(engine, tokenizer, env, cfg)
  for j in range(DIRECT_TRIES):
    todo = np.flatnonzero(np.isnan(direct))
    if not len(todo):
      break
    ts, eps = first.run([tasks[i] for i in todo],
                        [seed + (samples + j) * n + i for i in todo])
    for i, t, e in zip(todo, ts, eps):
      if parse_tool_call(tokenizer.decode(t.completion_tokens))[0] is None:
        direct[i] = e.score
  return direct


def _forced_scores(tasks, loop_cfg, engine, tokenizer, env, seed):
  """Per task, the score of a reply begun as a direct answer (module docstring): the
  assistant turn prefilled with `env.direct_prefix(task)`, the rest the model's, one turn."""
  loop = AgentLoop(engine, tokenizer, env, dataclasses.replace(loop_cfg, max_turns=1))
  eps = [loop.start(t) for t in tasks]
  prefixes = [env.direct_prefix(t) for t in tasks]
  for ep, p in zip(eps, prefixes):
    ep.prompt_ids = ep.prompt_ids + tokenizer.encode(p)
  reqs = [loop.request(ep, seed + i) for i, ep in enumerate(eps)]
  got = {c.request_id: c.token_ids for c in engine.generate(reqs)}
  stop = set(loop.stop_ids)
  return np.array([env.reward(t, p + tokenizer.decode([x for x in got[r.request_id]
                                                       if x not in stop]))
                   for t, p, r in zip(tasks, prefixes, reqs)])


def _calibrate(out, env, tasks, loop, cfg, engine, tokenizer, scores, calls, seeds, samples):
  """The direct and no-tool passes and the calibration figures (module docstring), into
  `out`."""
  n = len(tasks)
  direct = _direct_scores(tasks, cfg, engine, tokenizer, env, scores, calls, seeds[0], samples)
  forced = (_forced_scores(tasks, cfg, engine, tokenizer, env, seeds[0])
            if hasattr(env, "direct_prefix") else None)
  bare = dataclasses.replace(env, tools=())
  bare_loop = AgentLoop(engine, tokenizer, bare, cfg)
  bare_scores = np.zeros((samples, n))
  attempts = np.zeros((samples, n))
  for s in range(samples):
    ts, eps = bare_loop.run(tasks, seeds[s * n:(s + 1) * n])
    bare_scores[s] = [e.score for e in eps]
    attempts[s] = [parse_tool_call(tokenizer.decode(t.completion_tokens))[0] is not None
                   for t in ts]
  cost = float(getattr(env, "tool_cost", 0.0))
  need, rate, regrets = [], [], []
  for lv, row in out["by_level"].items():
    sel = np.array([t.meta.get("level") == lv for t in tasks])
    called = calls[:, sel] > 0
    bare_acc = float(bare_scores[:, sel].mean())
    got = direct[sel][~np.isnan(direct[sel])]
    direct_acc = float(got.mean()) if len(got) else None
    forced_acc = None if forced is None else float(forced[sel].mean())
    never = (forced_acc if forced_acc is not None
             else bare_acc if direct_acc is None else direct_acc)
    always = (float(scores[:, sel][called].mean()) - cost) if called.any() else None
    best = max(never, always) if always is not None else never
    row.update(accuracy_direct=direct_acc, direct_resolved=len(got) / int(sel.sum()),
               accuracy_no_tool=bare_acc, tool_attempts_no_tool=float(attempts[:, sel].mean()),
               reward_never=never, reward_always=always, regret=best - row["reward"],
               accuracy_forced=forced_acc)
    need.append(1.0 - never)
    rate.append(row["tool_calls_per_trajectory"])
    regrets.append(row["regret"])
  corr = (float(np.corrcoef(need, rate)[0, 1])
          if len(need) > 1 and np.std(need) > 0 and np.std(rate) > 0 else None)
  resolved = direct[~np.isnan(direct)]
  out["calibration"] = dict(need_vs_calls=corr, mean_regret=float(np.mean(regrets)),
                            accuracy_direct=float(resolved.mean()) if len(resolved) else None,
                            direct_resolved=len(resolved) / n,
                            accuracy_no_tool=float(bare_scores.mean()),
                            accuracy_forced=None if forced is None else float(forced.mean()))
  out["calibration"]["targets"] = calibration_targets(out)


# What an agent that knows its limits does (issue 60), by what answering without calling
# scores per level (`reward_never`: the forced accuracy): it calls on `call_need` or more of
# the items of every level below `need`, on `call_skilled` or fewer of every level above
# `skilled`, and is right on `accuracy` or more of all items.
TARGETS = dict(need=0.5, call_need=0.8, skilled=0.9, call_skilled=0.3, accuracy=0.9)


def calibration_targets(result: dict, **targets) -> dict:
  """A calibrated result (`evaluate(..., calibration=True)`) against `TARGETS` (or the
  values given), a level's skill alone read as `reward_never`: `need_levels` and
  `skilled_levels`, the levels each rule applies to; `misses`, one readable line per rule
  broken; `met`, no misses. Levels between the two thresholds are free: there the two fixed
  policies are close at any sensible price. The accuracy is over every sample (avg@k where
  the evaluation drew k)."""
  t = {**TARGETS, **targets}
  needs, skilled, misses = [], [], []
  for lv, x in result["by_level"].items():
    skill, calls = x["reward_never"], x["tool_calls_per_trajectory"]
    if skill < t["need"]:
      needs.append(lv)
      if calls < t["call_need"]:
        misses.append(f"{lv} (alone {skill:.2f}): calls {calls:.2f} < {t['call_need']:g}")
    elif skill > t["skilled"]:
      skilled.append(lv)
      if calls > t["call_skilled"]:
        misses.append(f"{lv} (alone {skill:.2f}): calls {calls:.2f} > {t['call_skilled']:g}")
  acc = result.get(f"avg@{result.get('samples', 1)}", result["accuracy"])  # every sample
  if acc < t["accuracy"]:
    misses.append(f"accuracy {acc:.3f} < {t['accuracy']:g}")
  return dict(met=not misses, need_levels=needs, skilled_levels=skilled, misses=misses, **t)


def table(result: dict) -> str:
  """A two-column text table of a result (its per-task scores left out)."""
  rows = {k: v for k, v in result.items() if k != "item_scores"}
  w = max(len(k) for k in rows)
  return "\n".join(f"{k:<{w}}  {v:.4f}" if isinstance(v, float) else f"{k:<{w}}  {v}"
                   for k, v in rows.items())


def calibration_table(result: dict) -> str:
  """Per level: the direct accuracy (and the fraction of tasks answered directly), the
  accuracy without the tool and with it, tool calls, reward, the best fixed policy's reward,
  the regret and the forced accuracy; then the summary and the targets' verdict
  (`evaluate(..., calibration=True)`)."""
  lines = [f"{'level':8}{'n':>5}{'direct':>8}{'(of)':>6}{'no tool':>9}{'tool':>7}"
           f"{'calls':>7}{'reward':>8}{'best fixed':>11}{'regret':>8}{'forced':>8}"]
  for lv, x in result["by_level"].items():
    best = x["reward_never"] if x["reward_always"] is None else max(x["reward_never"],
                                                                      x["reward_always"])
    d = "n/a" if x["accuracy_direct"] is None else f"{x['accuracy_direct']:.3f}"
    lines.append(f"{lv:8}{x['n']:>5}{d:>8}{x['direct_resolved']:>6.2f}"
                 f"{x['accuracy_no_tool']:>9.3f}{x['accuracy']:>7.3f}"
                 f"{x['tool_calls_per_trajectory']:>7.2f}{x['reward']:>8.3f}{best:>11.3f}"
                 f"{x['regret']:>8.3f}"
                 + ("     n/a" if x.get("accuracy_forced") is None
                    else f"{x['accuracy_forced']:>8.3f}"))
  cal = result["calibration"]
  corr = "n/a" if cal["need_vs_calls"] is None else f"{cal['need_vs_calls']:.3f}"
  lines.append(f"tool calls against need (1 - never-calling reward), correlation over levels: "
               f"{corr}; mean regret {cal['mean_regret']:.3f}")
  lines.append(targets_line(calibration_targets(result)))
  return "\n".join(lines)


def targets_line(t: dict) -> str:
  """`calibration_targets`' verdict in one line."""
  rule = (f"calls >= {t['call_need']:g} where alone < {t['need']:g} "
          f"({', '.join(t['need_levels']) or 'none'}), <= {t['call_skilled']:g} where alone > "
          f"{t['skilled']:g} ({', '.join(t['skilled_levels']) or 'none'}), "
          f"accuracy >= {t['accuracy']:g}")
  return f"targets ({rule}): " + ("met" if t["met"] else "missed: " + "; ".join(t["misses"]))
