"""Qwen2.5-7B-Instruct with the sandboxed Python tool, multi-turn (delta=1e-3).

  FR_JAX_CKPT=/ckpt/Qwen2.5-7B-Instruct \\
    python -m launch.learner --config=experiments/configs/qwen25_7b_tool.py --run_dir=runs/tool

Hardware: 8+ GPUs for the learner (fsdp) plus an SGLang fleet. Expected time: the paper's 600
steps, about a day (not measured here). Needs an HF checkpoint.
"""

from experiments.configs import _paper


def get_config():
  c = _paper.base("FR_JAX_CKPT")
  c.model.shapes = "qwen2.5-7b-instruct"  # for launch.compile_check (no checkpoint needed)
  c.batch_size = 128
  c.objective.delta = 1e-3
  c.max_updates = 600
  c.mesh.data, c.mesh.fsdp = 1, 8
  c.packing.row_buckets = (8, 16, 24, 32)
  return _paper.python_tool(c)
