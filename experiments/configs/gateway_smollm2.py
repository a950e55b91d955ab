"""gateway_smollm2: SmolLM2-135M-Instruct behind `launch.gateway`, trained in the same process on
the episodes a user's agent finishes (docs/rollout.md, "Bring your own agent").

  FR_JAX_GATEWAY_KEY=secret python -m launch.gateway \
      --config=experiments/configs/gateway_smollm2.py --run_dir=runs/gateway
  FR_JAX_GATEWAY_KEY=secret python -m experiments.agents.openai_tool_agent --episodes=16

SmolLM2's chat template is plain ChatML with no tool support, so the gateway writes tools,
calls and results in the Hermes format (`gateway.tool_format=hermes`), as the agent demo's
warm start teaches the model to. Batches of 8 rewarded episodes; 2 updates, then the run
stops.

Hardware: a 2-core CPU suffices. Measured time there, with the agent sharing the cores: 16
episodes and both updates in 3-5 minutes (80-139 s per update, alone or beside other work).
"""

from fr_jax import config as rcfg


def get_config():
  c = rcfg.default_config()
  c.model.name = "smollm2-135m-instruct"
  c.env.name = "tool_arithmetic"  # unused by the gateway (the agent brings its tasks)
  c.gateway.tool_format = "hermes"
  c.agent.max_new_tokens = 64
  c.agent.max_total_tokens = 768
  c.batch_size = 8
  c.max_updates = 2
  c.optim.lr = 2e-5
  c.optim.warmup_frac = 0.0
  c.optim.total_steps = 2
  c.objective.delta = 1e-2
  c.packing.row_len = 768
  c.packing.row_buckets = (1, 2, 4, 8)
  c.rollout.num_slots = 8
  c.service.queue_capacity = 64
  c.checkpoint.every = 1
  return c
