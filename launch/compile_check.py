r"""Does a recipe fit a TPU slice or a set of GPU nodes? Compiles its real update step ahead of
time, here.

  python -m launch.compile_check --config=experiments/configs/r1_distill_1p5b_longcot.py \
      --topology=v5p-8
  python -m launch.compile_check --config=... --topology=v6e-8 --rows_per_device=2 \
      --config.mesh.fsdp=8
  .venv-gpu/bin/python -m launch.compile_check --config=... --topology=h100-2x8
  python -m launch.compile_check --list        # the topologies it knows

TPU slices need libtpu (`make tpu-tools`, or `pip install -r requirements-tpu.txt`), GPU nodes
the CUDA plugin (`make gpu-tools`: .venv-gpu), not the chips: the plugin describes the
devices (`jax.experimental.topologies`; for GPUs from a target config built from the kind's
figures in `GPU_KINDS`) and XLA compiles the learner's update for them from abstract arrays
only: no weight is materialised, so a 7B recipe compiles on a laptop. The model's shapes come
from `model.shapes` (a registry SHAPES entry) or the checkpoint's config.json. A GPU topology
is `KIND-GPUS` (one node) or `KIND-NODESxGPUS`, KIND one of `GPU_KINDS`: h100-8, a100-80g-2x8.

The mesh: the recipe's (data, fsdp) when the topology has data*fsdp*expert devices; otherwise
fsdp is kept if it divides the devices left after `mesh.expert` (else it becomes that count)
and data takes the rest. `--config.mesh.expert=8` (MoE models) adds expert parallelism.
The micro-batch is `--rows_per_device` packed rows of `packing.row_len` tokens per device
(default: the recipe's largest row bucket spread over its own mesh, the largest micro-batch
the learner can be handed), whose LM head scores the head bucket that holds rows
with `--action_fraction` of their positions actions (1: every position; `fr_jax.packing`).

Prints one JSON line: per-device memory (arguments, outputs, temporaries, generated code,
peak = arguments + outputs + temporaries - aliased), the device's memory, whether it fits,
and the analytic FLOPs per micro-batch with the tokens/s those give at `--mfu`, and the FLOPs
and seconds of the longest update the recipe can make (B trajectories of
agent.max_total_tokens). A program over a TPU chip's memory fails to compile with
RESOURCE_EXHAUSTED, as it would on the chips; that is reported as `fits: false` with the sizes
XLA named. On a GPU the limit is the memory JAX's client takes at run time: the device's
memory times XLA_PYTHON_CLIENT_MEM_FRACTION (JAX's default 0.75 when unset, read here as a run
reads it). Exit status 0 either way (1 on any other compile error).
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
    "v5e-64": Topology("v5e:8x8", "default", (2, 2, 1), 16, 197),
    "v6e-8": Topology("v6e:2x4", "default", (2, 4, 1), 32, 918),
    "v6e-16": Topology("v6e:4x4", "default", (2, 2, 1), 32, 918),
    "v6e-32": Topology("v6e:4x8", "default", (2, 2, 1), 32, 918),
}


@dataclasses.dataclass(frozen=True)
class GpuKind:
  """One GPU model: what XLA:GPU's target config needs to compile for it, and its bf16 peak.

  Sources: SM count, shared memory, L2, clock, bandwidth and memory size are what the devices
  report (cudaGetDeviceProperties), as recorded in XLA's GPU specs (openxla/xla,
  xla/backends/gpu/target_config/specs/{a100_sxm_80,h100_sxm,h200,b200}.txtpb); the dense
  bf16 tensor-core peaks are NVIDIA's datasheets (A100 80GB SXM 312 TFLOP/s, H100 SXM and
  H200 SXM 989, HGX B200 2,250 per GPU).
  """

  device: str  # the name the driver reports (device_kind)
  compute_capability: tuple[int, int]
  sm_count: int
  fpus_per_sm: int
  smem_per_sm: int  # bytes
  smem_per_block_optin: int  # bytes
  l2_bytes: int
  memory_bandwidth: int  # bytes/s
  clock_ghz: float
  memory_bytes: int
  peak_bf16_tflops: float

  def target_config(self) -> str:
    """An XLA GpuTargetConfigProto (text format) for this kind."""
    major, minor = self.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: {self.smem_per_sm} threads_per_core_limit: 2048
  core_count: {self.sm_count} fpus_per_core: {self.fpus_per_sm}
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth} l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz} device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: {self.smem_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{self.device}"
"""


GPU_KINDS = {
    "a100-80g": GpuKind("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 167936, 166912, 41943040,
                        2039040000000, 1.41, 85100068864, 312),
    "h100": GpuKind("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 233472, 232448, 52428800,
                    3352320000000, 1.98, 84942979072, 989),
    "h200": GpuKind("NVIDIA H200 141GB HBM3e", (9, 0), 132, 128, 233472, 232448, 52428800,
                    4800000000000, 1.98, 151397597184, 989),
    "b200": GpuKind("NVIDIA B200", (10, 0), 148, 128, 233472, 232448, 132644864,
                    7672320000000, 1.965, 191514411008, 2250),
}
_GPU_TOPOLOGY = re.compile(r"^(" + "|".join(GPU_KINDS) + r")-(?:(\d+)x)?(\d+)$")


@dataclasses.dataclass(frozen=True)
class Target:
  """What a check compiles for: the devices, and the figures its verdict reads."""

  devices: list
  platform: str  # tpu or gpu
  memory_gib: float  # per device, what the device has
  limit_gib: float  # per device, what a program may use
  peak_bf16_tflops: float  # per device, dense
  memory_bandwidth: float = 0.0  # per device, bytes/s (0: not known here)


class PluginMissing(RuntimeError):
  pass


def known(name: str) -> bool:
  return name in TOPOLOGIES or bool(_GPU_TOPOLOGY.match(name))


def target(name: str) -> Target:
  """The compile-only devices of topology `name` (no accelerator needed)."""
  m = _GPU_TOPOLOGY.match(name)
  if m:
    return _gpu_target(GPU_KINDS[m.group(1)], int(m.group(2) or 1), int(m.group(3)))
  if name not in TOPOLOGIES:
    raise KeyError(f"unknown topology {name!r}: choose one of {', '.join(TOPOLOGIES)} or "
                   f"KIND-GPUS / KIND-NODESxGPUS with KIND one of {', '.join(GPU_KINDS)}")
  t = TOPOLOGIES[name]
  # libtpu warns without these, and refuses a second process loading it at the same time.
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", name)
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    import libtpu  # noqa: F401
  except ImportError as e:
    raise PluginMissing("libtpu is not installed: `make tpu-tools` or "
                        "`pip install -r requirements-tpu.txt`") from e
  from jax.experimental import topologies
  desc = topologies.get_topology_desc(
      platform="tpu", topology_name=t.topology, chip_config_name=t.chip_config,
      chips_per_host_bounds=t.host_bounds, num_slices=1, wrap=(False, False, False))
  return Target(desc.devices, "tpu", t.hbm_gib, t.hbm_gib, t.peak_bf16_tflops)


def cuda_plugin_installed() -> bool:
  import importlib.util
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:  # no jax_plugins package at all
    return False


def _gpu_target(kind: GpuKind, nodes: int, gpus: int) -> Target:
  if not cuda_plugin_installed():
    raise PluginMissing("the CUDA plugin is not installed: `make gpu-tools`, then run with "
                        ".venv-gpu/bin/python (requirements-gpu.txt)")
  # The plugin's version check calls cuInit, which needs a driver; nothing here runs on one.
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  from jax.experimental import topologies
  desc = topologies.get_topology_desc(platform="cuda", target_config=kind.target_config(),
                                      topology=f"{nodes}x1x{gpus}")
  memory = kind.memory_bytes / 2**30
  fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
  return Target(desc.devices, "gpu", memory, memory * fraction, kind.peak_bf16_tflops,
                kind.memory_bandwidth)


flags.DEFINE_string("topology", "v5p-8", "a TPU slice (" + ", ".join(TOPOLOGIES) + ") or GPU "
                    "nodes, KIND-GPUS or KIND-NODESxGPUS (KIND: " + ", ".join(GPU_KINDS) + ")")
flags.DEFINE_integer("rows_per_device", 0, "packed rows per device in the compiled "
                     "micro-batch (0: the recipe's largest bucket over its own mesh)")
flags.DEFINE_float("action_fraction", 1.0, "the fraction of each row's positions that are "
                   "actions: the LM head scores the head bucket that holds them (1: all)")
flags.DEFINE_float("mfu", 0.4, "assumed model-FLOPs utilisation for the tokens/s figure")
flags.DEFINE_bool("list", False, "print the known topologies and exit")
FLAGS = flags.FLAGS


class MeshError(ValueError):
  """The recipe's mesh cannot be laid on the topology."""


def fit_mesh(data: int, fsdp: int, n: int, expert: int = 1) -> tuple[int, int]:
  """The recipe's (data, fsdp) on n devices, `expert` of them per expert group (see the
  module docstring)."""
  if n % expert:
    raise MeshError(f"mesh.expert={expert} does not divide the topology's {n} devices")
  n //= expert
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


def peak_bytes(m) -> int:
  """A compiled program's peak per device from its `memory_analysis()`: arguments + outputs +
  temporaries - aliased (the donated state) + generated code."""
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes + m.generated_code_size_in_bytes)


def roofline(exe, t, model, c, rows_per_device: int) -> dict:
  """A roofline estimate of one micro-batch's time per device: max(FLOPs / peak bf16 FLOP/s,
  bytes / memory bandwidth). A lower bound: peak rates, perfect overlap, no communication.

  Bytes: XLA's cost analysis ("bytes accessed") of the per-device program it compiled for
  the target, run with this machine's CPU client (a deviceless GPU executable reports no cost
  analysis of its own). FLOPs: the model's (`ModelConfig.train_flops`), plus remat's
  recomputed forward, per device; XLA's own count is reported too but not used, since the
  CPU client's analysis does not see what runs in custom calls (cuBLAS GEMMs, the Pallas
  attention and expert kernels): for tiny-chat on an H100 it counted 374M of the matmuls'
  579M FLOPs."""
  if not t.memory_bandwidth:
    return {}
  from jax._src import xla_bridge
  from jax._src.lib import xla_client
  xla_flops = nbytes = 0.0
  for module in exe.runtime_executable().hlo_modules():
    cost = xla_client._xla.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)
    xla_flops += float(cost.get("flops", 0.0))
    nbytes += float(cost.get("bytes accessed", 0.0))
  flops = model.train_flops(rows_per_device, c.packing.row_len) * (4 / 3 if c.model.remat
                                                                   else 1.0)
  compute_s = flops / (t.peak_bf16_tflops * 1e12)
  memory_s = nbytes / t.memory_bandwidth
  return dict(hardware_flops_per_device=flops, xla_flops_per_device=xla_flops,
              xla_bytes_per_device=nbytes, roofline_compute_s=round(compute_s, 4),
              roofline_memory_s=round(memory_s, 4),
              roofline_micro_batch_s=round(max(compute_s, memory_s), 4),
              roofline_bound="compute" if compute_s >= memory_s else "memory")


def check(c, topology: str, rows_per_device: int = 0, mfu: float = 0.4,
          action_fraction: float = 1.0) -> dict:
  """Compiles config `c`'s update for `topology`; returns the figures (see module doc)."""
  from fr_jax.learner.compile import compile_update_from_shapes, head_width
  from fr_jax.learner.config import mesh_size
  from fr_jax.models import attention
  t = target(topology)
  devices = t.devices
  n = len(devices)
  model = model_shapes(c)
  recipe_mesh = (c.mesh.data, c.mesh.fsdp)
  if not rows_per_device:
    rows_per_device = max(1, -(-max(c.packing.row_buckets) // mesh_size(c)))
  c = c.copy_and_resolve_references()
  c.mesh.data, c.mesh.fsdp = fit_mesh(c.mesh.data, c.mesh.fsdp, n, c.mesh.expert)
  # what the model's "auto" takes on the target's platform (not this CPU's)
  c.model.attention = attention.resolve(c.model.attention, c.packing.row_len,
                                        backend=t.platform)
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
             mesh=[c.mesh.data, c.mesh.fsdp], expert=c.mesh.expert,
             rows_per_device=rows_per_device, row_len=L,
             tokens_per_micro_batch=tokens, attention=c.model.attention,
             remat=bool(c.model.remat), compute_dtype=c.model.compute_dtype,
             param_dtype=c.model.param_dtype, hbm_gib_per_device=round(t.memory_gib, 3),
             limit_gib=round(t.limit_gib, 3), action_fraction=action_fraction,
             head_positions_per_row=head_width(c, action_fraction),
             flops_per_micro_batch=flops, max_tokens_per_step=step_tokens,
             flops_per_max_step=step_flops,
             tokens_per_s_at_mfu=round(mfu * peak_flops * tokens / flops),
             max_step_s_at_mfu=round(step_flops / (mfu * peak_flops), 2),
             assumed_mfu=mfu, peak_bf16_tflops_per_device=t.peak_bf16_tflops)
  gib = lambda b: round(b / 2**30, 3)  # noqa: E731
  t0 = time.perf_counter()
  try:
    exe, _, _ = compile_update_from_shapes(c, model, rows, devices=devices,
                                           action_fraction=action_fraction)
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
  sizes = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes,
               alias=m.alias_size_in_bytes, temp=m.temp_size_in_bytes,
               generated_code=m.generated_code_size_in_bytes, peak=peak_bytes(m))
  out.update(fits=sizes["peak"] <= t.limit_gib * 2**30,
             compile_s=round(time.perf_counter() - t0, 1),
             **{f"{k}_gib": gib(v) for k, v in sizes.items()}, memory_bytes=sizes)
  out.update(roofline(exe, t, model, c, rows_per_device))
  if "roofline_micro_batch_s" in out:  # the longest update: that many micro-batches' worth
    out["roofline_max_step_s"] = round(out["roofline_micro_batch_s"] * step_tokens / tokens, 2)
  return out


def main(argv):
  if len(argv) > 1:
    common.fail(f"unexpected arguments {argv[1:]}")
  if FLAGS.list:
    for name, t in TOPOLOGIES.items():
      print(f"{name:8s} {t.topology:10s} {t.hbm_gib:5g} GiB HBM/chip  "
            f"{t.peak_bf16_tflops:5g} bf16 TFLOP/s/chip")
    for name, k in GPU_KINDS.items():
      print(f"{name}-GPUS, {name}-NODESxGPUS  {k.device}: {k.memory_bytes / 2**30:.1f} GiB, "
            f"{k.peak_bf16_tflops:g} bf16 TFLOP/s/GPU")
    return
  if not known(FLAGS.topology):
    common.fail(f"--topology={FLAGS.topology}: choose one of {', '.join(TOPOLOGIES)}, or "
                f"KIND-GPUS or KIND-NODESxGPUS with KIND one of {', '.join(GPU_KINDS)}")
  if not 0 < FLAGS.action_fraction <= 1:
    common.fail(f"--action_fraction={FLAGS.action_fraction}: must be in (0, 1]")
  if not 0 < FLAGS.mfu <= 1:
    common.fail(f"--mfu={FLAGS.mfu}: must be in (0, 1]")
  if FLAGS.rows_per_device < 0:
    common.fail(f"--rows_per_device={FLAGS.rows_per_device}: must be >= 0")
  c = common.load_config()
  from fr_jax.models import registry
  from fr_jax.models.config import ConfigError
  try:
    model_shapes(c)
  except registry.ModelNotFound as e:
    common.fail(str(e))
  try:
    out = check(c, FLAGS.topology, FLAGS.rows_per_device, FLAGS.mfu, FLAGS.action_fraction)
  except (PluginMissing, MeshError, ConfigError) as e:
    common.fail(str(e))
  print(f"{out['topology']}: {out['model']} mesh data={out['mesh'][0]} x "
        f"fsdp={out['mesh'][1]} x expert={out['expert']}, {out['rows_per_device']} x "
        f"{out['row_len']} tokens per "
        f"device: {'fits' if out['fits'] else 'DOES NOT FIT'} "
        f"({out.get('peak_gib', '?')} of {out['limit_gib']} GiB "
        "per device)",
        file=sys.stderr, flush=True)
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  common.run(main)
