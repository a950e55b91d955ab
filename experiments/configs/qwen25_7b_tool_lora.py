"""qwen25_7b_tool with LoRA: rank-16 adapters (alpha 32) on every projection of
Qwen2.5-7B-Instruct over a bfloat16 base, the learner on one H100 80GB.

  FR_JAX_CKPT=/ckpt/Qwen2.5-7B-Instruct python -m launch.learner \\
      --config=experiments/configs/qwen25_7b_tool_lora.py --run_dir=runs/tool_lora
  python -m launch.compile_check --config=experiments/configs/qwen25_7b_tool_lora.py \\
      --topology=h100-1

Hardware: one H100 80GB for the learner (`launch.compile_check`: 40.7 of 59.3 GiB usable,
docs/lora.md "What LoRA fits on GPUs"; the full fine-tune needs 154.5) plus a vLLM fleet
started with `launch.vllm_server --lora_rank=16` (`launch.cluster` passes it), which loads each
version as an adapter. Expected time: not measured. Needs an HF checkpoint.

The learning rate is 10x the full recipe's, LoRA's usual ratio (as cpu_lora): not tuned.
"""

from experiments.configs import qwen25_7b_tool


def get_config():
  c = qwen25_7b_tool.get_config()
  c.model.lora.rank = 16
  c.model.lora.alpha = 32.0
  c.model.lora.targets = "wq,wk,wv,wo,w_gate,w_up,w_down"
  c.model.param_dtype = "bfloat16"  # the frozen base; the adapters train in float32
  c.optim.lr = 1e-5
  c.mesh.data, c.mesh.fsdp = 1, 1
  return c
