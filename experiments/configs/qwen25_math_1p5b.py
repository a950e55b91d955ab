"""Qwen2.5-Math-1.5B on math with FlashREINFORCE (the paper's main math recipe: delta=3e-3,
B=128, one rollout per prompt, fresh batch per update).

  FR_JAX_CKPT=/ckpt/Qwen2.5-Math-1.5B SGLANG_URL=http://gpu:30000 \\
    python -m launch.learner --config=experiments/configs/qwen25_math_1p5b.py --run_dir=runs/math
  python -m launch.worker --config=experiments/configs/qwen25_math_1p5b.py --learner=HOST:PORT

Hardware: 8 GPUs for the learner (data=2 x fsdp=4) plus an SGLang fleet. Expected time: the
paper's 2000 steps take on the order of a day on 8 H100-class GPUs (not measured here).
Needs an HF checkpoint directory; nothing is fetched. The built-in arithmetic env stands in
for the math datasets (MATH, AMC, ...), which are not bundled.
"""

from experiments.configs import _paper


def get_config():
  c = _paper.base("FR_JAX_CKPT")
  c.model.shapes = "qwen2.5-math-1.5b"  # for launch.compile_check (no checkpoint needed)
  c.batch_size = 128
  c.objective.delta = 3e-3
  c.max_updates = 2000
  c.env.name = "arithmetic"
  c.env.kwargs.difficulty = 4
  c.agent.max_turns = 1
  c.agent.max_new_tokens = 4096
  c.agent.max_total_tokens = 4608
  c.max_policy_lag = 2
  return c
