"""The run plot: held-out accuracy, reward, acceptance rate, response length, truncation rate
and tool calls over updates, from a run directory's metrics.jsonl and eval_*.json."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fr_jax.learner.metrics import read_jsonl  # noqa: E402

PANELS = (("reward_mean", "train reward"), ("acceptance_rate", "trust acceptance rate"),
          ("response_length", "response length (tokens)"),
          ("truncation_rate", "truncation rate"), ("tool_calls", "tool calls / trajectory"))


def plot_run(run_dir) -> str:
  """Writes run_dir/plot.png; returns its path."""
  run = Path(run_dir)
  rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
  evals = []
  for name in ("eval_start.json", "eval_end.json"):
    if (run / name).exists():
      e = json.loads((run / name).read_text())
      evals.append((0 if name == "eval_start.json" else (rows[-1]["step"] if rows else 0),
                    e["accuracy"], e.get("n")))
  fig, axes = plt.subplots(2, 3, figsize=(13, 7))
  ax = axes.flat[0]
  if evals:
    ax.plot([v for v, _, _ in evals], [a for _, a, _ in evals], "o-")
    ax.set_title(f"held-out accuracy (greedy, n={evals[0][2]})")
  else:
    ax.set_title("held-out accuracy (not evaluated)")
  for ax, (key, title) in zip(list(axes.flat)[1:], PANELS):
    xs = [r["step"] for r in rows if key in r]
    ax.plot(xs, [float(r[key]) for r in rows if key in r], ".-")
    ax.set_title(title)
  for ax in axes.flat:
    ax.set_xlabel("update")
    ax.grid(alpha=0.3)
  fig.tight_layout()
  out = run / "plot.png"
  fig.savefig(out, dpi=90)
  plt.close(fig)
  return str(out)
