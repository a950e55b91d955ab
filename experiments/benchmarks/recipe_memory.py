r"""The paper's long-CoT recipe, compiled: the learner's update for packed rows of 16,384 tokens
of R1-Distill-Qwen-1.5B's real shapes (random-weight shapes only: nothing is materialised),
on the mesh the recipe declares, with its memory per device.

  python -m experiments.benchmarks.recipe_memory                 # 8 CPU devices, the recipe
  python -m experiments.benchmarks.recipe_memory --attention=naive --rows=8

The recipe (experiments/configs/r1_distill_1p5b_longcot.py) declares a data=2 x fsdp=4 mesh;
on a machine without 8 accelerators the mesh is made of forced host devices (set before JAX
starts, which this script does), which compiles the same SPMD program XLA:CPU would run.
Memory is XLA's `memory_analysis()` of the compiled per-device program (arguments: sharded
parameters, optimizer state and batch; temp: activations and workspace). What a GPU or TPU
needs differs with its compiler, but the scaling with row length does not.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

from absl import app, flags

from experiments.benchmarks.common import emitter, machine

flags.DEFINE_string("recipe", "experiments.configs.r1_distill_1p5b_longcot", "config module")
flags.DEFINE_integer("rows", 0, "rows per micro-batch (0: the recipe's smallest bucket)")
flags.DEFINE_integer("row_len", 0, "tokens per row (0: the recipe's)")
flags.DEFINE_string("attention", None, "model.attention (default: the recipe's)")
flags.DEFINE_float("action_fraction", 1.0, "the fraction of each row's positions that are "
                   "actions: the LM head scores the head bucket that holds them (1: all)")
F = flags.FLAGS

def main(argv):
  del argv
  import importlib
  import time

  from fr_jax.learner.compile import compile_update_from_shapes
  from fr_jax.models.registry import shape_config
  emit = emitter("recipe_memory")
  emit("machine", **machine())
  c = importlib.import_module(F.recipe).get_config()
  if F.row_len:
    c.packing.row_len = F.row_len
  if F.attention:
    c.model.attention = F.attention
  rows = F.rows or min(c.packing.row_buckets)
  cfg = shape_config("r1-distill-qwen-1.5b")
  t0 = time.perf_counter()
  exe, mesh, head = compile_update_from_shapes(c, cfg, rows,
                                               action_fraction=F.action_fraction)
  m = exe.memory_analysis()
  gib = lambda b: round(b / 2**30, 2)  # noqa: E731
  emit("compiled", recipe=F.recipe, model="R1-Distill-Qwen-1.5B shapes",
       params_b=round(cfg.num_params / 1e9, 3), mesh=dict(mesh.shape),
       devices=mesh.devices.size, rows=rows, row_len=c.packing.row_len,
       tokens_per_micro_batch=rows * c.packing.row_len, action_fraction=F.action_fraction,
       head_positions_per_row=head,
       rows_per_device=rows / mesh.devices.size, attention=c.model.attention,
       compute_dtype=c.model.compute_dtype, param_dtype=c.model.param_dtype,
       remat=c.model.remat, compile_s=round(time.perf_counter() - t0, 1),
       per_device_argument_gib=gib(m.argument_size_in_bytes),
       per_device_output_gib=gib(m.output_size_in_bytes),
       per_device_temp_gib=gib(m.temp_size_in_bytes),
       per_device_alias_gib=gib(m.alias_size_in_bytes),
       per_device_total_gib=gib(m.argument_size_in_bytes + m.output_size_in_bytes
                                + m.temp_size_in_bytes - m.alias_size_in_bytes))


if __name__ == "__main__":
  app.run(main)
