r"""Benchmark: the full learner update (score + FlashREINFORCE loss + backward + AdamW step)
for SmolLM2-135M, fr_jax against a PyTorch + transformers peer on the same data.

  .venv/bin/python -m experiments.benchmarks.learner [--repeats=3] [--cases=fixed,ragged]
  .venv/bin/python -m experiments.benchmarks.learner --cases=long [--long_lens=4096,8192]
  .venv/bin/python -m experiments.benchmarks.learner --cases=ragged --minibatches=4 \
      --notorch_peer   # one update() call makes 4 consecutive steps of B/4 (timed per call)
  .venv/bin/python -m experiments.benchmarks.learner --cases=ragged --lora_ranks=16   # LoRA too
  .venv/bin/python -m experiments.benchmarks.learner --model=tiny-chat --notorch_peer \
      --cases=fixed --dtypes=float32 --repeats=41   # the per-update overhead, not the model

Cases:
  fixed:  B=8 trajectories of 256 tokens (64 prompt + 192 completion, 10% tool tokens).
  ragged: B=16 trajectories, prompts 30-120 tokens, lognormal completions (median 160,
          sigma 0.8, capped at 900): fr_jax packs them into 1024-token rows; the peer pads
          to the longest, as a padded implementation does.
  agent:  B=16 agent turns, contexts of 300-700 tokens, lognormal actions (median 48, sigma
          0.6, capped at 300), in 1024-token rows: the LM head over action positions only
          scores a quarter of each row (`--heads=actions,full` times it against the full head
          in one run).
  long:   one packed row of --long_lens tokens each (256 prompt + the rest completion), one
          fresh process per length: the compiled update's memory (XLA memory_analysis: temp,
          arguments, outputs) and compile time, then (unless --nolong_run) the process's
          peak RSS and the time of one update. No peer. The
          trust gate is off (delta=inf) and behaviour log-probs are constant: memory and work
          do not depend on them.
Behaviour log-probs are the model's own plus small noise, so the trust gate admits most.

fr_jax runs `Learner.update` (packing, transfer, compiled step, metrics) in f32 and with
bf16 compute (f32 master weights), both with per-layer rematerialisation. The peer runs
transformers' LlamaForCausalLM (f32) with the same loss written in torch,
global-norm clipping and torch.optim.AdamW with the same hyper-parameters, SDPA attention and
per-layer gradient checkpointing (the counterpart of fr_jax's remat).

JSON lines: `machine`, `matmul_peak`, one `update` line per (case, implementation) with the
median step time, tokens/s, model FLOPs (analytic) and MFU, and for fr_jax the hardware
FLOPs from XLA's compiled cost analysis (per-layer corrected; remat included) and that MFU;
then `summary` with the speed ratios.
"""

import gc

import numpy as np
from absl import app, flags, logging

from experiments.benchmarks.common import emitter, machine, timed, torch_matmul_peak
from experiments.benchmarks.learner_cases import CASES, make_trajectories

emit = emitter("learner")

flags.DEFINE_integer("repeats", 3, "timed updates per implementation (median reported)")
flags.DEFINE_list("cases", ["fixed", "ragged"], "which cases to run")
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "fr_jax compute dtypes")
flags.DEFINE_bool("torch_peer", True, "run the PyTorch + transformers peer")
flags.DEFINE_list("long_lens", ["4096", "8192", "16384"], "row lengths of the long case")
flags.DEFINE_string("model", "smollm2-135m-instruct", "fr_jax: the registry model (a tiny one, "
                    "e.g. tiny-chat, shows the per-update overhead); the peer and the long "
                    "case run SmolLM2")
flags.DEFINE_string("attention", None, "model.attention for fr_jax (default: the config's)")
flags.DEFINE_integer("minibatches", 1, "fr_jax: split each case's batch into this many "
                     "consecutive updates (the sequential-minibatch ablation)")
flags.DEFINE_list("heads", ["actions"], "fr_jax's LM head: actions (the default "
                  "packing.head_buckets) and/or full (every position scored)")
flags.DEFINE_list("lora_ranks", [], "also time LoRA updates (f32, every projection, alpha = "
                  "2 x rank) at these ranks, fr_jax and the peer with PEFT 0.21.2")
flags.DEFINE_integer("long_one", 0, "internal: measure one long row of this many tokens")
flags.DEFINE_bool("long_run", True, "long case: also run one update (peak RSS, time), not "
                  "only compile it")
F = flags.FLAGS

def set_behaviour_logp(trajs, params, cfg, row_len, rng):
  """Behaviour log-probs = the model's own log-probs of each completion token + noise,
  scored on the packed batch (one compile)."""
  import jax

  from fr_jax.models import scoring
  from fr_jax.packing import PackingSpec, pack
  score = jax.jit(lambda p, b: scoring.score_packed(p, cfg, b.tokens, b.targets, b.positions,
                                                    b.segment_ids, 1.0)[0])
  for b in pack(trajs, PackingSpec(row_len, (8,), 64)).batches:
    lp = np.asarray(score(params, b))
    for s in np.flatnonzero(b.segment_valid):
      t = trajs[b.traj_index[s]]
      r, cols = np.nonzero(b.segment_ids == s + 1)
      own = lp[r, cols][len(t.prompt_tokens) - 1:]
      own = np.minimum(own + 0.02 * rng.standard_normal(own.shape), 0.0)
      t.behavior_logp = np.where(t.action_mask, own, 0.0).astype(np.float32)


def torch_peer(trajs, cfg, repeats, delta, lora_rank=0):
  """The peer's median update; with `lora_rank`, PEFT LoRA on every projection (alpha = 2 x
  rank), AdamW over the adapters only."""
  import torch
  import transformers

  from fr_jax.models import registry
  p = registry.smollm2_gguf_path()
  model = transformers.AutoModelForCausalLM.from_pretrained(
      p.parent, gguf_file=p.name, dtype=torch.float32, attn_implementation="sdpa")
  model.train()
  # Matched memory policy: fr_jax rematerialises each layer; the peer checkpoints each layer.
  # (Eager attention without checkpointing stores [B, heads, T, T] per layer and runs out of
  # this machine's 24 GB on the ragged case.)
  model.gradient_checkpointing_enable()
  model.config.use_cache = False
  if lora_rank:
    import peft
    model.enable_input_require_grads()  # checkpointed layers need a grad path from the input
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
  params = [q for q in model.parameters() if q.requires_grad]
  opt = torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
  B = len(trajs)
  Lmax = max(t.length for t in trajs)
  ids = np.zeros((B, Lmax), np.int64)
  attn = np.zeros((B, Lmax), np.int64)
  tgt_mask = np.zeros((B, Lmax - 1), bool)
  blogp = np.zeros((B, Lmax - 1), np.float32)
  for i, t in enumerate(trajs):
    seq = t.tokens
    ids[i, :len(seq)] = seq
    attn[i, :len(seq)] = 1
    P = len(t.prompt_tokens)
    tgt_mask[i, P - 1:len(seq) - 1] = t.action_mask
    blogp[i, P - 1:len(seq) - 1] = t.behavior_logp
  ids, attn = torch.as_tensor(ids), torch.as_tensor(attn)
  mask, bl = torch.as_tensor(tgt_mask), torch.as_tensor(blogp)
  R = torch.as_tensor([t.reward for t in trajs], dtype=torch.float32)
  A = R - R.mean()

  def step():
    opt.zero_grad(set_to_none=True)
    logits = model(ids, attention_mask=attn).logits[:, :-1].float()
    # gather - logsumexp: never materialises a second [B, T, V] log_softmax tensor.
    logp = logits.gather(-1, ids[:, 1:, None])[..., 0] - torch.logsumexp(logits, -1)
    m = mask.float()
    T = m.sum(1).clamp(min=1)
    with torch.no_grad():
      p = bl.exp().clamp(1e-6, 1 - 1e-6)
      q = logp.exp().clamp(1e-6, 1 - 1e-6)
      d = (p * (p.log() - q.log()) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))) * m
      admitted = ((d.sum(1) / T).clamp(min=0) <= delta).float()
      rho = torch.exp((logp - bl) * m)
    loss = -((A * admitted / T / B)[:, None] * rho * logp * m).sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return float(loss.detach())

  med, ts = timed(step, repeats)
  return med, ts, int(B * Lmax), torch.__version__, transformers.__version__


def long_one(L):
  """One long row through Learner.update, in this (fresh) process: emits its `long` line."""
  import resource
  import time

  from fr_jax.learner import config as lcfg
  from fr_jax.learner.learner import Learner
  from fr_jax.models import registry
  from fr_jax.trajectory import Trajectory
  model = registry.load("smollm2-135m-instruct")
  rng = np.random.default_rng(L)
  P, C = 256, L - 256
  t = Trajectory(f"long{L}", rng.integers(0, model.config.vocab_size, P),
                 rng.integers(0, model.config.vocab_size, C), np.ones(C, bool),
                 np.full(C, -1.0, np.float32), 1.0, 0)
  c = lcfg.default_config()
  c.batch_size = 1
  c.objective.delta = float("inf")
  c.packing.row_len = L
  c.packing.row_buckets = (1,)
  c.log.peak_flops = 1e11  # not measured here: no MFU in this case
  if F.attention:
    c.model.attention = F.attention
  learner = Learner(c, model=model)
  t0 = time.perf_counter()
  _, stats, dbs = learner._micro_batches([t], 1.0, None)
  exe, _ = learner._executable("update", learner.state, None, dbs[0], stats)
  compile_s = time.perf_counter() - t0
  mem = exe.memory_analysis()
  mib = lambda b: round(b / 2**20, 1)  # noqa: E731
  row = dict(row_len=L, attention=c.model.get("attention", "(no such option)"),
             temp_mib=mib(mem.temp_size_in_bytes), argument_mib=mib(mem.argument_size_in_bytes),
             output_mib=mib(mem.output_size_in_bytes), compile_s=round(compile_s, 1))
  if F.long_run:
    t0 = time.perf_counter()
    learner.update([t], log_ids=False)  # the compiled executable above
    dt = time.perf_counter() - t0
    row.update(peak_rss_mib=mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
               update_s=round(dt, 1), tokens_per_s=round((L - 1) / dt, 1))
  emit("long", **row)
  learner.close()


def long_case():
  """Each length in a fresh process (peak RSS is per process); passes their lines on."""
  import json
  import subprocess
  import sys
  rows = []
  for L in map(int, F.long_lens):
    cmd = [sys.executable, "-m", "experiments.benchmarks.learner", f"--long_one={L}",
           f"--long_run={F.long_run}"]
    if F.attention:
      cmd.append(f"--attention={F.attention}")
    print(f"[learner bench] long row of {L} tokens ...", file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if '"kind": "long"' in ln]
    if r.returncode != 0 or not lines:
      emit("long", row_len=L, error=f"exit {r.returncode}: {r.stderr.strip()[-500:]}")
      continue
    print(lines[-1], flush=True)
    rows.append(json.loads(lines[-1]))
  for a, b in zip(rows, rows[1:]):
    growth = dict(temp_ratio=round(b["temp_mib"] / a["temp_mib"], 2))
    if "peak_rss_mib" in a and "peak_rss_mib" in b:
      growth["peak_rss_ratio"] = round(b["peak_rss_mib"] / a["peak_rss_mib"], 2)
    emit("long_growth", from_len=a["row_len"], to_len=b["row_len"], **growth)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if F.long_one:
    return long_one(F.long_one)
  if F.torch_peer and F.model != "smollm2-135m-instruct":
    raise app.UsageError("the torch peer runs SmolLM2-135M only: pass --notorch_peer")
  import jax

  from fr_jax.learner import config as lcfg
  from fr_jax.learner.compile import measure_peak_flops
  from fr_jax.learner.learner import Learner
  from fr_jax.models import registry

  emit("machine", **machine())
  peaks = {d: measure_peak_flops(d) for d in ("float32", "bfloat16")}
  torch_peak = torch_matmul_peak() if F.torch_peer else None
  emit("matmul_peak", n=2048, float32_gflops=round(peaks["float32"] / 1e9, 1),
       bf16_in_f32_acc_gflops=round(peaks["bfloat16"] / 1e9, 1),
       torch_float32_gflops=torch_peak and round(torch_peak / 1e9, 1))
  model = registry.load(F.model)
  emit("model", name=F.model, params=model.config.num_params)
  rng = np.random.default_rng(0)
  summary = {}
  for case in F.cases:
    if case == "long":
      long_case()
      continue
    trajs = make_trajectories(case, model.config.vocab_size, rng)
    set_behaviour_logp(trajs, model.params, model.config, CASES[case]["row_len"], rng)
    n_tok = sum(t.length - 1 for t in trajs)
    model_flops = sum(3 * model.config.flops_per_token(t.length) * (t.length - 1)
                      for t in trajs)
    times = {}
    variants = [(d, h, 0) for d in F.dtypes for h in F.heads]
    variants += [("float32", F.heads[0], int(r)) for r in F.lora_ranks]
    for dtype, head, rank in variants:
      c = lcfg.default_config()
      c.model.lora.rank, c.model.lora.alpha = rank, 2.0 * rank
      if head == "full":
        c.packing.head_buckets = ()
      c.batch_size, c.minibatches = len(trajs) // F.minibatches, F.minibatches
      c.model.compute_dtype = dtype
      c.packing.row_len = CASES[case]["row_len"]
      c.packing.row_buckets = CASES[case]["buckets"]
      c.log.peak_flops = peaks[dtype]
      if F.attention:
        c.model.attention = F.attention
      learner = Learner(c, model=model)
      ms = []

      def update(ms=ms, learner=learner, trajs=trajs):
        ms.append(learner.update(trajs, log_ids=False))

      med, ts = timed(update, F.repeats)
      m = ms[-1]
      times[(dtype, head, rank) if rank else (dtype, head)] = med
      emit("update", case=case, impl=f"fr_jax+lora{rank}" if rank else "fr_jax", compute=dtype,
           head=head,
           trajectories=len(trajs),
           minibatches=F.minibatches,
           tokens=n_tok, buffer_tokens=int(round(n_tok / m["packing_efficiency"])),
           micro_batches=m["micro_batches"], median_s=round(med, 3),
           all_s=[round(t, 3) for t in ts], tokens_per_s=round(n_tok / med, 1),
           model_gflops=round(model_flops / 1e9, 1),
           mfu_model=round(model_flops / med / peaks[dtype], 3),
           xla_gflops=round(m["flops"] / 1e9, 1),
           mfu_xla=round(m["flops"] / med / peaks[dtype], 3),
           acceptance_rate=m["acceptance_rate"], loss=m["loss"], compiles=learner.compile_count)
      learner.close()
      learner = ms = None  # drop buffers before the next compile
      gc.collect()
      jax.clear_caches()
    for dtype in F.dtypes:
      if {"full", "actions"} <= set(F.heads):
        summary[f"{case}_{dtype}_full_head_over_action_head"] = round(
            times[dtype, "full"] / times[dtype, "actions"], 2)
    if F.torch_peer:
      med, ts, padded, tv, trv = torch_peer(trajs, model.config, F.repeats, 3e-3)
      emit("update", case=case, impl="torch+transformers", compute="float32",
           trajectories=len(trajs), tokens=n_tok, padded_tokens=padded, median_s=round(med, 3),
           all_s=[round(t, 3) for t in ts], tokens_per_s=round(n_tok / med, 1),
           model_gflops=round(model_flops / 1e9, 1),
           mfu_model=round(model_flops / med / peaks["float32"], 3),
           mfu_torch_peak=round(model_flops / med / torch_peak, 3), torch=tv, transformers=trv)
      for dtype in F.dtypes:
        t = times[dtype, F.heads[0]]
        summary[f"{case}_{dtype}_speedup_vs_torch_f32"] = round(med / t, 2)
      for r in map(int, F.lora_ranks):
        lmed, lts, _, _, _ = torch_peer(trajs, model.config, F.repeats, 3e-3, lora_rank=r)
        emit("update", case=case, impl=f"torch+transformers+peft_lora{r}", compute="float32",
             trajectories=len(trajs), tokens=n_tok, median_s=round(lmed, 3),
             all_s=[round(t, 3) for t in lts], tokens_per_s=round(n_tok / lmed, 1))
        summary[f"{case}_lora{r}_speedup_vs_peft"] = round(
            lmed / times["float32", F.heads[0], r], 2)
        summary[f"{case}_peft_lora{r}_over_torch_full"] = round(lmed / med, 2)
    for r in map(int, F.lora_ranks):
      if ("float32", F.heads[0]) in times:
        summary[f"{case}_lora{r}_over_full_fr_jax"] = round(
            times["float32", F.heads[0], r] / times["float32", F.heads[0]], 2)
    if ("float32", F.heads[0]) in times:
      summary[f"{case}_float32_mfu"] = round(
          model_flops / times["float32", F.heads[0]] / peaks["float32"], 3)
  summary["matmul_peak_ratio_xla_over_torch_f32"] = torch_peak and round(
      peaks["float32"] / torch_peak, 2)
  summary["target"] = ("fixed f32 >= 1.2x the peer; fixed f32 MFU >= 0.55 of XLA's measured "
                       "f32 peak; ragged f32 >= 2.5x")
  emit("summary", **summary)


if __name__ == "__main__":
  app.run(main)
