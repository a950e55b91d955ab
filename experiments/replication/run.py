r"""Replication runner: the paper's ablation directions at CPU scale, several seeds each, with
95% confidence intervals.

  .venv/bin/python -m experiments.replication.run                      # all seven, 5 seeds
  .venv/bin/python -m experiments.replication.run --only=gate_on_off   # one comparison
  .venv/bin/python -m experiments.replication.run --only=fast --seeds=2 # the tiny plumbing check
  .venv/bin/python -m experiments.replication.run --only=tool_use_lm --seeds=3  # SmolLM2, slow
  .venv/bin/python -m experiments.replication.run --only=headline_lm --seeds=4  # ~3.5 h, resumes
  make replication

Writes to --out (default runs/replication): `results.json` (every run: curves, held-out
evaluations, timings), `results.md` (the table: mean [95% CI] per arm and metric, paired
differences and verdicts), `<comparison>.png` (reward and entropy curves, seed means).
Runs already in `results.json` with the same settings are kept unless --rerun (a larger
--seeds adds only the missing seeds); so an interrupted run resumes, and running one
comparison updates only its rows. Summaries and the table are always recomputed.

Setting: the `digits` tasks on a warm-started tiny model (`experiments/replication/driver.py`
says why and how). These runs test the method's mechanisms, not the paper's numbers. The
eighth and ninth, `tool_use_lm` and the headline `headline_lm`, run on SmolLM2-135M-Instruct
(`experiments/replication/lm.py`); they take hours on 2 cores, so only --only runs them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from absl import app, flags

from experiments.benchmarks.common import cpu_model
from experiments.replication import comparisons as comps
from experiments.replication import stats

flags.DEFINE_list("only", [], "comparisons to run (default: the seven on the tiny model); "
                  "`fast` = the tiny check; `tool_use_lm`, `headline_lm` = the slow ones on "
                  "SmolLM2")
flags.DEFINE_integer("seeds", 5, "seeds per arm (>= 2 for intervals)")
flags.DEFINE_string("out", "runs/replication", "output directory")
flags.DEFINE_bool("rerun", False, "run comparisons again even if results.json has them")
flags.DEFINE_bool("plots", True, "write <comparison>.png")
flags.DEFINE_string("flash_from", "", "headline_lm: a lag study's results.json; its "
                    "constlen_lr1e5_36u runs (make demo's recipe, 36 updates) give the "
                    "FlashREINFORCE arms' runs (their first 24 updates), so --arms=grpo_g8 "
                    "completes the comparison")
flags.DEFINE_list("arms", [], "run only these arms (default: all); the comparison stays "
                  "unfinished in results.json, its runs kept, until every arm has its seeds")
F = flags.FLAGS


def _say(msg: str):
  print(msg, file=sys.stderr, flush=True)


def settings_json(c: comps.Comparison) -> dict:
  """Each arm's settings as results.json holds them (an empty `overrides` left out, so runs
  recorded before that field existed are kept)."""
  out = {}
  for arm, s in c.arms.items():
    d = json.loads(json.dumps(dataclasses.asdict(s)))
    if d.get("overrides") == []:
      del d["overrides"]
    out[arm] = d
  return out


def run_comparison(c: comps.Comparison, seeds: int, have: dict | None = None,
                   on_run=None, arms=()) -> dict:
  """Runs every arm for seeds 0..seeds-1; seeds already in `have` (same settings) are kept.
  `on_run(runs)` is called after each run (the runner saves them: a slow comparison that is
  interrupted resumes from its last finished run)."""
  from experiments.replication import driver
  runs = {arm: [r for r in (have or {}).get(arm, []) if r["seed"] < seeds] for arm in c.arms}
  for seed in range(seeds):
    for arm, s in c.arms.items():
      if any(r["seed"] == seed for r in runs[arm]) or (arms and arm not in arms):
        continue
      t0 = time.perf_counter()
      _say(f"[{c.name}] {arm} seed {seed}: {s.updates} updates of B={s.batch_size}"
           f"{f' (lag {s.lag})' if s.lag else ''}")
      r = s.run(seed, log=_say) if hasattr(s, "run") else driver.run(s, seed, log=_say)
      r["cpu"] = cpu_model()  # a slow comparison can span machines: its seconds are this one's
      runs[arm].append(r)
      if on_run is not None:
        on_run(runs)
      _say(f"[{c.name}] {arm} seed {seed}: held-out accuracy {r['start']['accuracy']:.3f} -> "
           f"{r['end']['accuracy']:.3f} ({time.perf_counter() - t0:.0f}s)")
  done = all(len(rs) == seeds for rs in runs.values())
  return comparison_record(c, seeds if done else -1, runs)


def comparison_record(c: comps.Comparison, seeds: int, runs: dict) -> dict:
  """What results.json holds of a comparison (seeds -1: unfinished, kept to resume). Its wall
  time is the sum of its runs' own clocks, so one resumed across sessions counts the kept runs."""
  wall = sum(r["wall_s"] for rs in runs.values() for r in rs)
  return dict(settings=settings_json(c), seeds=seeds, runs=runs, wall_s=round(wall, 1))


def _with_flash_from(c: comps.Comparison, old: dict | None, path: Path) -> dict:
  """The headline's record with the FlashREINFORCE arms' runs read off a lag study
  (`lag_study.headline_runs`) added to the runs it keeps (seeds it has already stay)."""
  from experiments.replication import lag_study
  if not path.is_file():
    raise app.UsageError(f"--flash_from={path}: no such file")
  try:
    got = lag_study.headline_runs(json.loads(path.read_text()), c.arms, str(path))
  except ValueError as e:
    raise app.UsageError(f"--flash_from={path}: {e}") from None
  have = old["runs"] if old and old["settings"] == settings_json(c) else {}
  runs = {arm: list(have.get(arm, [])) for arm in c.arms}
  for arm, rs in got.items():
    seen = {r["seed"] for r in runs[arm]}
    runs[arm] += [r for r in rs if r["seed"] not in seen]
    _say(f"[{c.name}] {arm}: seeds {sorted(r['seed'] for r in runs[arm])} ({len(rs)} in "
         f"{path})")
  return comparison_record(c, -1, runs)


def _seed(r: dict) -> int:
  return r["seed"]


def summarise(c: comps.Comparison, res: dict) -> dict:
  """Per-arm means with intervals, and each claim's paired difference and verdict."""
  runs = res["runs"]
  arms = {}
  for arm, rs in runs.items():  # a figure a run did not record (None) is left out
    values = {m: [v for v in (comps.metric(r, m) for r in rs) if v is not None]
              for m in c.metrics}
    arms[arm] = {m: stats.mean_ci(x) for m, x in values.items() if x}
  for arm, rs in runs.items():
    arms[arm]["start.accuracy"] = stats.mean_ci([r["start"]["accuracy"] for r in rs])
  claims = []
  for cl in c.claims:
    head, _, key = cl.metric.partition(".")
    if head == "equal_time":  # each seed's pair at the shorter run's training seconds
      pairs = [comps.equal_time(r, q, key) for r, q in
               zip(sorted(runs[cl.first], key=_seed), sorted(runs[cl.second], key=_seed))]
      a, b = [p[0] for p in pairs], [p[1] for p in pairs]
    else:
      a = [comps.metric(r, cl.metric) for r in sorted(runs[cl.first], key=_seed)]
      b = [comps.metric(r, cl.metric) for r in sorted(runs[cl.second], key=_seed)]
    d = stats.paired(a, b)
    claims.append(dict(metric=cl.metric, first=cl.first, second=cl.second, higher=cl.higher,
                       paper=cl.paper, diff=d, verdict=stats.verdict(d, cl.higher)))
  return dict(arms=arms, claims=claims)


def _fmt(ci: dict, metric: str) -> str:
  nd = 1 if any(k in metric for k in ("length", "wall", "covered", "collapse")) else 3
  return f"{ci['mean']:.{nd}f} [{ci['lo']:.{nd}f}, {ci['hi']:.{nd}f}]"


def markdown(results: dict) -> str:
  out = ["# Replication results", "",
         "Mean [95% t-interval] over seeds; differences are paired by seed (first arm minus "
         "second). Setting: `digits` tasks, warm-started tiny-chat model, except where a "
         "comparison says otherwise (see docs/replication.md).", ""]
  for name, res in results["comparisons"].items():
    if "summary" not in res:  # unfinished
      continue
    c = comps.get(name)
    s = res["summary"]
    out += [f"## {c.title}", "", f"Task: {c.task}. Seeds: {res['seeds']}. "
            f"Wall time: {res['wall_s']:.0f} s. Paper: {c.paper}.", ""]
    cols = ["start.accuracy", *c.metrics]
    out.append("| arm | " + " | ".join(cols) + " |")
    out.append("|---" * (len(cols) + 1) + "|")
    for arm, ms in s["arms"].items():
      out.append(f"| {arm} | " + " | ".join(_fmt(ms[m], m) if m in ms else "n/a"
                                             for m in cols) + " |")
    out.append("")
    if s["claims"]:
      out += ["| claim (paper) | difference [95% CI] | verdict |", "|---|---|---|"]
      for cl in s["claims"]:
        rel = ">" if cl["higher"] else "<"
        out.append(f"| {cl['metric']}: {cl['first']} {rel} {cl['second']} ({cl['paper']}) | "
                   f"{_fmt(cl['diff'], cl['metric'])} | {cl['verdict']} |")
      out.append("")
    if c.note:
      out += [c.note, ""]
  return "\n".join(out)


def plot(name: str, res: dict, path: Path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
  for arm, rs in res["runs"].items():
    for ax, key in zip(axes, ("reward", "entropy", "acceptance")):
      n = min(len(r["curve"]) for r in rs)
      x = [p["version"] for p in rs[0]["curve"][:n]]
      y = np.mean([[p[key] for p in r["curve"][:n]] for r in rs], axis=0)
      ax.plot(x, y, label=arm)
      ax.set_title(key)
      ax.set_xlabel("update")
  _save(fig, axes, f"{name} (mean over {res['seeds']} seeds)", path)


def _save(fig, axes, title: str, path: Path):
  import matplotlib.pyplot as plt
  axes[0].legend(fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def plot_evals(name: str, res: dict, path: Path):
  """Held-out accuracy against rollouts consumed and against training seconds: each seed's
  evaluations (thin) and the seed mean at each evaluation (thick), per arm."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
  for i, (arm, rs) in enumerate(res["runs"].items()):
    color = f"C{i}"
    n = min(len(r["evals"]) for r in rs)
    for ax, key in zip(axes, ("rollouts", "wall_s")):
      for r in rs:
        ax.plot([e[key] for e in r["evals"]], [e["accuracy"] for e in r["evals"]],
                color=color, alpha=0.25, lw=0.8)
      x = np.mean([[e[key] for e in r["evals"][:n]] for r in rs], axis=0)
      y = np.mean([[e["accuracy"] for e in r["evals"][:n]] for r in rs], axis=0)
      ax.plot(x, y, color=color, lw=2, marker="o", label=arm)
  axes[0].set_xlabel("rollouts consumed")
  axes[1].set_xlabel("training seconds on this machine (evaluations excluded)")
  for ax in axes:
    ax.set_ylabel("held-out accuracy")
  _save(fig, axes,
        f"{name}: held-out accuracy (thin: each of {res['seeds']} seeds; thick: mean)", path)


def _write(results: dict, path: Path, out: Path):
  """results.json and results.md, every comparison's summary recomputed from its runs."""
  for name, res in results["comparisons"].items():
    if res["seeds"] > 0:  # not an unfinished one (seeds -1: its runs so far, kept to resume)
      res["summary"] = summarise(comps.get(name), res)
  _save_json(results, path)
  (out / "results.md").write_text(markdown(results))


def _save_json(results: dict, path: Path):
  from experiments.replication import driver
  driver.save_json(results, path)


def main(argv):
  del argv
  names = F.only or [n for n in comps.COMPARISONS if n not in comps.SLOW]
  for n in names:  # unknown names fail before any work
    try:
      comps.get(n)
    except KeyError as e:
      raise app.UsageError(e.args[0]) from None
  if F.seeds < 2:
    raise app.UsageError(f"--seeds={F.seeds}: intervals need at least 2 seeds")
  out = Path(F.out)
  from experiments.replication import driver
  path, results = driver.open_results(out, {"comparisons": {}})
  t_all = time.perf_counter()
  for n in names:
    c = comps.get(n)
    old = results["comparisons"].get(n)
    if F.flash_from and n == "headline_lm":
      old = _with_flash_from(c, old, Path(F.flash_from))
    if (old and not F.rerun and old["seeds"] == F.seeds
        and old["settings"] == settings_json(c)):
      _say(f"[{n}] runs kept from {path} (--rerun to run again)")
      continue
    same = old and not F.rerun and old["settings"] == settings_json(c)

    def save_partial(runs, n=n, c=c):
      results["comparisons"][n] = comparison_record(c, -1, runs)
      _save_json(results, path)

    bad = [a for a in F.arms if a not in c.arms]
    if bad:
      raise app.UsageError(f"--arms={','.join(bad)}: {n} has arms {sorted(c.arms)}")
    res = run_comparison(c, F.seeds, old["runs"] if same else None, on_run=save_partial,
                         arms=F.arms)
    results["comparisons"][n] = res
    results["machine"] = {"cpu_count": os.cpu_count(), "platform": sys.platform}
    _write(results, path, out)  # after each comparison: an interrupt loses only the current one
    if res["seeds"] < 0:
      _say(f"[{n}] unfinished: arms {', '.join(F.arms)} have {F.seeds} seeds; the others run "
           f"without --arms")
      continue
    if F.plots:
      plot(n, res, out / f"{n}.png")
      if all("evals" in r for rs in res["runs"].values() for r in rs):
        plot_evals(n, res, out / f"{n}_curves.png")
    for cl in results["comparisons"][n]["summary"]["claims"]:
      _say(f"[{n}] {cl['metric']}: {cl['first']} vs {cl['second']}: "
           f"{_fmt(cl['diff'], cl['metric'])} -> {cl['verdict']}")
    _say(f"[{n}] done in {res['wall_s']:.0f}s")
  if results["comparisons"]:
    _write(results, path, out)
  print(json.dumps({"out": str(out), "comparisons": names,
                    "wall_s": round(time.perf_counter() - t_all, 1)}))


if __name__ == "__main__":
  app.run(main)
