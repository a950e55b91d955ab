"""What the training batches of an agent run said about calling the tool, level by level.

  python -m experiments.agent_demo.by_level RUN_DIR [--window=10] [--reduction=sample_mean]
  python -m experiments.agent_demo.by_level experiments/agent_demo/attempts/X.records.jsonl

Reads RUN_DIR/metrics.jsonl, or a file of its rows as the attempts keep them (each update's
records, `Learner.update`: prompt ids, rewards, tool calls, action tokens), and prints, per
window of updates and per level of the task (the task id's second field: tool_arithmetic's
bins), the share of replies that called the tool, the mean reward of those that called and of
those that answered alone, their mean advantages, and the push the objective gave the choice:
the mean of A_i w_i over the replies that called minus the same over those that did not, with
A_i = R_i - the batch's mean reward and w_i the reduction's weight (1/T_i for sample_mean, 1/L
for constant_length, 1/sum T for token_mean; fr_jax/objective.py). A reply's first token, where
it calls or not, gets its trajectory's A_i w_i like every other token, so a positive push moves
the choice toward the call. Another reduction than the run's gives what that one would have
pushed on the same batches.
One JSON line per window and level follows the table.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
from pathlib import Path

from fr_jax.envs.arithmetic import CONTINUUM
from fr_jax.learner.metrics import read_jsonl
from fr_jax.objective import REDUCTIONS


def level_of(prompt_id: str) -> str:
  """tool_arithmetic:easy:3+4:2:Tom -> easy (the task key's second field)."""
  parts = prompt_id.split(":")
  return parts[1] if len(parts) > 2 else "all"


def read_updates(run_dir) -> list[dict]:
  """The update rows of run_dir/metrics.jsonl (or of a .jsonl file of such rows) that carry
  their records, the newest row per step."""
  path = Path(run_dir)
  if path.is_dir() or not path.suffix:
    path = path / "metrics.jsonl"
  if not path.exists():
    raise SystemExit(f"{path}: no such file (a run directory of launch.train or launch.learner)")
  rows = {r["step"]: r for r in read_jsonl(path) if "traj_rewards" in r}  # newest per step
  if not rows:
    raise SystemExit(f"{path}: no update carries its records (traj_rewards); runs before "
                     "this field was logged cannot be read")
  return [rows[k] for k in sorted(rows)]


def weights(tokens: list[int], reduction: str, length_norm: float) -> list[float]:
  """w_i of each record of one batch (fr_jax/objective.py, (3) and its ablations), times B."""
  if reduction == "sample_mean":
    return [1.0 / max(t, 1) for t in tokens]
  if reduction == "constant_length":
    return [1.0 / length_norm] * len(tokens)
  return [len(tokens) / max(sum(tokens), 1)] * len(tokens)  # token_mean


def by_level(updates: list[dict], window: int = 10, reduction: str = "sample_mean",
             length_norm: float = 48.0) -> list[dict]:
  """One dict per (window, level): n, calls (share of records with a call), reward_call,
  reward_direct (None where there were none), push (mean A w of calling minus answering
  records; None unless both occur) and A_call, A_direct (mean advantages)."""
  if reduction not in REDUCTIONS:
    raise ValueError(f"reduction={reduction!r}: choose one of {REDUCTIONS}")
  acc = collections.defaultdict(lambda: collections.defaultdict(list))
  last = {}  # window's first update -> its last
  for r in updates:
    rewards = r["traj_rewards"]
    mean = sum(rewards) / len(rewards)
    w = weights(r["traj_action_tokens"], reduction, length_norm)
    first = (r["step"] - 1) // window * window + 1
    last[first] = max(last.get(first, 0), r["step"])
    for pid, reward, calls, wi in zip(r["traj_prompt_ids"], rewards, r["traj_tool_calls"], w):
      side = "call" if calls > 0 else "direct"
      for level in (level_of(pid), "all"):
        cell = acc[(first, level)]
        cell[side + "_reward"].append(reward)
        cell[side + "_aw"].append((reward - mean) * wi)
        cell[side + "_a"].append(reward - mean)

  def mean(xs):
    return sum(xs) / len(xs) if xs else None

  def order(key):  # windows in turn; in each, the bins from easy to hard, then "all"
    first, level = key
    known = level in CONTINUUM
    return first, level == "all", not known, CONTINUUM.index(level) if known else 0, level

  out = []
  for (first, level), cell in sorted(acc.items(), key=lambda kv: order(kv[0])):
    n_call, n_direct = len(cell["call_reward"]), len(cell["direct_reward"])
    aw_c, aw_d = mean(cell["call_aw"]), mean(cell["direct_aw"])
    out.append(dict(updates=f"{first}-{last[first]}", level=level, n=n_call + n_direct,
                    calls=n_call / (n_call + n_direct),
                    reward_call=mean(cell["call_reward"]),
                    reward_direct=mean(cell["direct_reward"]),
                    A_call=mean(cell["call_a"]), A_direct=mean(cell["direct_a"]),
                    push=None if aw_c is None or aw_d is None else aw_c - aw_d))
  return out


def _fmt(x, spec=".3f"):
  return "-" if x is None else format(x, spec)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("run_dir")
  p.add_argument("--window", type=int, default=10, help="updates per row")
  p.add_argument("--reduction", default="sample_mean", choices=REDUCTIONS,
                 help="the run's objective.reduction")
  p.add_argument("--length_norm", type=float, default=48.0,
                 help="constant_length's L (the run's agent.max_new_tokens by default)")
  a = p.parse_args(argv)
  if a.window < 1 or not (a.length_norm > 0 and math.isfinite(a.length_norm)):
    p.error("--window must be >= 1 and --length_norm > 0")
  rows = by_level(read_updates(a.run_dir), a.window, a.reduction, a.length_norm)
  print(f"| updates | level | n | calls | reward: call | reward: alone | A: call | A: alone "
        f"| push ({a.reduction}) |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['updates']} | {r['level']} | {r['n']} | {r['calls']:.2f} | "
          f"{_fmt(r['reward_call'])} | {_fmt(r['reward_direct'])} | {_fmt(r['A_call'], '+.3f')} "
          f"| {_fmt(r['A_direct'], '+.3f')} | {_fmt(r['push'], '+.4f')} |")
  for r in rows:
    print(json.dumps(r))


if __name__ == "__main__":
  main()
