r"""Benchmark: generation with the embedded engine vs transformers' PyTorch `generate`.

  .venv/bin/python -m experiments.benchmarks.rollout [--batches=1,8,32] [--new_tokens=128]

SmolLM2-135M-Instruct (the bundled GGUF, f32) on the same prompts (ChatML arithmetic
questions, 30-60 tokens) and the same weights. Sampling at temperature 1 with min_new_tokens
forced by ignoring stop tokens, so every sequence generates exactly --new_tokens tokens.
fr_jax runs `EmbeddedEngine.generate` with one slot per sequence after a warm-up call
(compilation excluded); the peer runs `model.generate(do_sample=True)` with left padding.

JSON lines: `machine`, then per batch size and implementation a `generate` line with the
median wall time, generated tokens/s and time to first token (fr_jax: measured per request;
torch: a max_new_tokens=1 call), and a `summary` with the ratios (target: >= 2x at batch 8).
"""

import statistics

from absl import app, flags, logging
import numpy as np

from experiments.benchmarks.common import emitter, machine, timed

emit = emitter("rollout")

flags.DEFINE_list("batches", ["1", "8", "32"], "batch sizes")
flags.DEFINE_integer("new_tokens", 128, "tokens generated per sequence")
flags.DEFINE_integer("repeats", 3, "timed runs per point (median reported)")
flags.DEFINE_bool("torch_peer", True, "run the transformers peer")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "fr_jax parameter dtype")
F = flags.FLAGS


def prompts(tok, n, rng):
  out = []
  for _ in range(n):
    a, b = rng.integers(10, 1000, 2)
    text = tok.chatml([{"role": "user", "content": f"What is {a} + {b}? Explain step by step."}])
    out.append(tok.encode(text))
  return out


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from fr_jax.models import registry
  from fr_jax.rollout.embedded import EmbeddedEngine
  from fr_jax.rollout.engine import Request

  emit("machine", **machine())
  m = registry.load("smollm2-135m-instruct", param_dtype=F.dtype, compute_dtype=F.dtype)
  rng = np.random.default_rng(0)
  N = F.new_tokens
  summary = {}
  peer = None
  for B in [int(b) for b in F.batches]:
    ps = prompts(m.tokenizer, B, rng)
    max_len = max(len(p) for p in ps) + N + 1
    eng = EmbeddedEngine(m.config, m.params, num_slots=B, max_len=max_len)
    reqs = [Request(f"r{i}", p, N, temperature=1.0, seed=i) for i, p in enumerate(ps)]
    eng.generate(reqs)  # warm-up: compiles prefill buckets and the decode step
    outs = []
    med, ts = timed(lambda: outs.append(eng.generate(reqs)), F.repeats, warmup=0)
    n_gen = sum(len(c.token_ids) for c in outs[-1])
    ttft = statistics.median(c.ttft_s for c in outs[-1])
    emit("generate", impl="fr_jax", batch=B, new_tokens=N, dtype=F.dtype,
         median_s=round(med, 3), all_s=[round(t, 3) for t in ts],
         tokens_per_s=round(n_gen / med, 1), ttft_median_s=round(ttft, 4),
         compiles=eng.compile_counts)
    if F.torch_peer:
      import torch
      import transformers
      if peer is None:
        p = registry.smollm2_gguf_path()
        peer = transformers.AutoModelForCausalLM.from_pretrained(
            p.parent, gguf_file=p.name, dtype=torch.float32).eval()
      L = max(len(p) for p in ps)
      ids = torch.full((B, L), 2, dtype=torch.long)  # left padding with <|im_end|>
      attn = torch.zeros((B, L), dtype=torch.long)
      for i, p in enumerate(ps):
        ids[i, L - len(p):] = torch.as_tensor(p)
        attn[i, L - len(p):] = 1

      def run(n):
        with torch.no_grad():
          return peer.generate(ids, attention_mask=attn, do_sample=True, temperature=1.0,
                               top_p=1.0, top_k=0, max_new_tokens=n, min_new_tokens=n,
                               pad_token_id=2)

      run(2)  # warm-up
      med_t, ts_t = timed(lambda: run(N), F.repeats, warmup=0)
      ttft_t, _ = timed(lambda: run(1), F.repeats, warmup=0)
      emit("generate", impl="transformers", batch=B, new_tokens=N, dtype="float32",
           median_s=round(med_t, 3), all_s=[round(t, 3) for t in ts_t],
           tokens_per_s=round(B * N / med_t, 1), ttft_median_s=round(ttft_t, 4),
           torch=torch.__version__, transformers=transformers.__version__)
      summary[f"batch{B}_speedup"] = round(med_t / med, 2)
  summary["target"] = ">= 2x the peer at batch 8"
  emit("summary", **summary)


if __name__ == "__main__":
  app.run(main)
