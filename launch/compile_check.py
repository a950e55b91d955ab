r"""Does a recipe fit a TPU topology? Compiles its real update step ahead of time, here.

  python -m launch.compile_check --config=experiments/configs/r1_distill_1p5b_longcot.py \
      --topology=v5p-8
  python -m launch.compile_check --config=... --topology=v6e-8 --rows_per_device=2 \
      --config.mesh.fsdp=8
  python -m launch.compile_check --list        # the topologies it knows

Needs libtpu (`make tpu-tools`, or `pip install -r requirements-tpu.txt`), not a TPU: libtpu
describes the topology's chips (`jax.experimental.topologies`) and compiles the learner's
update for them from abstract arrays only: no weight is materialised, so a 7B recipe compiles
on a laptop. The model's shapes come from `model.shapes` (a registry SHAPES entry) or the
checkpoint's config.json.

The mesh: the recipe's (data, fsdp) when the topology has data*fsdp devices; otherwise fsdp
is kept if it divides the device count (else it becomes the device count) and data takes the
rest. The micro-batch is `--rows_per_device` packed rows of `packing.row_len` tokens per
device (default: the recipe's largest row bucket spread over its own mesh, the largest
micro-batch the learner can be handed).

Prints one JSON line: per-device memory (arguments, outputs, temporaries, generated code,
peak = arguments + outputs + temporaries - aliased), the chip's HBM, whether it fits, and the
analytic FLOPs per micro-batch with the tokens/s those give at `--mfu`, and the FLOPs and
seconds of the longest update the recipe can make (B trajectories of agent.max_total_tokens).
A program over the chip's memory fails to compile with RESOURCE_EXHAUSTED, as it would on the
chips; that is reported as `fits: false` with the sizes XLA named. Exit status 0 either way (1
on any other compile error).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time

from absl import flags

from launch import common


@dataclasses.dataclass(frozen=True)
class Topology:
  """A TPU slice as libtpu names it, and the figures of its chip (public spec sheets)."""

  topology: str  # libtpu's topology name
  chip_config: str  # megacore: one JAX device per chip (both TensorCores)
  host_bounds: tuple  # chips per host
  hbm_gib: float  # per chip
  peak_bf16_tflops: float  # per chip, dense


TOPOLOGIES = {
    "v4-8": Topology("v4:2x2x1", "megacore", (2, 2, 1), 32, 275),
    "v4-16": Topology("v4:2x2x2", "megacore", (2, 2, 1), 32, 275),
    "v5p-8": Topology("v5p:2x2x1", "megacore", (2, 2, 1), 95, 459),
    "v5p-16": Topology("v5p:2x2x2", "megacore", (2, 2, 1), 95, 459),
    "v5p-32": Topology("v5p:2x2x4", "megacore", (2, 2, 1), 95, 459),
    "v5p-64": Topology("v5p:2x4x4", "megacore", (2, 2, 1), 95, 459),
    "v5e-8": Topology("v5e:2x4", "default", (2, 4, 1), 16, 197),
    "v5e-16": Topology("v5e:4x4", "default", (2, 2, 1), 16, 197),
    "v5e-32": Topology("v5e:4x8", "default", (2, 2, 1), 16, 197),
    "v6e-8": Topology("v6e:2x4", "default", (2, 4, 1), 32, 918),
    "v6e-16": Topology("v6e:4x4", "default", (2, 2, 1), 32, 918),
    "v6e-32": Topology("v6e:4x8", "default", (2, 2, 1), 32, 918),
}

flags.DEFINE_string("topology", "v5p-8", "a TPU slice: " + ", ".join(TOPOLOGIES))
flags.DEFINE_integer("rows_per_device", 0, "packed rows per device in the compiled "
                     "micro-batch (0: the recipe's largest bucket over its own mesh)")
flags.DEFINE_float("mfu", 0.4, "assumed model-FLOPs utilisation for the tokens/s figure")
flags.DEFINE_bool("list", False, "print the known topologies and exit")
FLAGS = flags.FLAGS


class LibtpuMissing(RuntimeError):
  pass


def tpu_devices(name: str):
  """The compile-only devices of TPU slice `name` (libtpu, no TPU needed)."""
  if name not in TOPOLOGIES:
    raise KeyError(f"unknown topology {name!r}: choose one of {', '.join(TOPOLOGIES)}")
  t = TOPOLOGIES[name]
  # libtpu warns without these, and refuses a second process loading it at the same time.
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", name)
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    import libtpu  # noqa: F401
  except ImportError as e:
    raise LibtpuMissing("libtpu is not installed: `make tpu-tools` or "
                        "`pip install -r requirements-tpu.txt`") from e
  from jax.experimental import topologies
  desc = topologies.get_topology_desc(
      platform="tpu", topology_name=t.topology, chip_config_name=t.chip_config,
      chips_per_host_bounds=t.host_bounds, num_slices=1, wrap=(False, False, False))
  return desc.devices


def fit_mesh(data: int, fsdp: int, n: int) -> tuple[int, int]:
  """The recipe's mesh on n devices (see the module docstring)."""
  if data * fsdp == n:
    return data, fsdp
  if n % fsdp:
    fsdp = n
  return n // fsdp, fsdp


def model_shapes(c):
  """The recipe's ModelConfig: `model.shapes` if set, else `model.name`'s (metadata only)."""
  from fr_jax.models import registry
  if c.model.shapes:
    return registry.shape_config(c.model.shapes)
  try:
    return registry.describe(c.model.name).config
  except registry.ModelNotFound as e:
    raise registry.ModelNotFound(
        f"model {c.model.name!r}: {e}; set --config.model.shapes to one of "
        f"{sorted(registry.SHAPES)} or point model.name at an HF checkpoint directory") from None


# How XLA:TPU names the sizes: "... (87.25G) exceeds available HBM (15.75G)", or "Used 20.1G of
# 15.75G hbm".
_OOM = (re.compile(r"\(([\d.]+)([KMGT])\)\s+exceeds available HBM\s+\(([\d.]+)([KMGT])\)"),
        re.compile(r"[Uu]sed\s+([\d.]+)([KMGT])\s+of\s+([\d.]+)([KMGT])"))


def check(c, topology: str, rows_per_device: int = 0, mfu: float = 0.4) -> dict:
  """Compiles config `c`'s update for `topology`; returns the figures (see module doc)."""
  from fr_jax.learner.compile import compile_update_from_shapes
  devices = tpu_devices(topology)
  t = TOPOLOGIES[topology]
  n = len(devices)
  model = model_shapes(c)
  recipe_mesh = (c.mesh.data, c.mesh.fsdp)
  if not rows_per_device:
    rows_per_device = max(1, -(-max(c.packing.row_buckets) // (c.mesh.data * c.mesh.fsdp)))
  c = c.copy_and_resolve_references()
  c.mesh.data, c.mesh.fsdp = fit_mesh(c.mesh.data, c.mesh.fsdp, n)
  if c.model.attention == "auto":
    c.model.attention = "splash_tpu"  # what auto takes on a TPU
  rows = rows_per_device * n
  c.packing.row_buckets = (rows,)
  L = c.packing.row_len
  tokens = rows * L
  flops = model.train_flops(rows, L)  # forward + backward, no recomputation
  # The longest batch the recipe can make: B trajectories of agent.max_total_tokens each.
  step_tokens = c.batch_size * c.minibatches * c.agent.max_total_tokens if "agent" in c else 0
  step_flops = step_tokens * flops / tokens
  peak_flops = t.peak_bf16_tflops * 1e12 * n
  out = dict(topology=topology, devices=n, hosts=1 + max(d.process_index for d in devices),
             device_kind=devices[0].device_kind, model=c.model.shapes or c.model.name,
             params_b=round(model.num_params / 1e9, 3), recipe_mesh=list(recipe_mesh),
             mesh=[c.mesh.data, c.mesh.fsdp], rows_per_device=rows_per_device, row_len=L,
             tokens_per_micro_batch=tokens, attention=c.model.attention,
             remat=bool(c.model.remat), compute_dtype=c.model.compute_dtype,
             param_dtype=c.model.param_dtype, hbm_gib_per_device=t.hbm_gib,
             flops_per_micro_batch=flops, max_tokens_per_step=step_tokens,
             flops_per_max_step=step_flops,
             tokens_per_s_at_mfu=round(mfu * peak_flops * tokens / flops),
             max_step_s_at_mfu=round(step_flops / (mfu * peak_flops), 2),
             assumed_mfu=mfu, peak_bf16_tflops_per_device=t.peak_bf16_tflops)
  gib = lambda b: round(b / 2**30, 3)  # noqa: E731
  t0 = time.perf_counter()
  try:
    exe, _ = compile_update_from_shapes(c, model, rows, devices=devices)
  except Exception as e:  # XLA raises a bare runtime error
    msg = str(e)
    if "RESOURCE_EXHAUSTED" not in msg:
      raise
    m = next(filter(None, (r.search(msg) for r in _OOM)), None)
    unit = {"T": 2**10, "G": 1, "M": 2**-10, "K": 2**-20}
    out.update(fits=False, compile_s=round(time.perf_counter() - t0, 1),
               error=msg.strip().splitlines()[0][:300])
    if m:
      out.update(peak_gib=round(float(m.group(1)) * unit[m.group(2)], 3),
                 limit_gib=round(float(m.group(3)) * unit[m.group(4)], 3))
    return out
  m = exe.memory_analysis()
  peak = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)
  sizes = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes,
               alias=m.alias_size_in_bytes, temp=m.temp_size_in_bytes,
               generated_code=m.generated_code_size_in_bytes,
               peak=peak + m.generated_code_size_in_bytes)
  out.update(fits=sizes["peak"] <= t.hbm_gib * 2**30,
             compile_s=round(time.perf_counter() - t0, 1),
             **{f"{k}_gib": gib(v) for k, v in sizes.items()}, memory_bytes=sizes)
  return out


def main(argv):
  if len(argv) > 1:
    common.fail(f"unexpected arguments {argv[1:]}")
  if FLAGS.list:
    for name, t in TOPOLOGIES.items():
      print(f"{name:8s} {t.topology:10s} {t.hbm_gib:5g} GiB HBM/chip  "
            f"{t.peak_bf16_tflops:5g} bf16 TFLOP/s/chip")
    return
  if FLAGS.topology not in TOPOLOGIES:
    common.fail(f"--topology={FLAGS.topology}: choose one of {', '.join(TOPOLOGIES)}")
  if not 0 < FLAGS.mfu <= 1:
    common.fail(f"--mfu={FLAGS.mfu}: must be in (0, 1]")
  if FLAGS.rows_per_device < 0:
    common.fail(f"--rows_per_device={FLAGS.rows_per_device}: must be >= 0")
  c = common.load_config()
  from fr_jax.models import registry
  try:
    model_shapes(c)
  except registry.ModelNotFound as e:
    common.fail(str(e))
  try:
    out = check(c, FLAGS.topology, FLAGS.rows_per_device, FLAGS.mfu)
  except LibtpuMissing as e:
    common.fail(str(e))
  print(f"{out['topology']}: {out['model']} mesh data={out['mesh'][0]} x "
        f"fsdp={out['mesh'][1]}, {out['rows_per_device']} x {out['row_len']} tokens per "
        f"device: {'fits' if out['fits'] else 'DOES NOT FIT'} "
        f"({out.get('peak_gib', '?')} of {out.get('limit_gib', out['hbm_gib_per_device'])} GiB "
        "per device)",
        file=sys.stderr, flush=True)
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  common.run(main)
