"""cpu_default: SmolLM2-135M-Instruct (the embedded default) learns arithmetic with the
sandboxed Python tool, on one CPU machine.

  python -m launch.train --config=experiments/configs/cpu_default.py --run_dir=runs/demo
  make demo

Hardware: a laptop-class CPU (2 cores suffice). Nothing is downloaded.
"""

from fr_jax import config as rcfg


def get_config():
  c = rcfg.default_config()
  c.model.name = "smollm2-135m-instruct"
  c.batch_size = 16
  c.max_updates = 40
  c.optim.lr = 2e-6
  c.optim.total_steps = 40
  c.objective.delta = 3e-3
  c.packing.row_len = 1024
  c.packing.row_buckets = (1, 2, 3, 4, 6, 8)
  c.env.name = "arithmetic"
  c.agent.max_turns = 3
  c.agent.max_new_tokens = 128
  c.agent.max_total_tokens = 640
  c.rollout.num_workers = 1
  c.rollout.inflight = 16
  c.rollout.num_slots = 16
  c.service.queue_capacity = 64
  c.checkpoint.every = 5
  return c
