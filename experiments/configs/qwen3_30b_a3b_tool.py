"""Qwen3-30B-A3B (mixture of experts: 128 experts, top-8, 3.3B active parameters) with the
sandboxed Python tool, multi-turn, asynchronous at policy lag about 8 (delta=1e-2), with
rollout routing replay.

  FR_JAX_CKPT=/ckpt/Qwen3-30B-A3B SGLANG_URL=http://gpu:30000 \\
    python -m launch.learner --config=experiments/configs/qwen3_30b_a3b_tool.py \\
      --run_dir=runs/moe
  python -m launch.worker --config=experiments/configs/qwen3_30b_a3b_tool.py --learner=HOST:PORT

The paper's run (../shared/PAPER_NOTES.md): 67.1 at step 800 against GRPO's 60.3 at lag about
1, with the same 102.4k rollouts (B=128 a step), at delta=1e-2. Routing replay is on (the
learner scores every token with the experts the engine routed it to) and the routers'
load-balancing loss is off (router_aux_loss_coef=0: nothing is added to the REINFORCE
objective). The SGLang server must return the routed experts: launch it with
`--enable-return-routed-experts` and point SGLANG_URL at it, not at sglang-router
(fr_jax/rollout/sglang.py).

Hardware: 16+ accelerators for the learner (fsdp over 16: the 30.5B parameters' f32 weights
and Adam moments are 366 GB) plus an SGLang fleet. The smallest TPU slice whose update fits is
v5p-16 (8 chips, mesh 1 x 8, one 8k row per chip: 81.4 of 95 GiB per chip, compiled by
`launch.compile_check --topology=v5p-16 --rows_per_device=1`; docs/scale.md, "Experts on the
mesh"). On GPUs (the grouped Triton expert kernels, moe_impl auto): one H200 node at the
recipe's 4 rows per device (99.8 of 105.8 GiB), or two H100 nodes at 2 rows
(`--topology=h100-2x8 --rows_per_device=2`: 57.5 of 59.3 GiB); docs/scale.md, "The 30B MoE on
GPUs". Expected time: the paper's 800 steps, days (not measured here). Needs an HF
checkpoint.
"""

from experiments.configs import _paper


def get_config():
  c = _paper.base("FR_JAX_CKPT")
  c.model.shapes = "qwen3-30b-a3b"  # for launch.compile_check (no checkpoint needed)
  c.batch_size = 128
  c.objective.delta = 1e-2
  c.max_updates = 800
  c.routing_replay = True
  c.objective.router_aux_loss_coef = 0.0
  c.mesh.data, c.mesh.fsdp = 1, 16  # 128 experts: 8 whole experts per device (learner.mesh)
  c.packing.row_buckets = (16, 32, 48, 64)
  c.max_policy_lag = 8  # the paper runs at lag ~8
  c.service.lag_bound = 8
  c.rollout.inflight = 1024  # B=128: about 8 batches in flight (512 gives lag ~4)
  return _paper.python_tool(c)
