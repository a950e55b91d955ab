r"""Does asynchrony hurt the demo? The lag study of issue 56: `make demo`'s recipe at policy
lag 2 (as the demo runs it) and lag 0, on many seeds, with every run's drift verdict, and the
same for each candidate fix.

  .venv/bin/python -m experiments.replication.lag_study --variants=base_lag2,base_lag0 \
      --seeds=0-7 --import_from=experiments/replication/results_lag/results.json
  .venv/bin/python -m experiments.replication.lag_study --report        # tables, no runs
  .venv/bin/python -m experiments.replication.lag_study --variants=base_lag2 --seeds=2,4 \
      --mechanism=base_lag2:2,base_lag2:4                                # and the plots

A variant is the headline's FlashREINFORCE setting (`comparisons.HEAD`: `cpu_default`, the
first 24 updates of 32 rollouts of its 36-update schedule, greedy held-out accuracy on the
demo's 200 problems at the start, update 12 and the end) with some config changes; `_lag2`
runs it as `make demo` does (the asynchronous system, the worker at a fixed lag of 2),
`_lag0` synchronously (`driver.rl_loop`); a `_36u` variant runs all 36 updates, as `make demo`
does, and reports its held-out at update 24 beside the end. Runs are kept in
--out/results.json by variant and seed, so an interrupted study resumes; --import_from takes
the headline comparison's flash_async and flash_sync runs as base_lag2 and base_lag0 where
their settings are equal.

A run **drifts** (issue 56's criterion) when its held-out truncation ends above 0.3 or its
training length rises: the mean over its last 8 updates above 1.15 x the mean over its first 8
(healthy runs keep or shorten their replies as they learn: 0.69-1.07 x on the first 9 healthy
runs measured; the drifting one, 1.53 x).

--mechanism=variant:seed,... (or dir:RUN_DIR, a `make demo` run) plots, per run, what issue 56
asks to see per update: training length, truncation and reward; the gate's acceptance by length
quartile and by advantage sign, and sum_i m_i A_i; the Bernoulli KL by the behaviour probability
p (the learner's `d_by_p/` metrics) and log pi(EOS) at the replies' stop tokens. Runs made
before those metrics existed plot what they have.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
from absl import app, flags

from experiments.benchmarks.common import cpu_model
from experiments.replication import stats
from experiments.replication.comparisons import HEAD
from experiments.replication.lm import LMSetting

F = flags.FLAGS

# The fraction by which the last 8 updates' mean training length may exceed the first 8's.
LENGTH_RISE = 1.15
TRUNCATION_DRIFT = 0.3


# The demo's recipe when the study began (`cpu_default` before issue 56 changed it), pinned in
# every variant so that a variant keeps the settings its runs were made with, whatever
# `cpu_default` says today (a change to the config would otherwise not show in the record).
STUDY_BASE = dict(objective__reduction="sample_mean", optim__lr=5e-6)


def _pair(name: str, setting: dict | None = None, **over) -> dict:
  """`name`_lag2 (the system at a fixed lag of 2, as `make demo`) and `name`_lag0
  (synchronous), both with the config changes `over` (dotted keys, `__` for `.`, on top of
  STUDY_BASE) and the setting's changes `setting` (LMSetting fields)."""
  o = tuple(sorted((k.replace("__", "."), v) for k, v in {**STUDY_BASE, **over}.items()))
  head = {**HEAD, **(setting or {})}
  return {f"{name}_lag2": LMSetting(**head, system=True, lag=2, overrides=o),
          f"{name}_lag0": LMSetting(**head, overrides=o)}


# Issue 56, step 3: the paper's own knobs, one at a time against the demo's settings then
# (STUDY_BASE); constlen_lr1e5 is `make demo`'s recipe since step 5.
VARIANTS: dict[str, LMSetting] = {
    **_pair("base"),  # the demo's settings then: temperature 0.6, delta 3e-3, lr 5e-6, 5 warm-up
    **_pair("temp1", objective__temperature=1.0),  # the paper's sampling temperature
    **_pair("delta5e3", objective__delta=5e-3),  # the paper's long-CoT bound
    **_pair("delta1e2", objective__delta=1e-2),  # the paper's MoE bound
    **_pair("lr2e6", optim__lr=2e-6),  # nearer the paper's 1e-6
    **_pair("warm10", optim__warmup_frac=10 / 36),  # a 10-update warm-up
    **_pair("constlen", objective__reduction="constant_length"),  # the reference's variant
    # constant_length at twice the lr: it weighs each reply by its length, so the short
    # rewarded ones pull less than under sample_mean; does a larger step give it back?
    **_pair("constlen_lr1e5", objective__reduction="constant_length", optim__lr=1e-5),
    # Step 4 (a deviation, docs/objective.md): the gate on negative advantages only, alone and
    # with the step-3 candidate
    **_pair("negGate", objective__trust="sequence_negative"),
    **_pair("constlen_lr1e5_negGate", objective__reduction="constant_length", optim__lr=1e-5,
            objective__trust="sequence_negative"),
    # Step 5: the demo's own length, all 36 updates of the schedule (held-out at 12, 24, 36;
    # the first 24 updates are the 24-update variant's), for the base and the candidates
    **_pair("base_36u", dict(updates=36, eval_every=12)),
    **_pair("constlen_lr1e5_36u", dict(updates=36, eval_every=12),
            objective__reduction="constant_length", optim__lr=1e-5),
    **_pair("constlen_lr1e5_negGate_36u", dict(updates=36, eval_every=12),
            objective__reduction="constant_length", optim__lr=1e-5,
            objective__trust="sequence_negative"),
    # B = 64 at the same 768 rollouts: 12 updates of an 18-update schedule (the same share)
    **_pair("b64", dict(batch_size=64, updates=12, schedule=18, eval_every=6),
            rollout__inflight=64, rollout__num_slots=64, service__queue_capacity=64),
}
IMPORTED = {"base_lag2": "flash_async", "base_lag0": "flash_sync"}


def _say(msg: str):
  print(msg, file=sys.stderr, flush=True)


def parse_seeds(text: str) -> list[int]:
  if "-" in text:
    lo, hi = text.split("-")
    return list(range(int(lo), int(hi) + 1))
  return [int(s) for s in text.split(",") if s]


def settings(s: LMSetting) -> dict:
  return json.loads(json.dumps(dataclasses.asdict(s)))


def drift(r: dict) -> dict:
  """The drift verdict of one run and the figures it rests on."""
  length = [p["length"] for p in r["curve"]]
  first, last = float(np.mean(length[:8])), float(np.mean(length[-8:]))
  trunc = r["end"]["truncation_rate"]
  return dict(truncation_end=trunc, length_first8=first, length_last8=last,
              length_rise=last / first,
              drifted=bool(trunc > TRUNCATION_DRIFT or last > LENGTH_RISE * first))


def _import(results: dict, path: Path):
  """The headline comparison's runs with base_lag2 / base_lag0's settings."""
  src = json.loads(path.read_text())["comparisons"].get("headline_lm", {})
  for variant, arm in IMPORTED.items():
    want = settings(VARIANTS[variant])
    have = {"overrides": [], **src.get("settings", {}).get(arm, {})}
    if have != want:
      _say(f"--import_from: {arm}'s settings differ from {variant}'s; not imported")
      continue
    runs = results["runs"].setdefault(variant, {})
    for r in src["runs"].get(arm, []):
      runs.setdefault(str(r["seed"]), dict(r, imported_from=f"{path}:{arm}", settings=want))


def _save(results: dict, path: Path):
  from experiments.replication import driver
  driver.save_json(results, path)


def run_all(results: dict, variants: list[str], seeds: list[int], path: Path):
  """Seed-major, so that a study stopped early has every variant on its first seeds."""
  for seed in seeds:
    for v in variants:
      runs = results["runs"].setdefault(v, {})
      if str(seed) in runs:
        continue
      s = VARIANTS[v]
      _say(f"[lag_study] {v} seed {seed}: {s.updates} updates of B={s.batch_size}, "
           f"{'system at lag 2' if s.system else 'synchronous'}, {dict(s.overrides) or ''}")
      t0 = time.perf_counter()
      r = s.run(seed, log=_say)
      r["cpu"] = cpu_model()
      r["settings"] = settings(s)
      runs[str(seed)] = r
      _save(results, path)
      d = drift(r)
      _say(f"[lag_study] {v} seed {seed}: held-out {r['start']['accuracy']:.3f} -> "
           f"{r['end']['accuracy']:.3f}, truncation {d['truncation_end']:.3f}, length "
           f"{d['length_first8']:.1f} -> {d['length_last8']:.1f}"
           f"{' DRIFTED' if d['drifted'] else ''} ({time.perf_counter() - t0:.0f}s)")


HEADLINE_AT = 24  # the headline's budget: 36-update runs also report their held-out here


def at_update(r: dict, version: int = HEADLINE_AT) -> float | None:
  """A run's held-out accuracy after `version` updates (its evaluation there), or None."""
  return next((e["accuracy"] for e in r.get("evals", ()) if e["version"] == version), None)


# `make demo`'s recipe since issue 56's step 5, and the headline arms its 36-update runs give.
DEMO_VARIANT = "constlen_lr1e5_36u"
HEADLINE_ARMS = {"flash_async": f"{DEMO_VARIANT}_lag2", "flash_sync": f"{DEMO_VARIANT}_lag0"}


def config_fields(c) -> dict:
  """A run config's fields by dotted name."""
  from flax import traverse_util
  return traverse_util.flatten_dict(c.to_dict(), sep=".")


def headline_run(r: dict, s: LMSetting, upto: int = HEADLINE_AT) -> dict:
  """A longer run of the headline arm `s`'s recipe, as that arm's `upto`-update run: its
  first `upto` updates and its held-out evaluation there. It is the same computation: on the
  same schedule (`s.schedule`) and seed, a run trains on the same batches with the same
  weights whatever its length (the 36-update run of seed 3 against the 24-update one: every
  curve figure and the held-out accuracy at 24 equal). Its training seconds are its own up to
  that update (wall_s too: the evaluations after are not counted); `prompts_covered` is
  B x `upto` for the asynchronous system (the trajectories its learner used) and unknown
  (None) for the synchronous driver, which counts distinct prompts and did not record them
  per update."""
  ev = next((e for e in r["evals"] if e["version"] == upto), None)
  if ev is None or r["curve"][-1]["version"] < upto:
    raise ValueError(f"seed {r['seed']}: no held-out evaluation at update {upto}")
  curve = [p for p in r["curve"] if p["version"] <= upto]
  end = {k: v for k, v in ev.items() if k not in ("version", "rollouts", "wall_s")}
  return dict(seed=r["seed"], warm_start=r["warm_start"], start=r["start"], end=end,
              gain={"accuracy": end["accuracy"] - r["start"]["accuracy"]},
              evals=[e for e in r["evals"] if e["version"] <= upto], curve=curve,
              prompts_covered=s.batch_size * upto if s.system else None,
              rollouts=curve[-1]["rollouts"], train_wall_s=curve[-1]["wall_s"],
              wall_s=curve[-1]["wall_s"], cpu=r.get("cpu"))


def headline_runs(results: dict, arms: dict[str, LMSetting], source: str = "") -> dict:
  """The headline's FlashREINFORCE arms (`arms`: name -> setting) read off this study's
  DEMO_VARIANT runs, for the seeds it has. Each variant must be its arm in every config field
  but the number of updates, or this raises: a changed `cpu_default` or HEAD is caught here."""
  out = {}
  for arm, v in HEADLINE_ARMS.items():
    s, mine = arms[arm], VARIANTS[v]
    a, b = config_fields(s.run_config(0)), config_fields(mine.run_config(0))
    diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and k != "max_updates")
    same = ("system", "lag", "batch_size", "eval_every", "eval_n", "loss", "group_size")
    if diff or any(getattr(s, f) != getattr(mine, f) for f in same):
      raise ValueError(f"{v} is not the headline's {arm} run for longer: {diff or 'setting'}")
    if s.schedule != mine.updates or mine.updates < s.updates:
      raise ValueError(f"{v}: {mine.updates} updates, the headline's schedule {s.schedule}")
    out[arm] = []
    for seed, r in sorted(results["runs"].get(v, {}).items(), key=lambda kv: int(kv[0])):
      if r["settings"] != settings(mine):
        raise ValueError(f"{v} seed {seed}: recorded with other settings than today's {v}")
      out[arm].append(dict(headline_run(r, s, s.updates),
                           imported_from=f"{source}:{v}:{seed}, its first {s.updates} updates"))
  return out


def _ci(x: dict, nd: int = 3) -> str:
  return f"{x['mean']:+.{nd}f} [{x['lo']:+.{nd}f}, {x['hi']:+.{nd}f}]"


def report(results: dict) -> str:
  """results.md: every run's row, each variant's summary, and lag 2 against lag 0 paired by
  seed for each variant that has both."""
  out = ["# Lag study (issue 56)", "",
         f"Drift: held-out truncation at the end > {TRUNCATION_DRIFT}, or the training length's "
         f"mean over the last 8 updates > {LENGTH_RISE} x that over the first 8. Held-out: "
         "greedy accuracy on the demo's 200 problems.", "",
         f"| variant | seed | held-out start -> end | gain | gain at {HEADLINE_AT} | truncation "
         "end | length first 8 -> last 8 | drifted | CPU |", "|---" * 9 + "|"]
  summary = ["", "| variant | seeds | drifted | gain mean [95% CI] | lowest gain | "
             "held-out end mean |", "|---|---|---|---|---|---|"]
  for v in VARIANTS:
    runs = results["runs"].get(v, {})
    if not runs:
      continue
    rs = [runs[k] for k in sorted(runs, key=int)]
    for r in rs:
      d, a24 = drift(r), at_update(r)
      g24 = "-" if a24 is None else f"{a24 - r['start']['accuracy']:+.3f}"
      out.append(f"| {v} | {r['seed']} | {r['start']['accuracy']:.3f} -> "
                 f"{r['end']['accuracy']:.3f} | {r['gain']['accuracy']:+.3f} | {g24} | "
                 f"{d['truncation_end']:.3f} | {d['length_first8']:.1f} -> "
                 f"{d['length_last8']:.1f} | {'yes' if d['drifted'] else 'no'} | "
                 f"{r.get('cpu', '?')} |")
    gains = [r["gain"]["accuracy"] for r in rs]
    n_drift = sum(drift(r)["drifted"] for r in rs)
    summary.append(f"| {v} | {len(rs)} | {n_drift} | {_ci(stats.mean_ci(gains))} | "
                   f"{min(gains):+.3f} | {np.mean([r['end']['accuracy'] for r in rs]):.3f} |")
  paired = ["", "Lag 2 minus lag 0, paired by seed (held-out accuracy at the end):", "",
            "| variant | seeds | difference [95% CI] |", "|---|---|---|"]
  for v in VARIANTS:
    if not v.endswith("_lag2"):
      continue
    a, b = results["runs"].get(v, {}), results["runs"].get(v[:-1] + "0", {})
    common = sorted(set(a) & set(b), key=int)
    if len(common) >= 2:
      d = stats.paired([a[k]["end"]["accuracy"] for k in common],
                       [b[k]["end"]["accuracy"] for k in common])
      paired.append(f"| {v[:-5]} | {len(common)} | {_ci(d)} |")
      if all(a[k]["curve"][-1]["version"] > HEADLINE_AT for k in common):
        d = stats.paired([at_update(a[k]) for k in common], [at_update(b[k]) for k in common])
        paired.append(f"| {v[:-5]}, at update {HEADLINE_AT} | {len(common)} | {_ci(d)} |")
  return "\n".join(out + summary + paired) + "\n"


SMOOTH = 3  # the gate and KL panels: trailing mean over this many updates (B = 32 is noisy)


def _series(curve: list, key: str, smooth: int = 1):
  from fr_jax.plots import moving_average
  x = [p["version"] for p in curve if key in p]
  y = [p[key] for p in curve if key in p]
  return x, (list(moving_average(y, smooth)) if smooth > 1 and y else y)


def run_from_dir(run_dir: str) -> dict:
  """A `launch.train` run directory (`make demo`'s runs/demo) as a study run: its curve from
  metrics.jsonl, its start and end from evals.jsonl."""
  from experiments.replication.driver import DIAGNOSTIC_PREFIXES
  from fr_jax.learner.metrics import read_jsonl
  d = Path(run_dir)
  rows = [m for m in read_jsonl(d / "metrics.jsonl") if "loss" in m]
  curve = [dict(version=m["step"], length=m["response_length"],
                truncation=m["truncation_rate"], reward=m["reward_mean"],
                **{k: v for k, v in m.items() if k.startswith(DIAGNOSTIC_PREFIXES)})
           for m in rows]
  evals = sorted((e for e in read_jsonl(d / "evals.jsonl") if e["stage"] == "rl"),
                 key=lambda e: e["version"])
  full = [e for e in evals if e["n"] == max(x["n"] for x in evals)]
  return dict(curve=curve, start=full[0], end=full[-1],
              gain={"accuracy": full[-1]["accuracy"] - full[0]["accuracy"]})


def plot_mechanism(results: dict, picks: list[str], path: Path):
  """One column per run (variant:seed, or dir:PATH for a `launch.train` run directory), five
  panels per column (module docstring)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  cols = []
  for pick in picks:
    v, _, seed = pick.partition(":")
    r = run_from_dir(seed) if v == "dir" else results["runs"].get(v, {}).get(seed)
    if r is None:
      raise app.UsageError(f"--mechanism={pick}: no such run in {F.out}")
    cols.append((Path(seed).name if v == "dir" else pick, r))
  fig, axes = plt.subplots(5, len(cols), figsize=(5.5 * len(cols), 16), squeeze=False,
                           sharex=True)
  for j, (pick, r) in enumerate(cols):
    c = r["curve"]
    d = drift(r)
    ax = axes[0, j]
    ax.plot(*_series(c, "length"), color="C0", label="training length (tokens)")
    ax.set_ylabel("tokens")
    tw = ax.twinx()
    tw.plot(*_series(c, "truncation"), color="C3", label="truncation")
    tw.plot(*_series(c, "reward"), color="C2", label="reward")
    tw.set_ylim(0, 1)
    ax.set_title(f"{pick}: held-out {r['start']['accuracy']:.2f} -> {r['end']['accuracy']:.2f}"
                 f"{' (drifted)' if d['drifted'] else ''}")
    ax.legend(loc="upper left", fontsize=7)
    tw.legend(loc="upper right", fontsize=7)
    ax = axes[1, j]
    for q in range(1, 5):
      ax.plot(*_series(c, f"gate/acceptance_len_q{q}", SMOOTH), label=f"length quartile {q}")
    ax.set_ylabel(f"gate acceptance ({SMOOTH}-update mean)")
    ax.legend(fontsize=7)
    ax = axes[2, j]
    for sign, color in (("pos", "C2"), ("neg", "C3")):
      ax.plot(*_series(c, f"gate/acceptance_adv_{sign}", SMOOTH), color=color,
              label=f"acceptance, A {'>' if sign == 'pos' else '<'} 0")
    ax.set_ylabel("gate acceptance")
    ax.legend(loc="lower left", fontsize=7)
    tw = ax.twinx()
    tw.plot(*_series(c, "gate/admitted_adv_sum"), color="k", ls="--",
            label="sum m_i A_i (admitted)")
    tw.axhline(0, color="k", lw=0.5)
    tw.legend(loc="lower right", fontsize=7)
    ax = axes[3, j]
    from fr_jax.learner.step import P_BINS
    for k, name in enumerate(P_BINS):
      ax.plot(*_series(c, f"d_by_p/{name}/token_kl", SMOOTH), color=f"C{k}",
              label=f"mean d, {name}")
      ax.plot(*_series(c, f"d_by_p/{name}/over_delta", SMOOTH), color=f"C{k}", ls=":")
    ax.set_yscale("log")
    ax.set_ylabel("d (solid); share d > delta (dotted)")
    ax.legend(fontsize=6, ncol=2)
    ax = axes[4, j]
    for key, color in (("eos/logp_at_stop", "k"), ("eos/logp_at_stop_adv_pos", "C2"),
                       ("eos/logp_at_stop_adv_neg", "C3"), ("eos/behavior_logp_at_stop", "C7")):
      ax.plot(*_series(c, key), color=color, label=key.removeprefix("eos/"))
    ax.set_ylabel("log pi(stop token)")
    ax.set_xlabel("update")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


def main(argv):
  del argv
  bad = [v for v in F.variants if v not in VARIANTS]
  if bad:
    raise app.UsageError(f"--variants: unknown {bad}; choose from {sorted(VARIANTS)}")
  out = Path(F.out)
  from experiments.replication import driver
  path, results = driver.open_results(out, {"runs": {}})
  for v, runs in results["runs"].items():  # a variant whose settings changed: not mixed
    if v in VARIANTS and any(r["settings"] != settings(VARIANTS[v]) for r in runs.values()):
      raise app.UsageError(f"{path}: {v}'s runs were made with other settings than today's "
                           f"{v}; move them or rename the variant")
  if F.import_from:
    _import(results, Path(F.import_from))
  if not F.report:
    run_all(results, F.variants, parse_seeds(F.seeds), path)
  _save(results, path)
  (out / "results.md").write_text(report(results))
  if F.mechanism:
    plot_mechanism(results, F.mechanism, out / "mechanism.png")
  print(json.dumps({"out": str(out), "variants": sorted(results["runs"]),
                    "runs": sum(len(r) for r in results["runs"].values())}))


def define_flags():
  """The command's flags (defined only when run, so that tests can import this module beside
  `experiments.replication.run`, whose flags share names)."""
  flags.DEFINE_list("variants", [], "variants to run (see VARIANTS)")
  flags.DEFINE_string("seeds", "0-7", "seeds: a range a-b or a list a,b,c")
  flags.DEFINE_string("out", "experiments/replication/results_lag_study", "output directory")
  flags.DEFINE_string("import_from", "", "a replication results.json whose headline_lm "
                      "flash_async / flash_sync runs count as base_lag2 / base_lag0")
  flags.DEFINE_bool("report", False, "write the tables (and --mechanism plots) without running")
  flags.DEFINE_list("mechanism", [], "variant:seed runs, or dir:RUN_DIR run directories, to "
                    "plot (mechanism.png)")


if __name__ == "__main__":
  define_flags()
  app.run(main)
