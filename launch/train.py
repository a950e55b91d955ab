r"""Train with FlashREINFORCE, everything in one process.

  python -m launch.train --config=experiments/configs/cpu_default.py --run_dir=runs/demo
  python -m launch.train --config=experiments/configs/tiny_test.py --run_dir=/tmp/tiny \
      --config.max_updates=10 --config.objective.reduction=token_mean

The learner runs on this thread; `config.rollout.num_workers` rollout workers run as threads
sharing the model and the devices (weights are handed over as arrays, nothing serialised).
With `config.run_dir` set, the run writes there: metrics.jsonl, TensorBoard events (tb/),
Orbax checkpoints (checkpoints/), eval_start.json / eval_end.json (greedy held-out accuracy
on `config.eval.n` test tasks), plot.png and summary.json. Ctrl-C stops after the current
update with a checkpoint; the same command resumes from the last checkpoint. A progress bar
shows reward, acceptance rate, tokens/s, lag and queue depth; the last stdout line is the run
summary as JSON. Bad flags or configs exit with status 2 and a one-line message.
"""

import json
import os
import signal
import sys
import threading
import time

from launch import common


def _evaluate(c, model, params, label):
  from fr_jax import envs, system
  from fr_jax.evaluate import evaluate
  env = envs.make(c.env.name, **c.env.kwargs.to_dict())
  print(f"evaluating {label}: {c.eval.n} held-out {c.env.name} tasks, greedy ...",
        file=sys.stderr, flush=True)
  r = evaluate(model.config, params, model.tokenizer, env, system.agent_config(c), n=c.eval.n,
               num_slots=c.eval.num_slots)
  print(f"  {label}: accuracy {r['accuracy']:.3f}, tool calls {r['tool_calls_per_trajectory']:.2f}"
        f", length {r['response_length']:.1f}, truncated {r['truncation_rate']:.3f} "
        f"({r['seconds']:.0f}s)", file=sys.stderr, flush=True)
  return r


def main(argv):
  if len(argv) > 1:
    common.fail(f"unexpected arguments {argv[1:]}")
  from absl import flags, logging
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # keep the progress bar readable
  c = common.load_config()
  common.require_tool_isolation(c)
  model = common.load_model(c)
  from fr_jax import config as rcfg
  from fr_jax import system
  from launch.progress import Progress
  t0 = time.time()
  run = c.run_dir
  path = lambda name: os.path.join(run, name)  # noqa: E731
  ev_start = None
  if c.eval.n and run:
    os.makedirs(run, exist_ok=True)
    if os.path.exists(path("eval_start.json")):
      ev_start = json.load(open(path("eval_start.json")))
    else:
      ev_start = _evaluate(c, model, model.params, "the starting model")
      json.dump(ev_start, open(path("eval_start.json"), "w"), indent=1)
  stop = threading.Event()

  def interrupt(*_):
    if stop.is_set():
      raise KeyboardInterrupt
    print("\nstopping after this update (a checkpoint will be saved); Ctrl-C again to abort",
          file=sys.stderr, flush=True)
    stop.set()

  signal.signal(signal.SIGINT, interrupt)
  final: dict = {}
  try:
    with Progress(c.max_updates) as bar:
      summary = system.train_in_process(c, model=model, on_update=bar.update, stop=stop,
                                        final=final)
  except rcfg.ConfigError as e:
    common.fail(f"config error: {e}")
  if stop.is_set():
    print(f"interrupted at version {summary['version']}; run the same command to resume",
          file=sys.stderr)
  elif c.eval.n and run:
    ev_end = _evaluate(c, model, final["params"], f"version {final['version']}")
    json.dump(ev_end, open(path("eval_end.json"), "w"), indent=1)
    summary.update(heldout_accuracy_start=ev_start["accuracy"],
                   heldout_accuracy_end=ev_end["accuracy"],
                   heldout_n=c.eval.n, heldout_tool_calls_end=ev_end["tool_calls_per_trajectory"])
  if run and os.path.exists(path("metrics.jsonl")):
    from fr_jax.plots import plot_run
    summary["plot"] = plot_run(run)
  summary["wall_s"] = round(time.time() - t0, 1)
  if run:
    json.dump(summary, open(path("summary.json"), "w"), indent=1, default=str)
  common.print_json(summary)


if __name__ == "__main__":
  common.run(main)
