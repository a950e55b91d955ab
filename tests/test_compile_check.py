"""launch.compile_check: a recipe's update AOT-compiled for a TPU topology (libtpu, no TPU) and
for GPU nodes (the CUDA plugin, no GPU or driver) from this CPU machine, and the registry
shapes the paper's recipes compile from."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from launch import compile_check as cc

REPO = Path(__file__).resolve().parents[1]
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (optional: make tpu-tools)")


def gpu_python() -> str | None:
  """An interpreter with the CUDA plugin: this one, or .venv-gpu's (`make gpu-tools`)."""
  if cc.cuda_plugin_installed():
    return sys.executable
  p = REPO / ".venv-gpu" / "bin" / "python"
  return str(p) if p.exists() else None


needs_cuda_plugin = pytest.mark.skipif(
    gpu_python() is None, reason="the CUDA plugin is not installed (optional: make gpu-tools)")


@pytest.mark.parametrize("name,cls", [("qwen2.5-math-1.5b", "Qwen2ForCausalLM"),
                                      ("r1-distill-qwen-1.5b", "Qwen2ForCausalLM"),
                                      ("qwen2.5-7b-instruct", "Qwen2ForCausalLM"),
                                      ("qwen3-30b-a3b", "Qwen3MoeForCausalLM")])
def test_recipe_shapes_count_the_parameters_transformers_counts(name, cls):
  """The shapes a compile check uses have the parameter count transformers builds from the
  same config.json fields (on the meta device: no memory)."""
  import torch
  import transformers

  from fr_jax.models import registry
  hf = dict(registry.SHAPES[name])
  config = getattr(transformers, cls.replace("ForCausalLM", "Config"))(**hf)
  with torch.device("meta"):
    model = getattr(transformers, cls)(config)
  want = sum(p.numel() for p in model.parameters())
  assert registry.shape_config(name).num_params == want


def test_paper_recipes_name_their_shapes():
  from fr_jax.models import registry
  for recipe in ("qwen25_math_1p5b", "r1_distill_1p5b_longcot", "qwen25_7b_tool",
                 "qwen3_30b_a3b_tool"):
    c = importlib.import_module(f"experiments.configs.{recipe}").get_config()
    assert c.model.shapes in registry.SHAPES, recipe


def test_fit_mesh_keeps_the_recipe_mesh_where_it_can():
  assert cc.fit_mesh(2, 4, 8) == (2, 4)  # the recipe's own
  assert cc.fit_mesh(2, 4, 4) == (1, 4)
  assert cc.fit_mesh(2, 4, 16) == (4, 4)
  assert cc.fit_mesh(1, 8, 4) == (1, 4)  # fsdp 8 does not divide 4 devices


_SCRIPT = """
import json
from experiments.configs import tiny_test
from launch import compile_check as cc
c = tiny_test.get_config()
c.model.attention = "naive"
print(json.dumps(cc.check(c, "v5p-8", rows_per_device=2)))
print(json.dumps(cc.check(c, "v5e-8", rows_per_device=4096)))
"""


@needs_libtpu
def test_tiny_update_compiles_for_tpu_and_an_oversized_one_does_not_fit():
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  r = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, env=env, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  fits, oom = [json.loads(line) for line in r.stdout.strip().splitlines()[-2:]]

  import jax

  from fr_jax.models import registry
  from fr_jax.models.decoder import init_params
  n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(jax.eval_shape(
      lambda: init_params(registry.TINY_CONFIGS["tiny-chat"], jax.random.key(0)))))
  # v5p-8: 4 chips (megacore), the tiny recipe's 1x1 mesh becomes data=4; 2 rows each.
  assert (fits["devices"], fits["mesh"], fits["device_kind"]) == (4, [4, 1], "TPU v5")
  assert fits["fits"] and fits["tokens_per_micro_batch"] == 4 * 2 * 512
  # Arguments per device: replicated f32 parameters and both Adam moments, plus this
  # device's 2 packed rows (six [R, L] fields, at most 4 bytes a token) and the replicated
  # per-segment fields. TPU memory lays arrays out in (8, 128) tiles, which pads this tiny
  # model's small tensors: allow up to half as much again.
  state = 3 * 4 * n_params
  batch = 2 * 512 * 6 * 4 + 4 * 256 * 4
  assert state + batch <= fits["memory_bytes"]["argument"] <= 1.5 * (state + batch)
  assert fits["temp_gib"] > 0 and fits["peak_gib"] < fits["hbm_gib_per_device"]
  # v5e-8: 16 GiB chips; 4,096 rows of 512 tokens per device is far over.
  assert oom["fits"] is False and oom["devices"] == 8
  assert "RESOURCE_EXHAUSTED" in oom["error"]
  assert oom["peak_gib"] > oom["limit_gib"] and 15 < oom["limit_gib"] <= 16


_GPU_SCRIPT = """
import json
from experiments.configs import tiny_test
from launch import compile_check as cc
c = tiny_test.get_config()
print(json.dumps(cc.check(c, "h100-8", rows_per_device=2)))
print(json.dumps(cc.check(c, "a100-80g-2x8", rows_per_device=4096)))
"""


def tiny_state_and_batch_bytes(rows: int) -> tuple[int, int]:
  """tiny-chat's f32 parameters and both Adam moments, and `rows` packed rows of 512 tokens
  (six [R, L] fields of 4 bytes a token at most) plus the replicated per-segment fields."""
  import jax

  from fr_jax.models import registry
  from fr_jax.models.decoder import init_params
  n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(jax.eval_shape(
      lambda: init_params(registry.TINY_CONFIGS["tiny-chat"], jax.random.key(0)))))
  return 3 * 4 * n_params, rows * 512 * 6 * 4 + 4 * 256 * 4


@needs_cuda_plugin
def test_tiny_update_compiles_for_gpu_nodes_and_an_oversized_one_does_not_fit():
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(REPO))
  env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
  r = subprocess.run([gpu_python(), "-c", _GPU_SCRIPT], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  fits, oom = [json.loads(line) for line in r.stdout.strip().splitlines()[-2:]]
  # One H100 node: 8 devices of the kind's reported memory; the tiny recipe's 1x1 mesh
  # becomes data=8, 2 rows each; the attention is the Pallas GPU kernel.
  assert (fits["devices"], fits["hosts"], fits["mesh"]) == (8, 1, [8, 1])
  assert (fits["device_kind"], fits["attention"]) == ("NVIDIA H100 80GB HBM3", "pallas_gpu")
  assert fits["hbm_gib_per_device"] == round(84942979072 / 2**30, 3)
  # The limit is what JAX's GPU client takes by default: 75% of the device's memory.
  assert fits["limit_gib"] == round(0.75 * 84942979072 / 2**30, 3)
  assert fits["fits"] and fits["tokens_per_micro_batch"] == 8 * 2 * 512
  # Arguments per device: the replicated state and this device's rows, exactly (GPU memory
  # does not pad small arrays into tiles as TPU memory does), give or take alignment.
  state, batch = tiny_state_and_batch_bytes(2)
  rows_exactly = 2 * 512 * (5 * 4 + 1)  # four int32 and one f32 [R, L] field, one bool
  assert state + rows_exactly <= fits["memory_bytes"]["argument"] <= 1.05 * (state + batch)
  assert 0 < fits["temp_gib"] and fits["peak_gib"] < fits["limit_gib"]
  # The roofline: the model's FLOPs for this device's 2 x 512 tokens (tiny_test: no remat)
  # at the H100's 989 TFLOP/s, and the bytes XLA's analysis of the program counts at its
  # 3.35 TB/s; for a model this small, memory-bound.
  from fr_jax.models import registry
  flops = 3 * registry.TINY_CONFIGS["tiny-chat"].flops_per_token(512) * 2 * 512
  assert fits["hardware_flops_per_device"] == pytest.approx(flops)
  assert fits["xla_bytes_per_device"] > state  # it reads and writes parameters and moments
  compute, memory = flops / 989e12, fits["xla_bytes_per_device"] / 3352320000000
  assert fits["roofline_micro_batch_s"] == round(max(compute, memory), 4)
  assert fits["roofline_bound"] == "memory"
  # Two A100 nodes: 16 devices over 2 hosts; 4,096 rows of 512 tokens per device is far over
  # the 0.75 x 79.3 GiB a device gives.
  assert (oom["devices"], oom["hosts"], oom["device_kind"]) == (16, 2, "NVIDIA A100-SXM4-80GB")
  assert oom["fits"] is False and oom["peak_gib"] > oom["limit_gib"] > 59


_MOE_GPU_SCRIPT = """
import json
from experiments.configs import tiny_test
from fr_jax.learner.compile import compile_update_from_shapes
from fr_jax.models import registry
from launch import compile_check as cc
devices = cc.target("h100-1").devices
for impl in ("auto", "ragged"):
  for experts in (8, 64):
    c = tiny_test.get_config()
    c.model.moe_impl = impl
    model = registry.TINY_CONFIGS["tiny-qwen3-moe"].replace(num_experts=experts)
    exe, _, _ = compile_update_from_shapes(c, model, rows=8, devices=devices)
    m = exe.memory_analysis()
    print(json.dumps(dict(impl=impl, experts=experts, temp=m.temp_size_in_bytes,
                          argument=m.argument_size_in_bytes,
                          triton=exe.as_text().count("__gpu$xla.gpu.triton"))))
"""


@needs_cuda_plugin
def test_moe_update_for_gpu_runs_grouped_kernels_whose_memory_does_not_grow_with_experts():
  """The tiny MoE update compiled deviceless for one H100, 8 rows of 512 tokens (8,192
  tokens, top-2) with 8 and with 64 experts. moe_impl auto lowers the experts to Triton
  kernels (fr_jax.models.gmm) and its temporaries grow by about what the larger expert stacks
  add to the arguments, not with the tokens x experts fold that XLA:GPU's ragged_dot expands
  into (shown by ragged, the same program with jax.lax.ragged_dot)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(REPO))
  r = subprocess.run([gpu_python(), "-c", _MOE_GPU_SCRIPT], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  got = {(d["impl"], d["experts"]): d for d in map(json.loads, r.stdout.strip().splitlines())}
  grow = {impl: (got[impl, 64]["temp"] - got[impl, 8]["temp"],
                 got[impl, 64]["argument"] - got[impl, 8]["argument"]) for impl in
          ("auto", "ragged")}
  assert got["auto", 8]["triton"] > 0 and got["auto", 64]["triton"] > 0
  assert got["ragged", 8]["triton"] == got["ragged", 64]["triton"] == 0
  temp, args = grow["auto"]
  assert args > 0 and temp <= 2 * args, grow  # measured: +19.3 MB temp for +16.7 MB args
  temp, args = grow["ragged"]
  assert temp > 10 * args, grow  # measured: +547 MB


def test_cli_refuses_an_unknown_topology_in_one_line():
  r = subprocess.run([sys.executable, "-m", "launch.compile_check",
                      "--config=experiments/configs/tiny_test.py", "--topology=v9z-8"],
                     cwd=REPO, capture_output=True, text=True, timeout=120)
  assert r.returncode == 2
  assert r.stderr.strip().splitlines() == [
      f"error: --topology=v9z-8: choose one of {', '.join(cc.TOPOLOGIES)}, or KIND-GPUS or "
      f"KIND-NODESxGPUS with KIND one of {', '.join(cc.GPU_KINDS)}"]
