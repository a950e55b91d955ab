r"""Train with FlashREINFORCE, everything in one process.

  python -m launch.train --config=experiments/configs/cpu_default.py --run_dir=runs/demo
  python -m launch.train --config=experiments/configs/tiny_test.py --run_dir=/tmp/tiny \
      --config.max_updates=10 --config.objective.reduction=token_mean

The learner runs on this thread; `config.rollout.num_workers` rollout workers run as threads
sharing the model and the devices (weights are handed over as arrays, nothing serialised).
With `config.run_dir` set, the run writes there: metrics.jsonl, TensorBoard events (tb/),
Orbax checkpoints (checkpoints/), eval_start.json / eval_end.json (greedy held-out accuracy
on `config.eval.n` test tasks; also every `config.eval.every` updates, all in evals.jsonl),
plot.png and summary.json. With `config.sft.steps > 0` a supervised warm start
(`launch.sft`, into run_dir/sft) runs first, and the base model is evaluated before it; the
summary then holds a per-difficulty table of the base, warm-started and final models.
The time each stage took (model load, evaluations, warm start, RL updates) is printed at the
end and kept in the summary as `stage_seconds`.
Ctrl-C stops after the current step with a checkpoint; the same command resumes from the last
checkpoint. A progress bar
shows reward, acceptance rate, tokens/s, lag and queue depth; the last stdout line is the run
summary as JSON. Bad flags or configs exit with status 2 and a one-line message.
"""

import dataclasses
import json
import os
import sys
import time

from launch import common


def _evaluate(c, model, params, label, n, calibration=False):
  from fr_jax import envs, system
  from fr_jax.evaluate import evaluate, targets_line
  env = envs.make(c.env.name, **c.env.kwargs.to_dict())
  t = c.eval.temperature
  print(f"evaluating {label}: {n} held-out {c.env.name} tasks, "
        f"{'greedy' if t == 0 else f'sampled at temperature {t:g}'} ...",
        file=sys.stderr, flush=True)
  r = evaluate(model.config, params, model.tokenizer, env, system.agent_config(c), n=n,
               num_slots=c.eval.num_slots, greedy=t == 0, temperature=t or 1.0,
               calibration=calibration)
  levels = "".join(f"; {lv}: accuracy {x['accuracy']:.3f}, tool calls "
                   f"{x['tool_calls_per_trajectory']:.2f}"
                   for lv, x in r.get("by_level", {}).items())
  print(f"  {label}: accuracy {r['accuracy']:.3f}, tool calls {r['tool_calls_per_trajectory']:.2f}"
        f", length {r['response_length']:.1f}, truncated {r['truncation_rate']:.3f}{levels} "
        f"({r['seconds']:.0f}s)", file=sys.stderr, flush=True)
  if "calibration" in r:
    cal = r["calibration"]
    corr = "n/a" if cal["need_vs_calls"] is None else f"{cal['need_vs_calls']:.2f}"
    d = "n/a" if cal["accuracy_direct"] is None else f"{cal['accuracy_direct']:.3f}"
    f = "n/a" if cal.get("accuracy_forced") is None else f"{cal['accuracy_forced']:.3f}"
    print(f"  {label}, calibration: accuracy answering without calling {d} (on "
          f"{cal['direct_resolved']:.2f} of the tasks), its reply begun as a direct answer "
          f"{f}, without the tool "
          f"{cal['accuracy_no_tool']:.3f}; tool calls against need (1 - the never-calling "
          f"reward), correlation over levels {corr}; "
          f"mean regret against the best fixed policy per level {cal['mean_regret']:.3f}",
          file=sys.stderr, flush=True)
    print(f"  {label}, {targets_line(cal['targets'])}", file=sys.stderr, flush=True)
  return r


class Evals:
  """Held-out evaluations of a run: run_dir/evals.jsonl (one row per stage and version:
  `base` before the warm start, `sft` after it, `rl` during and after RL), plus
  eval_start.json / eval_end.json. Rows already there (a resumed run) are not redone.
  Evaluations during RL (`eval.every`) use the first `eval.every_n` tasks (0: all)."""

  def __init__(self, c, model):
    self.c, self.model = c, model
    self.path = os.path.join(c.run_dir, "evals.jsonl")
    self.rows = []
    if os.path.exists(self.path):
      with open(self.path) as f:
        self.rows = [json.loads(line) for line in f if line.strip()]

  def get(self, stage, version, n):
    return next((r for r in self.rows if (r["stage"], r["version"], r["n"]) == (stage, version, n)),
                None)

  def run(self, stage, version, params, label, n=0):
    n = n or self.c.eval.n
    row = self.get(stage, version, n)
    if row is None:  # the full evaluations calibrate too, if the config asks
      row = {"stage": stage, "version": version,
             **_evaluate(self.c, self.model, params, label, n,
                         self.c.eval.calibration and n == self.c.eval.n)}
      self.rows.append(row)
      with open(self.path, "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def _table(stages: dict) -> dict:
  """{stage: {level or "all": {"accuracy", "tool_calls"}}}: the before/after table."""
  out = {}
  for name, r in stages.items():
    if r is None:
      continue
    row = {"all": {"accuracy": r["accuracy"], "tool_calls": r["tool_calls_per_trajectory"]}}
    for lv, x in r.get("by_level", {}).items():
      row[lv] = {"accuracy": x["accuracy"], "tool_calls": x["tool_calls_per_trajectory"]}
      if "reward_never" in x:  # calibrated: what answering without calling scores
        row[lv]["accuracy_alone"] = x["reward_never"]
    out[name] = row
  return out


def _print_table(table: dict, n: int, decoding: str) -> None:
  """The before/after table on stderr: accuracy (and, calibrated, in brackets the accuracy
  of answering without calling: `reward_never`, the forced accuracy for tool_arithmetic) and
  tool calls per difficulty and stage."""
  cols = [k for k in next(iter(table.values()))]
  alone = any("accuracy_alone" in x for row in table.values() for x in row.values())
  w = 18 if alone else 12

  def acc(x):
    if "accuracy_alone" in x:
      return f"{x['accuracy']:.3f} ({x['accuracy_alone']:.2f})"
    return f"{x['accuracy']:.3f}"

  head = "".join(f"{c + ' acc':>{w}}{c + ' calls':>13}" for c in cols)
  lines = [f"held-out, {decoding}, n={n}" + (
      "; (in brackets: accuracy answering without calling)" if alone else ""),
           f"{'':8}{head}"]
  for stage, row in table.items():
    lines.append(f"{stage:8}" + "".join(f"{acc(row[c]):>{w}}{row[c]['tool_calls']:>13.2f}"
                                        for c in cols))
  print("\n".join(lines), file=sys.stderr, flush=True)


def main(argv):
  if len(argv) > 1:
    common.fail(f"unexpected arguments {argv[1:]}")
  from absl import flags, logging
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # keep the progress bar readable
  c = common.load_config()
  common.require_tool_isolation(c)
  if c.sft.steps and not c.run_dir:
    common.fail("sft.steps > 0 needs --run_dir (the warm start is saved in run_dir/sft)")
  t0 = time.time()
  model = common.load_model(c)
  from fr_jax import config as rcfg
  from fr_jax import system
  from launch.progress import Progress
  times = {"load": time.time() - t0}  # stage -> seconds in this invocation

  def timed(stage, t):
    times[stage] = times.get(stage, 0.0) + time.time() - t
  run = c.run_dir
  path = lambda name: os.path.join(run, name)  # noqa: E731
  stop = common.stop_on_interrupt()
  evals = Evals(c, model) if (c.eval.n and run) else None
  if run:
    os.makedirs(run, exist_ok=True)
  stages = {}
  warm = None
  if c.sft.steps:
    from fr_jax.sft import SFTDataError, warm_start
    if evals:
      t = time.time()
      stages["base"] = evals.run("base", 0, model.params, "the base model")
      timed("base_eval", t)
    t = time.time()
    try:
      warm = warm_start(c, model, path("sft"), stop=stop)
    except (SFTDataError, FileNotFoundError) as e:
      common.fail(str(e))
    timed("warm_start", t)
    if not warm["finished"]:
      print(f"interrupted in the warm start at step {warm['steps']}; run the same command to "
            "resume", file=sys.stderr)
      return
    model = dataclasses.replace(model, params=warm.pop("params"))
    if evals:
      evals.model = model
  ev_start = None
  if evals:
    t = time.time()
    ev_start = evals.run("sft" if c.sft.steps else "rl", 0, model.params,
                         "the warm-started model" if c.sft.steps else "the starting model")
    stages["sft" if c.sft.steps else "start"] = ev_start
    timed("start_eval", t)
    last = max((r for r in evals.rows if r["stage"] in ("sft", "rl")), key=lambda r: r["version"])
    held_out = {"version": last["version"], "accuracy": last["accuracy"], "n": last["n"]}
    json.dump(ev_start, open(path("eval_start.json"), "w"), indent=1)
  else:
    held_out = None
  final: dict = {}

  def on_update(m, service, bar):
    every = c.eval.every
    if evals and every and service.version % every == 0 and service.version < c.max_updates:
      t = time.time()
      v, params = service.weights(0)
      n = c.eval.every_n or c.eval.n
      row = evals.run("rl", v, params, f"version {v} ({n} of the {c.eval.n} tasks)"
                      if n < c.eval.n else f"version {v}", n=n)
      held_out.update(version=v, accuracy=row["accuracy"], n=n)
      timed("rl_evals", t)
    bar.update(m, service, held_out=held_out)

  t_rl = time.time()
  try:
    with Progress(c.max_updates) as bar:
      summary = system.train_in_process(c, model=model, on_update=lambda m, s: on_update(m, s, bar),
                                        stop=stop, final=final)
  except rcfg.ConfigError as e:
    common.fail(f"config error: {e}")
  times["rl"] = time.time() - t_rl - times.get("rl_evals", 0.0)  # the updates alone
  if stop.is_set():
    print(f"interrupted at version {summary['version']}; run the same command to resume",
          file=sys.stderr)
  elif evals:
    t = time.time()
    ev_end = evals.run("rl", final["version"], final["params"], f"version {final['version']}")
    timed("end_eval", t)
    json.dump(ev_end, open(path("eval_end.json"), "w"), indent=1)
    stages["rl"] = ev_end
    summary.update(heldout_accuracy_start=ev_start["accuracy"],
                   heldout_accuracy_end=ev_end["accuracy"],
                   heldout_n=c.eval.n, heldout_tool_calls_end=ev_end["tool_calls_per_trajectory"],
                   heldout_table=_table(stages))
    _print_table(summary["heldout_table"], c.eval.n, ev_end["decoding"])
    if "calibration" in ev_end:  # where it calls against what it knows, and the targets
      from fr_jax.evaluate import calibration_table
      print(f"after RL, per difficulty:\n{calibration_table(ev_end)}", file=sys.stderr,
            flush=True)
      summary["calibration_end"] = ev_end["calibration"]
  if warm is not None:
    summary["sft"] = {k: warm[k] for k in ("steps", "examples", "loss_first", "loss_last",
                                           "export", "wall_s")}
  if run and os.path.exists(path("metrics.jsonl")):
    from fr_jax.plots import plot_run
    summary["plot"] = plot_run(run)
  summary["wall_s"] = round(time.time() - t0, 1)
  summary["stage_seconds"] = {k: round(v, 1) for k, v in times.items()}
  print("time per stage: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
        + f"; total {summary['wall_s']:.0f} s", file=sys.stderr, flush=True)
  if run:
    json.dump(summary, open(path("summary.json"), "w"), indent=1, default=str)
  common.print_json(summary)


if __name__ == "__main__":
  common.run(main)
