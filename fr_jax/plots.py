"""The run plot, from a run directory's metrics.jsonl and its held-out evaluations
(evals.jsonl; eval_start.json / eval_end.json in runs made before it existed):

* held-out accuracy and held-out tool calls per episode over updates, one curve per
  difficulty level where the env has levels; a warm-started run's base model is the hollow
  marker at update 0 and the curve starts at the warm-started model. Where the evaluations
  during RL used a slice of the held-out tasks (`eval.every_n`), the accuracy curve is the
  slice's at every evaluation (the full evaluations' first tasks included) and the full
  evaluations are separate markers;
* train reward with its moving average, trust acceptance rate, response length, and tool
  calls and truncation rate in training.

Panels with nothing to show are left out: tool calls, when no evaluation and no training
batch made one (a run whose prompt offers no tool).
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from fr_jax.learner.metrics import read_jsonl


def moving_average(x, window: int) -> np.ndarray:
  """Trailing mean over the last `window` values (fewer at the start)."""
  x = np.asarray(x, float)
  c = np.cumsum(np.insert(x, 0, 0.0))
  i = np.arange(1, len(x) + 1)
  lo = np.maximum(i - window, 0)
  return (c[i] - c[lo]) / (i - lo)


def _eval_rows(run: Path, last_step: int) -> list[dict]:
  if (run / "evals.jsonl").exists():
    return list(read_jsonl(run / "evals.jsonl"))
  rows = []
  for name, stage, version in (("eval_start.json", "rl", 0), ("eval_end.json", "rl", last_step)):
    if (run / name).exists():
      rows.append({"stage": stage, "version": version, **json.loads((run / name).read_text())})
  return rows


def _series(rows, key):
  """{level: (versions, values)} over the warm-started/start model and RL evaluations."""
  curve = sorted((r for r in rows if r["stage"] in ("sft", "rl")), key=lambda r: r["version"])
  levels = sorted({lv for r in curve for lv in r.get("by_level", {})}) or ["all"]
  out = {}
  for lv in levels:
    pts = [(r["version"], (r["by_level"][lv] if lv != "all" else r).get(key)) for r in curve
           if lv == "all" or lv in r.get("by_level", {})]
    pts = [(v, y) for v, y in pts if y is not None]
    out[lv] = ([v for v, _ in pts], [y for _, y in pts])
  return out


def slice_curve(rows) -> dict | None:
  """Where the evaluations during RL used a slice of the held-out tasks (rows of more than
  one size n): {"k": the slice's size, "slice": [(version, accuracy on the first k tasks)]
  at every evaluation (a full one's from its `item_scores`), "full": [(version, accuracy)]
  of the full ones}. None when every evaluation used the same tasks."""
  curve = sorted((r for r in rows if r["stage"] in ("sft", "rl")), key=lambda r: r["version"])
  sizes = {r.get("n") for r in curve}
  if len(sizes) < 2 or None in sizes:
    return None
  k = min(sizes)
  return dict(k=k, slice=[(r["version"], r["accuracy"] if r["n"] == k
                           else float(np.mean(r["item_scores"][:k])))
                          for r in curve if r["n"] == k or "item_scores" in r],
              full=[(r["version"], r["accuracy"]) for r in curve if r["n"] > k])


def panel_names(rows, evals) -> list[str]:
  """The run plot's panels: tool calls only where an evaluation or a training batch made one."""
  called = any(r.get("tool_calls_per_trajectory", 0) for r in evals) or any(
      float(r.get("tool_calls", 0)) for r in rows)
  return ["held-out accuracy", *(["held-out tool calls"] if called else []), "train reward",
          "acceptance", "response length",
          "train tool calls, truncation" if called else "train truncation"]


def _slice_panel(ax, rows, sc: dict):
  """Accuracy on the first k tasks at every evaluation, and the full evaluations as markers."""
  k, pts, full = sc["k"], sc["slice"], sc["full"]
  ax.plot([v for v, _ in pts], [y for _, y in pts], "o-", color="C0", ms=4,
          label=f"first {k} tasks")
  n_full = max(r["n"] for r in rows if r["stage"] in ("sft", "rl"))
  ax.plot([v for v, _ in full], [y for _, y in full], "s", color="C3", ms=8,
          label=f"all {n_full} tasks")
  for v, y in full:
    ax.annotate(f"{y:.3f}", (v, y), fontsize=8, textcoords="offset points", xytext=(4, -12))
  ax.set_title(f"held-out accuracy ({rows[0].get('decoding', 'greedy')})", fontsize=10)
  ax.legend(fontsize=8)


def _held_out_panel(ax, rows, key, title):
  if not rows:
    ax.set_title(f"{title} (not evaluated)")
    return
  sc = slice_curve(rows) if key == "accuracy" else None
  if sc is not None:
    return _slice_panel(ax, rows, sc)
  n = rows[0].get("n")
  base = next((r for r in rows if r["stage"] == "base"), None)
  for i, (lv, (xs, ys)) in enumerate(_series(rows, key).items()):
    color = f"C{i}"
    ax.plot(xs, ys, "o-", color=color, label=lv)
    b = None if base is None else (base["by_level"].get(lv, {}) if lv != "all"
                                   else base).get(key)
    if b is not None:
      ax.plot([0], [b], "o", mfc="none", color=color, ms=9, label=f"{lv}, base model")
  ax.set_title(f"held-out {title} ({rows[0].get('decoding', 'greedy')}, n={n})", fontsize=10)
  ax.legend(fontsize=8)


def plot_run(run_dir) -> str:
  """Writes run_dir/plot.png; returns its path."""
  run = Path(run_dir)
  rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
  evals = _eval_rows(run, rows[-1]["step"] if rows else 0)
  called = "held-out tool calls" in panel_names(rows, evals)
  panels = [lambda a: _held_out_panel(a, evals, "accuracy", "accuracy")]
  if called:
    panels.append(lambda a: _held_out_panel(a, evals, "tool_calls_per_trajectory",
                                            "tool calls / episode"))
  xs = [r["step"] for r in rows]
  reward = [float(r["reward_mean"]) for r in rows]

  def reward_panel(a):
    a.plot(xs, reward, ".", alpha=0.4, label="batch mean")
    if rows:
      window = max(1, min(10, len(rows) // 4))
      a.plot(xs, moving_average(reward, window), "-", label=f"moving average ({window})")
      a.legend(fontsize=8)
    a.set_title("train reward")
  panels.append(reward_panel)
  train = (("tool_calls", "truncation_rate") if called else ("truncation_rate",))
  for keys, title in ((("acceptance_rate",), "trust acceptance rate"),
                      (("response_length",), "response length (tokens)"),
                      (train, "train: tool calls / trajectory, truncation rate" if called
                       else "train: truncation rate")):
    def panel(a, keys=keys, title=title):
      for k in keys:
        a.plot([r["step"] for r in rows if k in r], [float(r[k]) for r in rows if k in r],
               ".-", label=k)
      if len(keys) > 1:
        a.legend(fontsize=8)
      a.set_title(title)
    panels.append(panel)
  fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
  for a, draw in zip(axes.flat, panels):
    draw(a)
  for a in axes.flat[len(panels):]:
    a.remove()
  axes = np.array(axes.flat[:len(panels)])
  for a in axes.flat:
    a.set_xlabel("update")
    a.grid(alpha=0.3)
  fig.tight_layout()
  out = run / "plot.png"
  fig.savefig(out, dpi=90)
  plt.close(fig)
  return str(out)
