"""tiny_test: a tiny random model with a byte-level tokenizer on arithmetic, for tests and
smoke runs. It checks the plumbing, not learning (a random model rarely earns reward).

  python -m launch.train --config=experiments/configs/tiny_test.py
  make smoke   # learner + 2 worker processes over loopback gRPC, 5 updates

Hardware: any CPU. Time: about a minute on 2 cores (most of it compiling).
"""

from fr_jax import config as rcfg


def get_config():
  c = rcfg.default_config()
  c.model.name = "tiny-chat"
  c.model.remat = False
  c.batch_size = 4
  c.max_updates = 5
  c.optim.lr = 1e-3
  c.optim.total_steps = 100
  c.objective.delta = float("inf")  # a random model drifts far per step; keep every row
  c.packing.row_len = 512
  c.packing.row_buckets = (1, 2, 4, 8)
  c.agent.max_turns = 2
  c.agent.max_new_tokens = 24
  c.agent.max_total_tokens = 448
  c.rollout.num_workers = 2
  c.rollout.inflight = 4
  c.rollout.num_slots = 4
  c.service.queue_capacity = 16
  c.checkpoint.every = 1
  c.checkpoint.async_save = False
  c.log.peak_flops = 1e11  # skip the start-up matmul measurement
  c.eval.n = 0  # launch.train evaluates held-out tasks when > 0
  return c
