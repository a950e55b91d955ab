"""tiny_moe: a tiny random Qwen3-MoE (`tiny-chat-moe`: 4 sparse layers, 8 experts, top-2,
byte-level tokenizer) learns the `digits` copy task at policy lag 4-8, with rollout routing
replay on (the default) or off (`--config.routing_replay=False`). The routing-replay
experiment of docs/replication.md ("Mixture of experts") runs it with 3 seeds each way:

  python -m launch.train --config=experiments/configs/tiny_moe.py --run_dir=runs/moe_r3_s0 \
      --config.model.seed=0 --config.env.seed=0
  python -m launch.train --config=experiments/configs/tiny_moe.py --run_dir=runs/moe_free_s0 \
      --config.model.seed=0 --config.env.seed=0 --config.routing_replay=False

A supervised warm start (800 steps on the env's imperfect demonstrations) teaches the format
first; then 60 updates of RL train the routers with the rest of the model. In flight: 4
workers x 16 episodes for batches of 8, so records wait several updates in the queue: policy
lag 4-8 (records older than 8 are dropped). Hardware: any CPU. Time: about 10 minutes on 2
cores (most of it the warm start, the same for both arms of a seed).
"""

from fr_jax import config as rcfg


def get_config():
  c = rcfg.default_config()
  c.model.name = "tiny-chat-moe"
  c.model.remat = False
  c.env.name = "digits"
  c.env.kwargs.tool = False
  c.agent.max_turns = 1
  c.agent.max_new_tokens = 10
  c.agent.max_total_tokens = 64
  c.sft.steps = 800
  c.sft.batch_size = 32
  c.sft.lr = 3e-3
  c.sft.examples = 4096
  c.sft.checkpoint_every = 400
  c.batch_size = 8
  c.max_updates = 60
  c.optim.lr = 1e-3
  c.optim.warmup_frac = 0.0
  c.optim.min_lr_ratio = 1.0
  c.objective.delta = 0.1  # the tiny model moves far per update (docs/replication.md)
  c.max_policy_lag = 8
  c.packing.row_len = 512
  c.packing.row_buckets = (1, 2)
  c.rollout.num_workers = 4
  c.rollout.inflight = 16
  c.rollout.num_slots = 16
  c.service.queue_capacity = 48
  c.checkpoint.every = 1000
  c.checkpoint.async_save = False
  c.log.peak_flops = 1e11
  c.log.routing_counterfactual = True  # both arms log the mismatch with and without replay
  c.eval.n = 100
  c.eval.temperature = 1.0
  return c
