"""The ALFWorld-like household environment (fr_jax.envs.textworld), B=64, delta=1e-3, with
seen and unseen layouts for evaluation.

  FR_JAX_CKPT=/ckpt/Qwen2.5-7B-Instruct \\
    python -m launch.learner --config=experiments/configs/alfworld_like.py --run_dir=runs/alf

Hardware: 8 GPUs for the learner plus an SGLang fleet. Expected time: the paper's 200 steps
(12.8k trajectories), some hours (not measured here). Needs an HF checkpoint.
"""

from experiments.configs import _paper


def get_config():
  c = _paper.base("FR_JAX_CKPT")
  c.batch_size = 64
  c.objective.delta = 1e-3
  c.max_updates = 200
  c.packing.row_len = 8192
  c.env.name = "textworld"
  c.agent.max_turns = 30
  c.agent.max_new_tokens = 256
  c.agent.max_total_tokens = 8192
  c.agent.template = "model"
  return c
