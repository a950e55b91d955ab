r"""Benchmark: the embedded engine's generation and multi-turn KV reuse, against peers.

  .venv/bin/python -m experiments.benchmarks.rollout [--cases=generate,multiturn]
      [--batches=1,8,32] [--new_tokens=128] [--llama_cpp]
  .venv/bin/python -m experiments.benchmarks.rollout --cases=vllm   # needs make vllm-tools

SmolLM2-135M-Instruct (the bundled GGUF) throughout.

`generate`: the same prompts (ChatML arithmetic questions, 30-60 tokens) and weights at
temperature 1, stop tokens ignored, so every sequence generates exactly --new_tokens tokens.
fr_jax runs `EmbeddedEngine.generate` with one slot per sequence after a warm-up call
(compilation excluded), and reports its engine/learner mismatch at lag 0 (`mismatch` lines:
per-token |engine log p - learner log p| against the learner's teacher-forced scoring, and
the trust gate's acceptance at delta 3e-3 and 1e-2).
Peers: transformers' `model.generate(do_sample=True)` with left padding (f32), and with
--llama_cpp, llama.cpp (`llama-cpp-python`, optional, not pinned by the project: see
docs/rollout.md) on the same GGUF file, one stream, batch 1 only.

`multiturn`: --episodes episodes of --turns model turns, each --turn_tokens sampled tokens
followed by a scripted tool response (~40 tokens, rendered by the agent loop's own
`user_turn_ids`), all episodes batched on one engine with a slot each; once with prefix reuse
and once without (every turn re-prefilled), same seeds. Reports wall time, prefill tokens
and the ratio.

`vllm`: a real vLLM 0.32 CPU server (`launch.vllm_server`, enforce-eager, the fleet's flags)
beside the embedded engine, on the same SmolLM2 weights (the registry's, exported as HF) and
the same requests (the `generate` prompts, temperature 1, --new_tokens each, EOS ignored), at
--vllm_batches and in float32 and bfloat16 (--vllm_dtypes; the embedded engine's parameters
and compute in that dtype). Per dtype: the server starts, is warmed up and timed, and stops;
then the embedded engine is warmed up and timed, so the two never share the cores. Lines
`generate` with impl vllm / fr_jax and `dtype`, and `update_weights` (the relay's in-place
load of the same weights, idle server); the summary has vllm/fr_jax throughput ratios.

JSON lines: `machine`, then per case `generate` / `multiturn` lines with medians and a
`summary` with the ratios.
"""

import statistics
import time

import numpy as np
from absl import app, flags, logging

from experiments.benchmarks.common import emitter, machine, timed

emit = emitter("rollout")

flags.DEFINE_list("cases", ["generate", "multiturn"], "generate, multiturn, vllm")
flags.DEFINE_list("vllm_batches", ["8", "32"], "batch sizes (vllm)")
flags.DEFINE_list("vllm_dtypes", ["float32", "bfloat16"], "dtypes (vllm)")
flags.DEFINE_integer("vllm_port", 31850, "the vLLM server's port (vllm)")
flags.DEFINE_list("batches", ["1", "8", "32"], "batch sizes (generate)")
flags.DEFINE_integer("new_tokens", 128, "tokens generated per sequence (generate)")
flags.DEFINE_integer("repeats", 3, "timed runs per point (median reported)")
flags.DEFINE_bool("torch_peer", True, "run the transformers peer (generate)")
flags.DEFINE_bool("llama_cpp", False, "run llama.cpp at batch 1 (needs llama-cpp-python)")
flags.DEFINE_bool("mismatch", True, "report the engine/learner mismatch (generate)")
flags.DEFINE_integer("episodes", 16, "episodes (multiturn)")
flags.DEFINE_integer("turns", 10, "model turns per episode (multiturn)")
flags.DEFINE_integer("turn_tokens", 32, "tokens sampled per model turn (multiturn)")
flags.DEFINE_integer("multiturn_repeats", 1, "timed runs per mode (multiturn)")
F = flags.FLAGS


def prompts(tok, n, rng):
  out = []
  for _ in range(n):
    a, b = rng.integers(10, 1000, 2)
    text = tok.chatml([{"role": "user", "content": f"What is {a} + {b}? Explain step by step."}])
    out.append(tok.encode(text))
  return out


def mismatch(m, reqs, outs):
  """Engine/learner mismatch at lag 0: the learner's f32 teacher-forced log-probs of what the
  engine sampled, against the engine's behaviour log-probs; and the trust gate's acceptance
  on them (sequence gate, advantages irrelevant)."""
  import jax.numpy as jnp

  from fr_jax import objective
  from fr_jax.models import decoder, scoring
  d, learner, behaviour = [], [], []
  for r, c in zip(reqs, outs):
    seq = np.asarray(list(r.prompt_ids) + list(c.token_ids))
    h, _ = decoder.forward(m.params, m.config, seq[None, :-1], np.arange(len(seq) - 1)[None])
    lp, _ = scoring.score_hidden(m.params, m.config, h, jnp.asarray(seq[None, 1:]))
    lp = np.asarray(lp)[0, len(r.prompt_ids) - 1:]
    learner.append(lp)
    behaviour.append(np.asarray(c.logprobs))
    d.append(np.abs(lp - behaviour[-1]))
  d = np.concatenate(d)
  out = dict(mean_abs_dlogp=float(d.mean()), max_abs_dlogp=float(d.max()),
             p99_abs_dlogp=float(np.quantile(d, 0.99)))
  L = np.stack(learner)
  Bh = np.stack(behaviour)
  for delta in (3e-3, 1e-2):
    _, aux = objective.flash_reinforce_loss(L, Bh, np.zeros(len(L)), np.ones_like(L, bool),
                                            delta=delta)
    out[f"acceptance_delta_{delta:g}"] = float(aux["acceptance_rate"])
    out[f"seq_kl_mean_delta_{delta:g}"] = float(aux["seq_kl_mean"])
  return out


def case_generate(m, summary):
  from fr_jax.models import registry
  from fr_jax.rollout.embedded import EmbeddedEngine
  from fr_jax.rollout.engine import Request
  rng = np.random.default_rng(0)
  N = F.new_tokens
  peer = None
  for B in [int(b) for b in F.batches]:
    ps = prompts(m.tokenizer, B, rng)
    max_len = max(len(p) for p in ps) + N + 1
    reqs = [Request(f"r{i}", p, N, temperature=1.0, seed=i) for i, p in enumerate(ps)]
    eng = EmbeddedEngine(m.config, m.params, num_slots=B, max_len=max_len, prefix_reuse=False)
    eng.generate(reqs)  # warm-up: compiles prefill buckets and the decode step
    outs = []
    med, ts = timed(lambda outs=outs, eng=eng, reqs=reqs: outs.append(eng.generate(reqs)),
                    F.repeats, warmup=0)
    n_gen = sum(len(c.token_ids) for c in outs[-1])
    ttft = statistics.median(c.ttft_s for c in outs[-1])
    emit("generate", impl="fr_jax", batch=B, new_tokens=N, median_s=round(med, 3),
         all_s=[round(t, 3) for t in ts], tokens_per_s=round(n_gen / med, 1),
         ttft_median_s=round(ttft, 4), compiles=eng.compile_counts)
    if F.mismatch:
      emit("mismatch", batch=B, lag=0, **mismatch(m, reqs, outs[-1]))
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

      def run(n, peer=peer, ids=ids, attn=attn):
        with torch.no_grad():
          return peer.generate(ids, attention_mask=attn, do_sample=True, temperature=1.0,
                               top_p=1.0, top_k=0, max_new_tokens=n, min_new_tokens=n,
                               pad_token_id=2)

      run(2)  # warm-up
      med_t, ts_t = timed(lambda: run(N), F.repeats, warmup=0)
      ttft_t, _ = timed(lambda: run(1), F.repeats, warmup=0)
      emit("generate", impl="transformers", batch=B, new_tokens=N,
           median_s=round(med_t, 3), all_s=[round(t, 3) for t in ts_t],
           tokens_per_s=round(B * N / med_t, 1), ttft_median_s=round(ttft_t, 4),
           torch=torch.__version__, transformers=transformers.__version__)
      summary[f"batch{B}_vs_transformers"] = round(med_t / med, 2)
    if F.llama_cpp and B == 1:
      summary["batch1_vs_llama_cpp"] = round(llama_cpp_generate(ps[0], N) / med, 2)


def case_vllm(summary):
  """vLLM's CPU server beside the embedded engine (module docstring)."""
  from fr_jax.models import registry
  from fr_jax.rollout.embedded import EmbeddedEngine
  from fr_jax.rollout.engine import Request
  from fr_jax.rollout.vllm import VLLMEngine
  from launch import vllm_server
  N = F.new_tokens
  batches = [int(b) for b in F.vllm_batches]
  work = "runs/bench_vllm"
  model_dir = vllm_server.export_model("smollm2-135m-instruct", work)
  for dtype in F.vllm_dtypes:
    m = registry.load("smollm2-135m-instruct", param_dtype=dtype, compute_dtype=dtype)
    rng = np.random.default_rng(0)
    reqs = {B: [Request(f"r{B}-{i}", p, N, temperature=1.0, seed=i)
                for i, p in enumerate(prompts(m.tokenizer, B, rng))] for B in batches}
    rates = {}
    log = f"{work}/server-{dtype}.log"
    proc = vllm_server.start(model_dir, port=F.vllm_port, api_key="bench", dtype=dtype, log=log)
    url = vllm_server.url_of("127.0.0.1", F.vllm_port)
    try:
      ready = vllm_server.wait_ready(proc, url, log=log)
      eng = VLLMEngine(url, api_key="bench")
      for B in batches:
        eng.generate(reqs[B])  # warm-up
        outs = []
        med, ts = timed(lambda outs=outs, e=eng, rs=reqs[B]: outs.append(e.generate(rs)),
                        F.repeats, warmup=0)
        n_gen = sum(len(c.token_ids) for c in outs[-1])
        rates[B] = n_gen / med
        emit("generate", impl="vllm", dtype=dtype, batch=B, new_tokens=N,
             median_s=round(med, 3), all_s=[round(t, 3) for t in ts],
             tokens_per_s=round(n_gen / med, 1), server_ready_s=round(ready, 1))
        # (no time to first token: a request's tokens come back together, not streamed)
      # a weight update as the relay makes it: pause, in-place reload, cache reset, resume
      med_u, ts_u = timed(lambda e=eng: e.update_weights(model_dir, 1), F.repeats, warmup=1)
      emit("update_weights", impl="vllm", dtype=dtype, median_s=round(med_u, 3),
           all_s=[round(t, 3) for t in ts_u], route="collective_rpc reload_weights")
      eng.close()
    finally:
      vllm_server.stop(proc)
    for B in batches:
      max_len = max(len(r.prompt_ids) for r in reqs[B]) + N + 1
      eng = EmbeddedEngine(m.config, m.params, num_slots=B, max_len=max_len,
                           prefix_reuse=False)
      eng.generate(reqs[B])  # warm-up: compiles
      outs = []
      med, ts = timed(lambda outs=outs, e=eng, rs=reqs[B]: outs.append(e.generate(rs)),
                      F.repeats, warmup=0)
      n_gen = sum(len(c.token_ids) for c in outs[-1])
      emit("generate", impl="fr_jax", dtype=dtype, batch=B, new_tokens=N,
           median_s=round(med, 3), all_s=[round(t, 3) for t in ts],
           tokens_per_s=round(n_gen / med, 1))
      summary[f"vllm_vs_fr_jax_{dtype}_batch{B}"] = round(rates[B] / (n_gen / med), 2)


def llama_cpp_generate(prompt, N):
  """llama.cpp on the bundled GGUF (its own Q4_1 weights), one stream of N sampled tokens
  from `prompt`, stop tokens ignored, with 1 thread (its default here) and with one thread
  per core. Emits a line per thread count; returns the best median wall time."""
  import os

  import llama_cpp

  from fr_jax.models import registry
  path = registry.smollm2_gguf_path()
  best = None
  for threads in sorted({1, os.cpu_count() or 1}):
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + N + 8,
                          n_batch=512, n_threads=threads, verbose=False)

    def run(llm=llm):
      n = 0
      for _ in llm.generate(prompt, temp=1.0, top_k=0, top_p=1.0, min_p=0.0, reset=True):
        n += 1
        if n == N:
          break
      return n

    run()  # warm-up
    med, ts = timed(run, F.repeats, warmup=0)
    emit("generate", impl="llama.cpp", batch=1, new_tokens=N, gguf=path.name,
         threads=threads, median_s=round(med, 3), all_s=[round(t, 3) for t in ts],
         tokens_per_s=round(N / med, 1), llama_cpp_python=llama_cpp.__version__)
    best = med if best is None else min(best, med)
  return best


def tool_response(rng):
  """Tool output that the agent loop's wrapping (tool response tags, turn ends, the next
  header) brings to about 40 tokens."""
  a, b = rng.integers(100, 1000, 2)
  return f"{a} * {b} = {a * b}"


def case_multiturn(m, summary):
  from fr_jax.rollout.agent import RESPONSE_CLOSE, RESPONSE_OPEN, user_turn_ids
  from fr_jax.rollout.embedded import EmbeddedEngine
  from fr_jax.rollout.engine import Request
  tok = m.tokenizer
  rng = np.random.default_rng(1)
  E, T, N = F.episodes, F.turns, F.turn_tokens
  starts = prompts(tok, E, rng)
  appended = [[user_turn_ids(tok, tool_response(rng), (RESPONSE_OPEN, RESPONSE_CLOSE))
               for _ in range(T)] for _ in range(E)]
  longest = max(len(p) + sum(len(a) for a in app) for p, app in zip(starts, appended))
  max_len = longest + T * N + 1
  engines = {mode: EmbeddedEngine(m.config, m.params, num_slots=E, max_len=max_len,
                                  prefix_reuse=mode == "reuse")
             for mode in ("reuse", "no_reuse")}
  t0 = time.perf_counter()
  for eng in engines.values():  # every prefill bucket and decode window (shared jit caches)
    eng.warmup()
  compiles = engines["reuse"].compile_counts
  emit("warmup", wall_s=round(time.perf_counter() - t0, 1), compiles=compiles,
       prefill_buckets=engines["reuse"].buckets, decode_windows=engines["reuse"].windows)

  def run(eng):
    eng.stats.clear()
    ctx = [list(p) for p in starts]
    lps, toks = [], []
    t0 = time.perf_counter()
    for t in range(T):
      reqs = [Request(f"e{i}t{t}", ctx[i], N, temperature=1.0, seed=1000 * i + t)
              for i in range(E)]
      for i, c in enumerate(eng.generate(reqs)):
        ctx[i] += c.token_ids + appended[i][t]
        lps.append(np.asarray(c.logprobs))
        toks.append(c.token_ids)
      logging.warning("multiturn %s: turn %d/%d done at %.1f s, context %d tokens",
                      "reuse" if eng.prefix_reuse else "no_reuse", t + 1, T,
                      time.perf_counter() - t0, max(len(x) for x in ctx))
    return time.perf_counter() - t0, dict(eng.stats), toks, lps

  walls = {"reuse": [], "no_reuse": []}
  last = {}
  for _ in range(F.multiturn_repeats):
    for mode, eng in engines.items():
      wall, stats, toks, lps = run(eng)
      walls[mode].append(wall)
      last[mode] = (stats, toks, lps)
  same = [a == b for a, b in zip(last["reuse"][1], last["no_reuse"][1])]
  dlp = max(float(np.max(np.abs(a - b))) for a, b, s in
            zip(last["reuse"][2], last["no_reuse"][2], same) if s)
  med = {}
  for mode in engines:
    stats = last[mode][0]
    med[mode] = statistics.median(walls[mode])
    emit("multiturn", mode=mode, episodes=E, turns=T, turn_tokens=N,
         tool_response_tokens=round(float(np.mean([len(a) for app in appended for a in app])),
                                    1),
         final_context_tokens=longest + T * N, wall_s=round(med[mode], 2),
         all_s=[round(w, 2) for w in walls[mode]], prefill_tokens=stats["prefill_tokens"],
         reused_tokens=stats.get("reused_tokens", 0), evictions=stats.get("evictions", 0),
         generated_tokens=E * T * N, compiles=engines[mode].compile_counts)
  summary["multiturn_wall_ratio"] = round(med["no_reuse"] / med["reuse"], 2)
  summary["multiturn_prefill_ratio"] = round(last["no_reuse"][0]["prefill_tokens"]
                                             / last["reuse"][0]["prefill_tokens"], 2)
  summary["multiturn_turns_identical"] = f"{sum(same)}/{len(same)}"
  summary["multiturn_max_abs_dlogp_identical_turns"] = dlp
  summary["multiturn_recompiles_after_warmup"] = {
      k: engines["reuse"].compile_counts[k] - compiles[k] for k in compiles}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from fr_jax.models import registry
  emit("machine", **machine())
  m = registry.load("smollm2-135m-instruct")
  summary = {}
  if "generate" in F.cases:
    case_generate(m, summary)
  if "multiturn" in F.cases:
    case_multiturn(m, summary)
  if "vllm" in F.cases:
    case_vllm(summary)
  summary["targets"] = (">= 3x wall time with reuse (multiturn); batch 1 >= 2x 56.6 tok/s; "
                        ">= 3x transformers at batch 8")
  emit("summary", **summary)


if __name__ == "__main__":
  app.run(main)
