r"""The device check: what one accelerator machine shows about fr_jax, as JSON lines, in about
8 minutes on one GPU.

  make device-check                 # on the GPU machine (BUILD.md: what it needs there)
  make device-check DRY=1           # every section at toy sizes on this CPU (part of make test)
  python -m experiments.device_check --write_peer_fixtures=build/device_fixtures

The device needs only JAX (with its CUDA plugin), flax, optax, orbax-checkpoint and grpcio.
fr_jax's other pure dependencies (requirements-device.txt) come as wheels in --wheels, which
this script unpacks into --site before it imports fr_jax: no pip, no package registry. The
model peers (torch, transformers) are not there either, so their side is computed beforehand
on a machine that has them, into --peer_fixtures.

Sections, each a few JSON lines, then `summary` (exit status 1 if any check failed):
  env:       JAX, the devices, the measured f32 and bf16 matmul peaks.
  peer:      fr_jax on the device against transformers: logits of tiny random Llama, Qwen2
             and Qwen3 checkpoints (q/k/v biases, q/k-norm, GQA) saved with transformers, whose
             own logits were computed on the CPU machine (the fixtures). f32, highest matmul
             precision, at most 1e-4 apart, as tests/test_model_peer.py asks on the CPU.
  attention: each attention path that compiles on this backend (naive, flash, pallas_gpu on a
             GPU, splash_tpu on a TPU; in a dry run the Pallas kernels in interpret mode) against
             naive: outputs and gradients, f32 at highest precision, one packed shape with
             many segments, padding and GQA; then forward+backward time of each path at one
             row of --attn_row_len tokens in bf16.
  learner:   Learner.update with bf16 compute (f32 master weights, per-layer remat): SmolLM2-135M
             shapes on the fixed 8 x 256 case, and R1-Distill-Qwen-1.5B shapes on one row of
             16,384 tokens. Median time, tokens/s, and MFU against the measured bf16 peak (and
             the datasheet peak where the device is known); compiled and peak device memory.
  fit:       the fit check against the device: the update `launch.compile_check` compiles for
             each of --fit_recipes (qwen25_7b_tool and the MoE qwen3_30b_a3b_tool at
             --fit_layers layers, one row of 8,192 tokens, one device; in a dry run tiny_test's
             and tiny_moe's), compiled here and, on a GPU, also deviceless for --fit_kind as
             compile_check compiles it; then run on zero weights: the device's measured peak
             memory against each `memory_analysis()` peak, and the median step time against
             compile_check's roofline estimate (`compile_check.roofline`), as ratios.
  engine:    EmbeddedEngine.generate with SmolLM2-135M shapes (bf16), batch 8 and 32, 128 new
             tokens each: tokens/s.
Weights are random (`random:NAME` in fr_jax.models.registry): speed and memory do not depend
on them, and the device has no registry to fetch the real ones from.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import zipfile
from pathlib import Path

from absl import app, flags

from experiments.benchmarks.common import timed

flags.DEFINE_bool("dry", False, "every section at toy sizes (for the CPU, in make test)")
flags.DEFINE_list("sections", ["env", "fit", "peer", "attention", "learner", "engine"],
                  "which to run (fit runs first after env: the device's peak memory is the "
                  "process's own)")
flags.DEFINE_string("wheels", "build/device_wheels", "wheels to unpack before importing fr_jax "
                    "(skipped when the folder is absent)")
flags.DEFINE_string("site", "build/device_site", "where --wheels are unpacked")
flags.DEFINE_string("peer_fixtures", "build/device_fixtures", "transformers' side of the peer "
                    "check (written by --write_peer_fixtures); in its absence the fixtures are "
                    "written here and now if transformers is importable")
flags.DEFINE_string("write_peer_fixtures", None, "only write the peer fixtures to this folder "
                    "(needs torch and transformers) and exit")
flags.DEFINE_integer("attn_row_len", 16384, "row length of the attention timing")
flags.DEFINE_integer("fit_layers", 4, "layers of the fit section's recipes")
flags.DEFINE_list("fit_recipes", ["qwen25_7b_tool", "qwen3_30b_a3b_tool"],
                  "the fit section's recipes (experiments.configs)")
flags.DEFINE_string("fit_kind", "h200", "the GPU kind (launch.compile_check.GPU_KINDS) the fit "
                    "section also compiles for deviceless")
flags.DEFINE_integer("timed_repeats", 3, "timed repeats after a warm-up (median reported)")
F = flags.FLAGS

PEER_MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
PEER_TOL = 1e-4
ATTN_TOL = 1e-5
# Dense bf16 datasheet peaks (FLOP/s), by a substring of jax's device_kind.
DATASHEET_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12,
                  "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v6": 918e12, "TPU v4": 275e12}


def emit(kind, **kw):
  print(json.dumps({"bench": "device_check", "kind": kind, **kw}), flush=True)


def unpack_wheels(wheels: Path, site: Path) -> list[str]:
  """Unpacks each wheel into `site` (a wheel is a zip of its site-packages layout) and puts
  `site` first on sys.path. Returns the wheels' file names."""
  names = sorted(p.name for p in wheels.glob("*.whl"))
  site.mkdir(parents=True, exist_ok=True)
  for name in names:
    stamp = site / f".{name}.unpacked"
    if not stamp.exists():
      with zipfile.ZipFile(wheels / name) as z:
        z.extractall(site)
      stamp.touch()
  sys.path.insert(0, str(site.resolve()))
  return names


# --- the peer fixtures (written where transformers is) -------------------------------------

def write_peer_fixtures(out: Path):
  """For each tiny config: a random checkpoint saved by transformers, and transformers' own
  f32 logits for fixed tokens (peer.npz)."""
  import numpy as np
  import torch
  import transformers

  from experiments.peer_models import hf_logits, hf_model
  from fr_jax.models import registry
  for i, name in enumerate(PEER_MODELS):
    model = hf_model(registry.TINY_CONFIGS[name], seed=i)
    tokens = np.random.default_rng(i).integers(0, model.config.vocab_size, (2, 24))
    logits = hf_logits(model, tokens)
    model.save_pretrained(out / name)
    np.savez(out / name / "peer.npz", tokens=tokens, logits=logits,
             transformers=transformers.__version__, torch=torch.__version__)
  return [str(out / n) for n in PEER_MODELS]


# --- sections ---------------------------------------------------------------------------------

def section_env(ctx):
  import jax

  from fr_jax.learner.compile import measure_peak_flops
  n = 512 if F.dry else 8192
  ctx["peak"] = {d: measure_peak_flops(d, n=n, repeats=10) for d in ("float32", "bfloat16")}
  dev = jax.devices()[0]
  kind = getattr(dev, "device_kind", str(dev))
  sheet = next((v for k, v in DATASHEET_BF16.items() if k in kind), None)
  ctx["datasheet_bf16"] = sheet
  emit("env", python=sys.version.split()[0], jax=jax.__version__,
       backend=jax.default_backend(), device_kind=kind, devices=len(jax.devices()),
       matmul_n=n, f32_gflops=round(ctx["peak"]["float32"] / 1e9, 1),
       bf16_gflops=round(ctx["peak"]["bfloat16"] / 1e9, 1),
       datasheet_bf16_tflops=sheet and sheet / 1e12, dry=F.dry)
  return True


def section_peer(ctx):
  import jax
  import numpy as np

  from fr_jax.models import decoder, registry
  root = Path(F.peer_fixtures)
  if not all((root / n / "peer.npz").is_file() for n in PEER_MODELS):
    try:
      import transformers  # noqa: F401
    except ImportError:
      emit("peer", skipped=f"no fixtures in {root} and no transformers here: run "
           "`make device-fixtures` on a machine with transformers and bring the folder")
      return None
    root.mkdir(parents=True, exist_ok=True)
    write_peer_fixtures(root)
  ok = True
  for name in PEER_MODELS:
    ref = np.load(root / name / "peer.npz")
    m = registry.load(f"hf:{root / name}")
    tokens = np.asarray(ref["tokens"])
    pos = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    with jax.default_matmul_precision("highest"):
      h, _ = decoder.forward(m.params, m.config, tokens, pos)
      logits = np.asarray(decoder.logits_from_hidden(m.params, m.config, h))
    err = float(np.abs(logits - ref["logits"]).max())
    ok &= err <= PEER_TOL
    emit("peer", model=name, family=m.config.family, device=str(jax.devices()[0]),
         transformers=str(ref["transformers"]), max_abs_err=err, tol=PEER_TOL,
         ok=err <= PEER_TOL)
  return ok


def _segments(L, rng):
  """One row's segment ids: random lengths (some of 1) then padding (0)."""
  import numpy as np
  seg, at, s = np.zeros(L, np.int32), 0, 1
  while at < L * 9 // 10:
    n = int(min(rng.choice([1, rng.integers(2, L // 3)]), L * 9 // 10 - at))
    seg[at:at + n] = s
    at, s = at + n, s + 1
  return seg


def attention_paths(backend):
  paths = ["flash"]
  if backend == "gpu" or F.dry:
    paths.append("pallas_gpu")
  if backend == "tpu" or F.dry:
    paths.append("splash_tpu")
  return paths


def section_attention(ctx):
  import jax
  import jax.numpy as jnp
  import numpy as np

  from fr_jax.models import attention as A
  backend = jax.default_backend()
  B, L, H, KVH, hd = (2, 300, 4, 2, 16) if F.dry else (2, 2000, 12, 2, 128)
  rng = np.random.default_rng(0)
  seg = jnp.asarray(np.stack([_segments(L, rng), np.ones(L, np.int32)]))[:B]
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
  q, k, v, w = f(B, L, H, hd), f(B, L, KVH, hd), f(B, L, KVH, hd), f(B, L, H, hd)
  vis = A.packed_visibility(seg)

  def run(impl):
    def loss(q, k, v):
      out = A.attend(q, k, v, vis, jnp.float32, impl)
      return jnp.sum(out * w), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x) for x in (out, *grads)]

  ok = True
  with jax.default_matmul_precision("highest"):
    ref = run("naive")
    for impl in attention_paths(backend):
      got = run(impl)
      errs = {n: float(np.abs(a - b).max() / max(1.0, float(np.abs(b).max())))
              for n, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
      good = max(errs.values()) <= ATTN_TOL
      ok &= good
      emit("attention_equal", impl=impl, backend=backend,
           interpret=impl != "flash" and {"pallas_gpu": "gpu", "splash_tpu": "tpu"}[impl]
           != backend, shape=dict(B=B, L=L, H=H, KVH=KVH, hd=hd),
           max_err_scaled=errs, tol=ATTN_TOL, ok=good)
  # Speed: one row of attn_row_len tokens, bf16, forward + backward.
  L = 512 if F.dry else F.attn_row_len
  q, k, v = f(1, L, H, hd), f(1, L, KVH, hd), f(1, L, KVH, hd)
  seg = jnp.ones((1, L), jnp.int32)
  vis = A.packed_visibility(seg)
  for impl in ["naive", *attention_paths(backend)]:
    if F.dry and impl != "flash":
      continue  # interpret mode's time means nothing

    def attn_loss(q, k, v, impl=impl):
      return jnp.sum(A.attend(q, k, v, vis, jnp.bfloat16, impl))

    step = jax.jit(jax.grad(attn_loss, argnums=(0, 1, 2)))
    try:
      med, ts = timed(lambda step=step: jax.block_until_ready(step(q, k, v)), F.timed_repeats)
    except Exception as e:  # naive at 16k may not fit: say so, go on
      emit("attention_speed", impl=impl, row_len=L, error=f"{type(e).__name__}: {e}"[:300])
      continue
    # causal attention fwd+bwd: 2 (QK, PV) x 2 flops x L^2/2 x H x hd, x 3.5 with the backward
    flops = 3.5 * 2 * 2 * (L * L / 2) * H * hd
    emit("attention_speed", impl=impl, row_len=L, heads=H, kv_heads=KVH, head_dim=hd,
         compute="bfloat16", median_ms=round(med * 1e3, 2),
         tflops=round(flops / med / 1e12, 2))
  return ok


def _update_case(ctx, label, model_name, trajs, row_len, buckets):
  import jax
  import numpy as np

  from fr_jax.learner import config as lcfg
  from fr_jax.learner.learner import Learner
  from fr_jax.models import registry
  t0 = time.perf_counter()
  model = registry.load(model_name, param_dtype="float32", compute_dtype="bfloat16")
  c = lcfg.default_config()
  c.batch_size = len(trajs)
  c.objective.delta = float("inf")  # work and memory do not depend on the gate
  c.model.compute_dtype = "bfloat16"
  c.packing.row_len = row_len
  c.packing.row_buckets = buckets
  c.log.peak_flops = ctx["peak"]["bfloat16"]
  learner = Learner(c, model=model)
  ms = []
  med, ts = timed(lambda: ms.append(learner.update(trajs, log_ids=False)), F.timed_repeats)
  n_tok = sum(t.length - 1 for t in trajs)
  flops = sum(3 * model.config.flops_per_token(t.length) * (t.length - 1) for t in trajs)
  dev = jax.devices()[0]
  stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
  row = dict(case=label, model=model_name, params_b=round(model.config.num_params / 1e9, 3),
             trajectories=len(trajs), tokens=n_tok, row_len=row_len, median_s=round(med, 4),
             all_s=[round(t, 4) for t in ts], tokens_per_s=round(n_tok / med, 1),
             model_tflops_per_update=round(flops / 1e12, 3),
             mfu_measured_peak=round(flops / med / ctx["peak"]["bfloat16"], 3),
             loss=ms[-1]["loss"], compiles=learner.compile_count,
             wall_s=round(time.perf_counter() - t0, 1))
  if ctx.get("datasheet_bf16"):
    row["mfu_datasheet"] = round(flops / med / ctx["datasheet_bf16"], 3)
  if stats:
    row["peak_device_gib"] = round(stats.get("peak_bytes_in_use", 0) / 2**30, 2)
  emit("learner", **row)
  learner.close()
  # Release the learner and the weights before clearing the caches (not `del`: the timed
  # lambda above closes over `learner`).
  learner = model = None
  jax.clear_caches()
  return bool(np.isfinite(ms[-1]["loss"]))


def section_learner(ctx):
  import numpy as np

  from experiments.benchmarks.learner_cases import make_trajectories
  from fr_jax.models import registry
  from fr_jax.trajectory import Trajectory
  small, large = ("tiny-qwen3", "tiny-qwen2") if F.dry else (
      "random:smollm2-135m", "random:r1-distill-qwen-1.5b")
  rng = np.random.default_rng(0)

  def vocab(name):  # without loading the weights
    return (registry.TINY_CONFIGS.get(name)
            or registry.shape_config(name.removeprefix("random:"))).vocab_size

  fixed = make_trajectories("fixed", vocab(small), rng)
  ok = _update_case(ctx, "fixed_8x256", small, fixed, 256, (8,))
  L = 512 if F.dry else 16384
  P, C = 256, L - 256
  long = [Trajectory(f"long{L}", rng.integers(0, vocab(large), P),
                     rng.integers(0, vocab(large), C),
                     np.ones(C, bool), np.full(C, -1.0, np.float32), 1.0, 0)]
  ok &= _update_case(ctx, f"one_row_{L}", large, long, L, (1,))
  return ok


DRY_RECIPES = {"qwen25_7b_tool": "tiny_test", "qwen3_30b_a3b_tool": "tiny_moe"}


def section_fit(ctx):
  ok = True
  for recipe in F.fit_recipes:
    ok &= _fit_one(DRY_RECIPES.get(recipe, "tiny_test") if F.dry else recipe)
  return ok


def _fit_one(recipe):
  import importlib

  import jax
  import jax.numpy as jnp
  import numpy as np

  from fr_jax import objective as obj
  from fr_jax.learner import compile as compiling
  from fr_jax.learner import mesh as meshlib
  from fr_jax.learner import optim, step
  from fr_jax.models import attention, decoder
  from fr_jax.packing import PackingSpec, pack
  from fr_jax.trajectory import Trajectory
  from launch import compile_check as cc
  c = importlib.import_module(f"experiments.configs.{recipe}").get_config()
  c.mesh.data = c.mesh.fsdp = 1
  c.packing.row_buckets = (1,)
  # what the model's "auto" takes here, as compile_check resolves it for a target
  c.model.attention = attention.resolve(c.model.attention, c.packing.row_len,
                                        backend=jax.default_backend())
  shapes = cc.model_shapes(c)
  if not F.dry:
    shapes = shapes.replace(num_layers=F.fit_layers)
  dev = jax.devices()[0]
  t0 = time.perf_counter()
  exe, mesh, _ = compiling.compile_update_from_shapes(c, shapes, 1, devices=[dev])
  row = dict(recipe=recipe, layers=shapes.num_layers, params_b=round(shapes.num_params / 1e9, 3),
             row_len=c.packing.row_len, attention=c.model.attention,
             moe_impl=c.model.moe_impl if shapes.is_moe else None,
             predicted_peak_gib=round(cc.peak_bytes(exe.memory_analysis()) / 2**30, 3),
             compile_s=round(time.perf_counter() - t0, 1))
  if jax.default_backend() == "gpu":  # compile_check's own path: no device involved
    try:
      t = cc.target(f"{F.fit_kind}-1")
      deviceless, _, _ = compiling.compile_update_from_shapes(c, shapes, 1, devices=t.devices)
      row["deviceless_kind"] = F.fit_kind
      row["deviceless_peak_gib"] = round(cc.peak_bytes(deviceless.memory_analysis()) / 2**30, 3)
      row.update(cc.roofline(deviceless, t, shapes, c, 1))
    except Exception as e:  # reported, the measurement still runs
      row["deviceless_error"] = f"{type(e).__name__}: {e}"[:300]
  # Run it: zero weights and Adam state, one full row of random tokens, placed as compiled.
  mc = compiling.learner_model_config(c, shapes)
  optimizer = optim.make_optimizer(c.optim)
  dtype = jnp.dtype(c.model.param_dtype)
  state_sh = exe.input_shardings[0][0]
  state = jax.jit(lambda: step.init_state(jax.tree.map(
      lambda a: jnp.zeros(a.shape, dtype), jax.eval_shape(
          lambda: decoder.init_params(mc, jax.random.key(0)))), optimizer),
      out_shardings=state_sh)()
  rng = np.random.default_rng(0)
  L, P = c.packing.row_len, 64
  traj = Trajectory("fit", rng.integers(0, shapes.vocab_size, P),
                    rng.integers(0, shapes.vocab_size, L + 1 - P), np.ones(L + 1 - P, bool),
                    np.full(L + 1 - P, -1.0, np.float32), 1.0, 0)
  if shapes.is_moe:  # routing replay: random experts, k distinct per position and layer
    n, k = len(shapes.moe_layers), shapes.num_experts_per_tok
    traj.routed_experts = np.argsort(rng.random((L, n, shapes.num_experts)), -1)[
        ..., :k].astype(shapes.routing_dtype)
  spec = PackingSpec(L, (1,), c.packing.max_segments_per_row)
  (b,) = pack([traj], spec, shapes.routing_shape if shapes.is_moe else None).batches
  batch = meshlib.put(b, meshlib.batch_sharding(b, mesh))
  stats = obj.BatchStats(*[jnp.float32(x) for x in (1, 1, L + 1 - P)])
  before = (dev.memory_stats() or {}).get("peak_bytes_in_use") if hasattr(
      dev, "memory_stats") else None
  state, metrics, _ = exe(state, None, batch, stats)
  loss = float(metrics["loss"])
  stats_after = dev.memory_stats() if hasattr(dev, "memory_stats") else None
  if stats_after:
    peak = stats_after.get("peak_bytes_in_use", 0)
    row.update(measured_peak_gib=round(peak / 2**30, 3), peak_before_run_gib=round(
        (before or 0) / 2**30, 3), ratio_measured_to_predicted=round(
        peak / 2**30 / row["predicted_peak_gib"], 3))
    if "deviceless_peak_gib" in row:
      row["ratio_measured_to_deviceless"] = round(peak / 2**30 / row["deviceless_peak_gib"], 3)
  times = []
  for _ in range(F.timed_repeats):  # the state is donated: each step takes the last one's
    t0 = time.perf_counter()
    state, metrics, _ = exe(state, None, batch, stats)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t0)
  row["step_s_median"] = round(float(np.median(times)), 4)
  if row.get("roofline_micro_batch_s"):
    row["ratio_measured_to_roofline"] = round(row["step_s_median"]
                                              / row["roofline_micro_batch_s"], 3)
  row.update(loss=loss, finite=bool(np.isfinite(loss)))
  emit("fit", **row)
  state = batch = None
  jax.clear_caches()
  return row["finite"]


def section_engine(ctx):
  import numpy as np

  from fr_jax.models import registry
  from fr_jax.rollout.embedded import EmbeddedEngine
  from fr_jax.rollout.engine import Request
  name = "tiny-chat" if F.dry else "random:smollm2-135m"
  dtype = "float32" if F.dry else "bfloat16"
  m = registry.load(name, param_dtype=dtype, compute_dtype=dtype)
  N = 8 if F.dry else 128
  rng = np.random.default_rng(0)
  ok = True
  for B in ((2,) if F.dry else (8, 32)):
    reqs = [Request(f"r{i}", rng.integers(3, m.config.vocab_size, 40).tolist(), N, seed=i)
            for i in range(B)]
    eng = EmbeddedEngine(m.config, m.params, num_slots=B, max_len=40 + N + 8)
    outs = []
    med, ts = timed(lambda outs=outs, eng=eng, reqs=reqs: outs.append(eng.generate(reqs)),
                    F.timed_repeats)
    made = sum(len(c.token_ids) for c in outs[-1])
    ok &= made == B * N
    emit("engine", model=name, dtype=dtype, batch=B, new_tokens=N, median_s=round(med, 3),
         tokens_per_s=round(made / med, 1), generated=made, ok=made == B * N)
  return ok


SECTIONS = {"env": section_env, "fit": section_fit, "peer": section_peer,
            "attention": section_attention, "learner": section_learner,
            "engine": section_engine}


def main(argv):
  del argv
  t_start = time.perf_counter()
  wheels = Path(F.wheels)
  unpacked = unpack_wheels(wheels, Path(F.site)) if wheels.is_dir() else []
  if F.write_peer_fixtures:
    for p in write_peer_fixtures(Path(F.write_peer_fixtures)):
      print(p)
    return 0
  unknown = set(F.sections) - set(SECTIONS)
  if unknown:
    raise app.UsageError(f"--sections: unknown {sorted(unknown)}; choose from {list(SECTIONS)}")
  emit("start", sections=F.sections, dry=F.dry, wheels_unpacked=unpacked,
       cwd=os.getcwd())
  ctx, results = {}, {}
  for name in ["env", *[s for s in F.sections if s != "env"]]:  # env measures the peaks
    t0 = time.perf_counter()
    print(f"[device_check] {name} ...", file=sys.stderr, flush=True)
    try:
      results[name] = SECTIONS[name](ctx)
    except Exception as e:  # one section's failure is reported, the rest run
      results[name] = False
      emit("error", section=name, error=f"{type(e).__name__}: {e}"[:500],
           traceback=traceback.format_exc()[-2000:])
    print(f"[device_check] {name}: {results[name]} in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr, flush=True)
  failed = [k for k, v in results.items() if v is False]
  emit("summary", results=results, failed=failed, ok=not failed, dry=F.dry,
       wall_s=round(time.perf_counter() - t_start, 1))
  return 1 if failed else 0


if __name__ == "__main__":
  app.run(main)
