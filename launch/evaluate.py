r"""Held-out evaluation of a model or a training checkpoint.

  python -m launch.evaluate                                  # the bundled model, untrained
  python -m launch.evaluate --checkpoint=runs/demo --n=200   # a run's latest checkpoint
  python -m launch.evaluate --env=countdown --samples=4 --temperature=1.0

Greedy decoding for --samples=1; with k > 1 samples per task it adds avg@k and pass@k.
--calibration (tool_arithmetic, e.g. with --config.env.kwargs.levels: its difficulty bins)
runs every task again without the tool and once more with the reply begun as a direct answer
(the forced pass), and prints, per level, accuracy without and with the tool, tool calls,
reward against the best fixed policy, the correlation of calls with need and whether issue
60's targets hold (fr_jax.evaluate.TARGETS).
Reports accuracy, tool calls per trajectory, response length, truncation rate and turns as a
table on stderr and one JSON line on stdout. The agent settings (template, limits) come from
--config, the same as training.

--checkpoint and --step are resolved as `launch.export` resolves them (`common.find_checkpoint`)
and only the step's parameters are read (`common.read_checkpoint`: no optimizer state, no
Learner), in the config's model.param_dtype; `version` is the step's policy version.
"""

import sys

from absl import flags

from launch import common

flags.DEFINE_string("checkpoint", "", "a run directory (or its checkpoints/ folder); empty: "
                    "the config's model as loaded")
flags.DEFINE_string("env", None, "environment (default: config.env.name)")
flags.DEFINE_integer("n", 200, "held-out tasks (the first n of the test split)")
flags.DEFINE_integer("samples", 1, "samples per task (1: greedy)")
flags.DEFINE_float("temperature", 1.0, "sampling temperature when --samples > 1")
flags.DEFINE_integer("step", None, "checkpoint step (default: the newest committed)")
flags.DEFINE_bool("calibration", False, "also run every task without the tool: per "
                  "difficulty level, accuracy without it, and how well tool calls follow need "
                  "(envs with levels and the python tool: tool_arithmetic)")
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
  if FLAGS.step is not None and not ck:
    common.fail(f"--step={FLAGS.step} picks a step of --checkpoint: give --checkpoint too")
  # A bad --checkpoint fails before the model loads.
  d, step = common.find_checkpoint(ck, FLAGS.step) if ck else (None, None)
  model = common.load_model(c)
  import jax
  import jax.numpy as jnp

  from fr_jax import envs, system
  from fr_jax.evaluate import calibration_table, evaluate, table
  from fr_jax.transport.codec import flatten
  params, version = model.params, 0
  if ck:
    params, meta = common.read_checkpoint(d / str(step))
    run = meta["config"]["model"]["name"]
    from fr_jax.models import lora
    fields = lora.config_fields(meta["config"]["model"])
    if fields:  # a LoRA run: the model its adapters compute
      params = lora.merged(params, model.config.replace(**fields))
    shapes = {k: a.shape for k, a in flatten(model.params).items()}
    common.check_params(params, shapes, c.model.name,
                        f" (the run trained {run!r}: evaluate it with the run's --config)")
    # In the config's param_dtype, as the learner held and evaluated them; on the device.
    params = jax.tree.map(lambda a, w: jnp.asarray(a, w.dtype), params, model.params)
    version = meta.get("policy_version", step)
  try:
    env = envs.make(c.env.name, **(c.env.kwargs.to_dict() if not FLAGS.env else {}))
    r = evaluate(model.config, params, model.tokenizer, env, system.agent_config(c),
                 n=FLAGS.n, samples=FLAGS.samples, temperature=FLAGS.temperature,
                 calibration=FLAGS.calibration)
  except ValueError as e:
    common.fail(str(e))
  r = {"model": c.model.name, "checkpoint": str(d / str(step)) if ck else "", "version": version,
       **r}
  shown = ("by_level", "calibration") if FLAGS.calibration else ()
  print(table({k: v for k, v in r.items() if k not in shown}), file=sys.stderr)
  if FLAGS.calibration:
    print(calibration_table(r), file=sys.stderr)
  common.print_json(r)


if __name__ == "__main__":
  common.run(main)
