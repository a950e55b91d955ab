r"""The engine-learner mismatch against a real engine: vLLM samples, the JAX learner scores.

  make vllm-tools
  .venv/bin/python -m experiments.benchmarks.vllm_mismatch            # SmolLM2, f32 and bf16
  .venv/bin/python -m experiments.benchmarks.vllm_mismatch --dtypes=bfloat16 --n=64

At lag 0 the learner's weights are the engine's, so every difference between the engine's
stored behaviour log-prob of a sampled token and the learner's teacher-forced log-prob of it
is numerics: kernels, reduction order, dtype. The paper's point is that the objective must
use the engine's stored log-probs (the distribution that really sampled) and gate on their
distance from the learner's; this measures that distance for a real engine. For each serving
dtype, one vLLM server (launch/vllm_server.py) samples `--n` completions of the arithmetic
task's prompts at the demo's temperature, and the learner (float32, as `make demo` trains)
scores them with `fr_jax.models.scoring` and the objective's own gate
(`objective.flash_reinforce_loss`: per-token Bernoulli KL d, D_i, admitted at delta).

One JSON line per dtype (the machine, per-token |delta logp| median / p99 / max, D_i median /
max, trajectories the gate rejects at the demo's delta), then a markdown table. About 3
minutes on 2 cores (two server starts, 64 completions each).
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.benchmarks.common import machine
from fr_jax import objective
from fr_jax.models import decoder, scoring
from fr_jax.rollout.engine import Request

flags.DEFINE_string("model", "smollm2-135m-instruct", "registry model")
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "the server's dtypes")
flags.DEFINE_integer("n", 64, "completions per dtype")
flags.DEFINE_integer("max_new_tokens", 64, "tokens per completion")
flags.DEFINE_float("temperature", 1.0, "sampling temperature (the demo's)")
flags.DEFINE_float("delta", objective.DELTA, "the trust bound on D_i (the demo's)")
flags.DEFINE_integer("port", 31800, "the server's port")
flags.DEFINE_string("work_dir", "runs/vllm_mismatch", "the model's HF export and the servers' "
                    "logs")
FLAGS = flags.FLAGS


@functools.partial(jax.jit, static_argnums=(1, 4))
def _score(params, cfg, seq_1xL, targets_1xL, temperature):
  pos = jnp.arange(seq_1xL.shape[1])[None]
  h, _ = decoder.forward(params, cfg, seq_1xL, pos)
  return scoring.score_hidden(params, cfg, h, targets_1xL, temperature)[0]


def learner_logp(params, cfg, prompt, tokens, temperature: float, pad_to: int = 64):
  """The learner's teacher-forced log-probs of `tokens` after `prompt` under
  softmax(logits / temperature): float32 [len(tokens)]. The sequence is padded at the end to
  a multiple of `pad_to` so that few shapes compile (causal: padding changes nothing)."""
  seq = list(prompt) + list(tokens)
  n = -(-len(seq) // pad_to) * pad_to
  padded = jnp.asarray([seq + [0] * (n - len(seq))])
  targets = jnp.asarray([seq[1:] + [0] * (n - len(seq) + 1)])
  lp = np.asarray(_score(params, cfg, padded, targets, float(temperature))[0])
  p = len(prompt)
  return lp[p - 1:len(seq) - 1]


def mismatch(completions, behaviour_of, learner_of, delta: float) -> dict:
  """Per-token |stored - learner| log-prob and the objective's D_i and verdict at `delta`.
  `behaviour_of(c)` and `learner_of(c)` give float [len(c.token_ids)] each."""
  rows = [(np.asarray(behaviour_of(c), np.float32), np.asarray(learner_of(c), np.float32))
          for c in completions if c.token_ids]
  t = max(len(b) for b, _ in rows)
  beh = np.zeros((len(rows), t), np.float32)
  lrn = np.zeros((len(rows), t), np.float32)
  mask = np.zeros((len(rows), t), bool)
  for i, (b, lp) in enumerate(rows):
    beh[i, :len(b)], lrn[i, :len(b)], mask[i, :len(b)] = b, lp, True
  _, aux = objective.flash_reinforce_loss(jnp.asarray(lrn), jnp.asarray(beh),
                                          jnp.zeros(len(rows)), jnp.asarray(mask), delta=delta)
  diff = np.abs(beh - lrn)[mask]
  seq_kl = np.asarray(aux["seq_kl"])
  return {"trajectories": len(rows), "tokens": int(mask.sum()),
          "dlogp_median": float(np.median(diff)), "dlogp_p99": float(np.quantile(diff, 0.99)),
          "dlogp_max": float(diff.max()), "D_median": float(np.median(seq_kl)),
          "D_max": float(seq_kl.max()), "delta": delta,
          "rejected": int((~np.asarray(aux["admitted"])).sum())}


def _prompts(tokenizer, n: int) -> list[list[int]]:
  """The demo task's training prompts, rendered as the agent renders them (the model's chat
  template, the system prompt, then the assistant header)."""
  from fr_jax import envs
  from fr_jax.envs.base import prompt_dataset
  from fr_jax.rollout.agent import prompt_ids
  env = envs.make("arithmetic")
  out = []
  for task in prompt_dataset(env, "train", seed=0):
    system = [{"role": "system", "content": env.system_prompt}] if env.system_prompt else []
    out.append(prompt_ids(tokenizer, [*system, {"role": "user", "content": task.prompt}]))
    if len(out) == n:
      break
  return out


def run(argv):
  del argv
  from fr_jax.models import registry
  from fr_jax.rollout.vllm import VLLMEngine
  from launch import vllm_server
  model = registry.load(FLAGS.model)
  prompts = _prompts(model.tokenizer, FLAGS.n)
  stop = tuple(model.tokenizer.stop_ids())
  lines = []
  tmp = FLAGS.work_dir
  os.makedirs(tmp, exist_ok=True)
  model_dir = vllm_server.export_model(FLAGS.model, tmp)
  for dtype in FLAGS.dtypes:
    log = os.path.join(tmp, f"server-{dtype}.log")
    proc = vllm_server.start(model_dir, port=FLAGS.port, api_key="mismatch", dtype=dtype,
                             log=log)
    url = vllm_server.url_of("127.0.0.1", FLAGS.port)
    try:
      ready_s = vllm_server.wait_ready(proc, url, log=log)
      engine = VLLMEngine(url, api_key="mismatch")
      reqs = [Request(f"m{i}", p, max_new_tokens=FLAGS.max_new_tokens,
                      temperature=FLAGS.temperature, seed=i, stop_token_ids=stop)
              for i, p in enumerate(prompts)]
      comps = engine.generate(reqs)
      engine.close()
    finally:
      vllm_server.stop(proc)
    by_id = {r.request_id: r for r in reqs}
    stats = mismatch(
        comps, lambda c: c.logprobs,
        lambda c, by_id=by_id: learner_logp(model.params, model.config,
                                            by_id[c.request_id].prompt_ids,
                                            c.token_ids, FLAGS.temperature), FLAGS.delta)
    line = {"bench": "vllm_mismatch", "machine": machine(), "model": FLAGS.model,
            "server_dtype": dtype, "learner_dtype": model.config.param_dtype,
            "temperature": FLAGS.temperature, "server_ready_s": round(ready_s, 1), **stats}
    print(json.dumps(line), flush=True)
    lines.append(line)
  print("\n| server dtype | tokens | abs dlogp median | p99 | max | D_i median | D_i max | "
        "rejected at delta |\n|---|---|---|---|---|---|---|---|")
  for x in lines:
    print(f"| {x['server_dtype']} | {x['tokens']} | {x['dlogp_median']:.2e} | "
          f"{x['dlogp_p99']:.2e} | {x['dlogp_max']:.2e} | {x['D_median']:.2e} | "
          f"{x['D_max']:.2e} | {x['rejected']} of {x['trajectories']} "
          f"(delta {x['delta']:g}) |")


if __name__ == "__main__":
  app.run(run)
