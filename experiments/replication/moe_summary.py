r"""Summarises the tiny mixture-of-experts runs with and without rollout routing replay
(`experiments/configs/tiny_moe.py`; docs/replication.md, "Mixture of experts").

  python -m experiments.replication.moe_summary --runs=runs --seeds=0,1,2

Reads runs/moe_{r3,free}_s{seed}/metrics.jsonl and summary.json and prints one JSON line per
run, then a markdown table: per arm, the mean over seeds (and each seed's value) of the
update-averaged metrics. Updates with no record in a lag bucket do not count for that bucket.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from absl import app, flags

ARMS = (("r3", "replay on"), ("free", "replay off"))
# (row label, metrics key, updates it averages: "all" or "last20")
ROWS = (
    ("policy lag (mean over updates)", "policy_lag_mean", "all"),
    ("routing drift (share of action tokens)", "routing_drift", "all"),
    ("lag 0: abs dlogp, with replay", "mismatch/lag_0/abs_dlogp_with_replay", "all"),
    ("lag 0: abs dlogp, without replay", "mismatch/lag_0/abs_dlogp_without_replay", "all"),
    ("lag >= 4: routing drift", "mismatch/lag_4plus/routing_drift", "all"),
    ("lag >= 4: abs dlogp, with replay", "mismatch/lag_4plus/abs_dlogp_with_replay", "all"),
    ("lag >= 4: abs dlogp, without replay", "mismatch/lag_4plus/abs_dlogp_without_replay",
     "all"),
    ("lag >= 4: token KL, with replay", "mismatch/lag_4plus/token_kl_with_replay", "all"),
    ("lag >= 4: token KL, without replay", "mismatch/lag_4plus/token_kl_without_replay", "all"),
    ("trust gate acceptance", "acceptance_rate", "all"),
    ("reward (last 20 updates)", "reward_mean", "last20"),
)

FLAGS = flags.FLAGS
flags.DEFINE_string("runs", "runs", "directory holding moe_{r3,free}_s{seed}")
flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds to read")


def run_figures(path: str) -> dict:
  rows = []
  with open(os.path.join(path, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      if "acceptance_rate" in r and "routing_drift" in r:  # RL updates (not the warm start)
        rows.append(r)
  if not rows:
    raise SystemExit(f"{path}: no RL update rows in metrics.jsonl")
  out = {"updates": len(rows)}
  for _, key, span in ROWS:
    vals = [r[key] for r in (rows[-20:] if span == "last20" else rows) if key in r]
    out[key] = float(np.mean(vals)) if vals else None
  with open(os.path.join(path, "summary.json")) as f:
    s = json.load(f)
  out["heldout_accuracy_start"] = s.get("heldout_accuracy_start")
  out["heldout_accuracy_end"] = s.get("heldout_accuracy_end")
  out["dropped_stale"] = s.get("rejected_by_reason", {}).get("stale", 0)
  out["wall_s"] = s.get("wall_s")
  return out


def _fmt(x) -> str:
  if x is None:
    return "n/a"
  if x and abs(x) < 1e-3:
    return f"{x:.1e}"
  return f"{x:.4f}" if abs(x) < 10 else f"{x:.0f}"


def main(argv):
  del argv
  figs = {}
  for arm, _ in ARMS:
    for seed in FLAGS.seeds:
      path = os.path.join(FLAGS.runs, f"moe_{arm}_s{seed}")
      figs[arm, seed] = run_figures(path)
      print(json.dumps({"run": path, **figs[arm, seed]}))
  rows = [*ROWS, ("held-out accuracy, after the warm start", "heldout_accuracy_start", ""),
          ("held-out accuracy, end", "heldout_accuracy_end", ""),
          ("records dropped as stale (lag > 8)", "dropped_stale", "")]
  head = "| metric | " + " | ".join(f"{label}: mean (seeds {', '.join(FLAGS.seeds)})"
                                     for _, label in ARMS) + " |"
  print(head)
  print("|---" * (1 + len(ARMS)) + "|")
  for label, key, _ in rows:
    cells = []
    for arm, _ in ARMS:
      vals = [figs[arm, s][key] for s in FLAGS.seeds]
      known = [v for v in vals if v is not None]
      mean = float(np.mean(known)) if known else None
      cells.append(f"{_fmt(mean)} ({', '.join(_fmt(v) for v in vals)})")
    print(f"| {label} | " + " | ".join(cells) + " |")
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main)
