r"""Train with FlashREINFORCE, everything in one process.

  python -m launch.train --config=experiments/configs/cpu_default.py
  python -m launch.train --config=experiments/configs/tiny_test.py --run_dir=/tmp/tiny \
      --config.max_updates=10 --config.objective.reduction=token_mean

The learner runs on this thread; `config.rollout.num_workers` rollout workers run as threads
sharing the model and the devices (weights are handed over as arrays, nothing serialised).
With `config.run_dir` set, the run writes metrics.jsonl, TensorBoard events and Orbax
checkpoints there, and the same command resumes from the last checkpoint. It prints a
progress bar and, at the end, one JSON line with the run summary. Bad flags or configs exit
with status 2 and a one-line message.
"""

from launch import common


def main(argv):
  if len(argv) > 1:
    common.fail(f"unexpected arguments {argv[1:]}")
  c = common.load_config()
  model = common.load_model(c)
  from fr_jax import config as rcfg
  from fr_jax import system
  from launch.progress import Progress
  try:
    with Progress(c.max_updates) as bar:
      summary = system.train_in_process(c, model=model, on_update=bar.update)
  except rcfg.ConfigError as e:
    common.fail(f"config error: {e}")
  common.print_json(summary)


if __name__ == "__main__":
  common.run(main)
