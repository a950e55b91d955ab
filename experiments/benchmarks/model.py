r"""Benchmark: loading the bundled SmolLM2-135M GGUF, and forward+backward of SmolLM2-135M on
8x256 tokens, fr_jax vs transformers.

  .venv/bin/python -m experiments.benchmarks.model [--repeats=5] [--batch=8] [--seq=256]
  .venv/bin/python -m experiments.benchmarks.model --cases=gguf_load [--load_repeats=3]

`gguf_load` times `registry.load("smollm2-135m-instruct")` (read the Q4_1 GGUF, dequantize to
f32, build the tokenizer): the first load, then the median of --load_repeats more.

Both sides compute the same loss on the same weights (the bundled GGUF, dequantized to f32)
and the same tokens: the mean next-token negative log-likelihood, and its gradient with
respect to every parameter. fr_jax runs jit(value_and_grad) over the pure params tree
(f32 without and with per-layer rematerialisation, and bf16 compute with f32 parameters);
the peer is transformers' PyTorch
LlamaForCausalLM in f32 (eager attention, torch's default threads).

Prints JSON lines: `machine`, `gguf_load`, `matmul_peak` (jitted square matmul, f32 and bf16
inputs with f32 accumulation: this machine's measured peak), one `fwd_bwd` line per
implementation (median of --repeats timed steps after warm-up; tokens/s; model FLOPs utilisation
against the measured peak for its dtype), and `summary` with the ratios. Model FLOPs are
analytic (ModelConfig.flops_per_token: 2 x matmul params incl. the LM head + causal attention,
x3 for forward + backward); XLA's cost analysis counts a scanned layer body once, so it is not
used.
"""

import numpy as np
from absl import app, flags, logging

from experiments.benchmarks.common import emitter, machine, timed

emit = emitter("model")

flags.DEFINE_integer("batch", 8, "sequences per step")
flags.DEFINE_integer("seq", 256, "tokens per sequence")
flags.DEFINE_integer("repeats", 5, "timed steps per implementation (median reported)")
flags.DEFINE_integer("matmul_n", 2048, "size of the square matmul for the peak measurement")
flags.DEFINE_bool("torch_peer", True, "also time the transformers peer")
flags.DEFINE_list("cases", ["gguf_load", "fwd_bwd"], "which cases to run")
flags.DEFINE_integer("load_repeats", 3, "timed GGUF loads after the first (median reported)")
F = flags.FLAGS


def matmul_peak(n, repeats):
  import jax
  import jax.numpy as jnp
  out = {}
  for name, dt in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dt)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dt)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    med, _ = timed(lambda f=f, a=a, b=b: f(a, b).block_until_ready(), max(repeats, 5),
                   warmup=2)
    out[name] = 2 * n**3 / med
  return out


def gguf_load(registry, repeats):
  """The bundled model loaded (first, then `repeats` more): the last LoadedModel and a record."""
  import time
  path = registry.smollm2_gguf_path()
  t0 = time.perf_counter()
  m = registry.load("smollm2-135m-instruct")
  first = time.perf_counter() - t0
  loaded = []
  med, ts = timed(lambda: loaded.append(registry.load("smollm2-135m-instruct")), repeats,
                  warmup=0)
  m = loaded[-1] if loaded else m
  return m, dict(file=path.name, file_mb=round(path.stat().st_size / 2**20, 1),
                 first_s=round(first, 3), median_s=round(med, 3),
                 all_s=[round(t, 3) for t in ts], params=m.config.num_params)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  unknown = set(F.cases) - {"gguf_load", "fwd_bwd"}
  if unknown:
    raise app.UsageError(f"--cases: unknown {sorted(unknown)}; choose from gguf_load, fwd_bwd")
  import jax
  import jax.numpy as jnp

  from fr_jax.models import registry, scoring

  B, T = F.batch, F.seq
  emit("machine", **machine())
  m = None
  if "gguf_load" in F.cases:
    m, rec = gguf_load(registry, F.load_repeats)
    emit("gguf_load", **rec)
  if "fwd_bwd" not in F.cases:
    return
  peak = matmul_peak(F.matmul_n, F.repeats)
  emit("matmul_peak", n=F.matmul_n, float32_gflops=round(peak["float32"] / 1e9, 1),
       bf16_in_f32_acc_gflops=round(peak["bfloat16"] / 1e9, 1))

  m = m or registry.load("smollm2-135m-instruct")
  cfg = m.config
  rng = np.random.default_rng(0)
  ids = rng.integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
  tokens, targets = jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:])
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  n_tok = B * T
  model_flops = 3 * cfg.flops_per_token(T) * n_tok  # fwd + bwd

  results = {}
  for compute, remat in (("float32", False), ("float32", True), ("bfloat16", True)):
    c = cfg.replace(compute_dtype=compute)

    def loss_fn(params, c=c, remat=remat):
      lp, _ = scoring.score_packed(params, c, tokens, targets, positions, None, 1.0,
                                   remat=remat)
      return -lp.mean()

    step = jax.jit(jax.value_and_grad(loss_fn))
    loss_val = float(step(m.params)[0])
    med, ts = timed(lambda step=step: jax.block_until_ready(step(m.params)), F.repeats)
    pk = peak["float32"] if compute == "float32" else peak["bfloat16"]
    results[f"jax_{compute}_remat{int(remat)}"] = med
    emit("fwd_bwd", impl="fr_jax", compute=compute, remat=remat, tokens=n_tok, loss=loss_val,
         median_s=round(med, 4), all_s=[round(t, 3) for t in ts],
         tokens_per_s=round(n_tok / med, 1), model_tflops=round(model_flops / 1e12, 3),
         achieved_gflops=round(model_flops / med / 1e9, 1),
         mfu_vs_measured_peak=round(model_flops / med / pk, 3))

  if F.torch_peer:
    import torch
    import transformers
    p = registry.smollm2_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        p.parent, gguf_file=p.name, dtype=torch.float32, attn_implementation="eager")
    model.train()
    t_ids = torch.as_tensor(ids[:, :-1].astype(np.int64))
    t_tgt = torch.as_tensor(ids[:, 1:].astype(np.int64))

    def torch_step():
      model.zero_grad(set_to_none=True)
      logits = model(t_ids).logits
      loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                               t_tgt.reshape(-1))
      loss.backward()
      return float(loss)

    loss_t = torch_step()
    med, ts = timed(torch_step, F.repeats)
    results["torch_float32"] = med
    emit("fwd_bwd", impl="transformers", compute="float32", tokens=n_tok, loss=loss_t,
         median_s=round(med, 4), all_s=[round(t, 3) for t in ts],
         tokens_per_s=round(n_tok / med, 1), torch=torch.__version__,
         transformers=transformers.__version__, threads=torch.get_num_threads(),
         achieved_gflops=round(model_flops / med / 1e9, 1),
         mfu_vs_measured_peak=round(model_flops / med / peak["float32"], 3))

  summary = {}
  if "torch_float32" in results:
    ref = results["torch_float32"]
    summary = {f"speedup_{k.removeprefix('jax_')}_vs_torch_f32": round(ref / v, 2)
               for k, v in results.items() if k.startswith("jax_")}
    summary["target_f32"] = 1.5
  emit("summary", **summary)


if __name__ == "__main__":
  app.run(main)
