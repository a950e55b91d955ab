"""R1-Distill-Qwen-1.5B, long chain-of-thought, asynchronous at policy lag about 4
(delta=5e-3).

  FR_JAX_CKPT=/ckpt/DeepSeek-R1-Distill-Qwen-1.5B \\
    python -m launch.learner --config=experiments/configs/r1_distill_1p5b_longcot.py \\
      --run_dir=runs/r1

Hardware: 8 GPUs for the learner plus an SGLang fleet. Expected time: the paper's 6000 async
updates are multi-day at 16k-token responses (not measured here). Needs an HF checkpoint.
"""

from experiments.configs import _paper


def get_config():
  c = _paper.base("FR_JAX_CKPT")
  c.model.shapes = "r1-distill-qwen-1.5b"  # for launch.compile_check (no checkpoint needed)
  c.batch_size = 128
  c.objective.delta = 5e-3
  c.max_updates = 6000
  c.env.name = "arithmetic"
  c.env.kwargs.difficulty = 4
  c.agent.max_turns = 1
  c.agent.max_new_tokens = 15872
  c.agent.max_total_tokens = 16384
  c.max_policy_lag = 4  # the paper runs at lag ~4
  c.service.lag_bound = 4
  return c
