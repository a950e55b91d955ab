r"""Held-out evaluation of a model or a training checkpoint.

  python -m launch.evaluate                                  # the bundled model, untrained
  python -m launch.evaluate --checkpoint=runs/demo --n=200   # a run's latest checkpoint
  python -m launch.evaluate --env=countdown --samples=4 --temperature=1.0

Greedy decoding for --samples=1; with k > 1 samples per task it adds avg@k and pass@k.
Reports accuracy, tool calls per trajectory, response length, truncation rate and turns as a
table on stderr and one JSON line on stdout. The agent settings (template, limits) come from
--config, the same as training.
"""

import os
import sys

from absl import flags

from launch import common

flags.DEFINE_string("checkpoint", "", "a run directory (or its checkpoints/ folder); empty: "
                    "the config's model as loaded")
flags.DEFINE_string("env", None, "environment (default: config.env.name)")
flags.DEFINE_integer("n", 200, "held-out tasks (the first n of the test split)")
flags.DEFINE_integer("samples", 1, "samples per task (1: greedy)")
flags.DEFINE_float("temperature", 1.0, "sampling temperature when --samples > 1")
flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)")
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    common.fail(f"unexpected arguments {argv[1:]}")
  if FLAGS.n < 1 or FLAGS.samples < 1:
    common.fail("--n and --samples must be >= 1")
  c = common.load_config()
  if FLAGS.env:
    c.env.name = FLAGS.env
  ck = FLAGS.checkpoint
  if ck and not os.path.isdir(ck):
    common.fail(f"--checkpoint={ck}: no such directory")
  model = common.load_model(c)
  from fr_jax import envs, system
  from fr_jax.evaluate import evaluate, table
  params, version = model.params, 0
  if ck:
    from fr_jax.learner.learner import Learner
    d = ck if os.path.basename(os.path.normpath(ck)) == "checkpoints" else \
        os.path.join(ck, "checkpoints")
    with c.unlocked():
      c.checkpoint.dir, c.log.dir, c.log.peak_flops = d, "", 1.0
    learner = Learner(c, model=model)
    if learner.restore(FLAGS.step) is None:
      common.fail(f"--checkpoint={ck}: no checkpoint in {d}")
    params, version = learner.params, learner.version
  try:
    env = envs.make(c.env.name, **(c.env.kwargs.to_dict() if not FLAGS.env else {}))
    r = evaluate(model.config, params, model.tokenizer, env, system.agent_config(c),
                 n=FLAGS.n, samples=FLAGS.samples, temperature=FLAGS.temperature)
  except ValueError as e:
    common.fail(str(e))
  r = {"model": c.model.name, "checkpoint": ck, "version": version, **r}
  print(table(r), file=sys.stderr)
  common.print_json(r)


if __name__ == "__main__":
  common.run(main)
