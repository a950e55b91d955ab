"""Shared settings of the paper's GPU recipes: an HF checkpoint path (given on the command line
or in FR_JAX_CKPT), an SGLang fleet for rollouts, bf16 compute, long packed rows, a data x
fsdp mesh. The numbers come from ../shared/PAPER_NOTES.md (the authors' defaults)."""

import os

from fr_jax import config as rcfg


def base(checkpoint_env: str):
  c = rcfg.default_config()
  c.model.name = os.environ.get(checkpoint_env, f"hf:/path/to/{checkpoint_env.lower()}")
  c.model.compute_dtype = "bfloat16"
  c.model.remat = True
  c.optim.lr = 1e-6  # Molt R1 defaults
  c.packing.row_len = 16384
  c.packing.row_buckets = (8, 16, 24, 32, 48, 64)
  c.mesh.data, c.mesh.fsdp = 2, 4  # 8 accelerators; scale the axes with the fleet
  c.rollout.engine = "sglang"
  c.rollout.server_url = os.environ.get("SGLANG_URL", "http://127.0.0.1:30000")
  c.rollout.inflight = 256
  c.service.export_hf = True  # the SGLang fleet reloads from run_dir/exports
  c.service.queue_capacity = 1024
  c.checkpoint.every = 50
  c.eval.n = 0
  return c


def python_tool(c):
  """The tool-use recipes' episodes (Qwen2.5-7B, Qwen3-30B-A3B): arithmetic with the Python
  tool, up to 8 model turns of 1,024 tokens in 8,192, the model's own chat template, and 8k
  packed rows (no trajectory is longer: docs/scale.md)."""
  c.env.name = "arithmetic"
  c.env.kwargs.difficulty = 4
  c.agent.max_turns = 8
  c.agent.max_new_tokens = 1024
  c.agent.max_total_tokens = 8192
  c.agent.template = "model"
  c.packing.row_len = 8192
  return c
