r"""LoRA for the engines: fold the adapters into the weights once per published version
("merged", what the embedded engine does: `decoder.decode_layout` calls `lora.merged`), or
apply them on the fly at every decode step. JSON lines: the merge's time per version (beyond
the decode layout's copy, which every version pays), and the
decode step's time for a batch of B rows, merged (the engine's fused layout), merged without
the fusion, and on the fly (x W + s (x A) B per projection, the unfused layout), medians of
interleaved rounds.

  python -m experiments.benchmarks.lora                      # SmolLM2-135M, rank 16, B 32
  python -m experiments.benchmarks.lora --model=tiny-chat --rank=4 --repeats=5

The model's weights are random (`random:NAME` shapes; speed does not depend on their values).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments.benchmarks.common import emitter, machine

flags.DEFINE_string("model", "random:smollm2-135m", "a registry name")
flags.DEFINE_integer("rank", 16, "LoRA rank")
flags.DEFINE_string("targets", "wq,wk,wv,wo,w_gate,w_up,w_down", "adapted projections")
flags.DEFINE_integer("batch", 32, "decode rows (the demo's slots)")
flags.DEFINE_integer("context", 256, "KV-cache positions per row (the demo's 256)")
flags.DEFINE_integer("steps", 16, "decode steps per timed call")
flags.DEFINE_integer("repeats", 7, "interleaved rounds")
FLAGS = flags.FLAGS


def layouts(params, cfg):
  """{name: per-layer decode params}: the engine's merged+fused layout, merged unfused, and
  the adapters kept and applied on the fly (unfused: a fused matrix has no per-projection
  adapter)."""
  from fr_jax.models import decoder, lora

  def unfused(p):
    out = {k: v for k, v in p.items() if k not in decoder.STACKS}
    out["layer_list"] = tuple(jax.tree.map(lambda a, i=i: a[i], p["layers"])
                              for i in range(cfg.num_layers))
    return out

  return {"merged_fused": decoder.decode_layout(params, cfg),
          "merged_unfused": unfused(lora.merged(params, cfg)),
          "on_the_fly": unfused(params)}


def main(argv):
  del argv
  from fr_jax.models import decoder, lora, registry
  emit = emitter("lora")
  m = registry.load(FLAGS.model)
  cfg = m.config.replace(lora_rank=FLAGS.rank, lora_alpha=2.0 * FLAGS.rank,
                         lora_targets=FLAGS.targets)
  params = lora.init_adapters(jax.tree.map(jnp.asarray, m.params), cfg, jax.random.key(0))
  trainable, _ = lora.split(params)  # B = 0 would let XLA prove nothing; make it non-zero
  trainable = jax.tree.map(lambda a: a + 1e-3, trainable)
  params = lora.join(trainable, lora.split(params)[1])
  emit("setup", model=FLAGS.model, rank=FLAGS.rank, targets=list(cfg.lora_targets),
       adapter_params=lora.count(params), base_params=cfg.num_params, batch=FLAGS.batch,
       context=FLAGS.context, steps=FLAGS.steps, machine=machine())

  # Every version's weights go through decode_layout (the fusion copies them), adapters or
  # not: the merge's own cost is the difference.
  merge = jax.jit(lambda p: decoder.decode_layout(p, cfg))
  layout = jax.jit(lambda p: decoder.decode_layout(p, cfg))
  plain = lora.split(params)[1]
  jax.block_until_ready(merge(params))
  jax.block_until_ready(layout(plain))
  B, S = FLAGS.batch, FLAGS.context

  @jax.jit
  def decode(p, cache, tok, pos):
    def body(carry, _):
      cache, tok, pos = carry
      h, cache = decoder.forward(p, cfg, tok, pos, cache=cache)
      logits = decoder.logits_from_hidden(p, cfg, h[:, -1])
      return (cache, jnp.argmax(logits, -1)[:, None].astype(jnp.int32), pos + 1), None
    (cache, tok, pos), _ = jax.lax.scan(body, (cache, tok, pos), None, length=FLAGS.steps)
    return tok

  tok = jnp.zeros((B, 1), jnp.int32)
  pos = jnp.full((B, 1), S // 2, jnp.int32)
  cache = decoder.init_cache(cfg, B, S)
  ways = layouts(params, cfg)
  for p in ways.values():
    jax.block_until_ready(decode(p, cache, tok, pos))
  times = {k: [] for k in ["merge", "layout", *ways]}
  for _ in range(FLAGS.repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(merge(params))
    times["merge"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    jax.block_until_ready(layout(plain))
    times["layout"].append(time.perf_counter() - t0)
    for name, p in ways.items():
      t0 = time.perf_counter()
      jax.block_until_ready(decode(p, cache, tok, pos))
      times[name].append((time.perf_counter() - t0) / FLAGS.steps)
  med = {k: statistics.median(v) for k, v in times.items()}
  emit("per_version", merge_and_layout_ms=round(1e3 * med["merge"], 2),
       layout_without_adapters_ms=round(1e3 * med["layout"], 2),
       all_ms=[round(1e3 * t, 2) for t in times["merge"]])
  extra = max(med["merge"] - med["layout"], 0.0)
  for name in ways:
    emit("decode_step", layout=name, median_ms=round(1e3 * med[name], 3),
         vs_merged_fused=round(med[name] / med["merged_fused"], 3),
         all_ms=[round(1e3 * t, 3) for t in times[name]])
  over = med["on_the_fly"] - med["merged_fused"]
  emit("summary", merge_extra_ms_per_version=round(1e3 * extra, 2),
       on_the_fly_step_overhead_ms=round(1e3 * over, 3),
       on_the_fly_step_ratio=round(med["on_the_fly"] / med["merged_fused"], 3),
       merge_pays_back_after_steps=round(extra / over, 1) if over > 0 else 0.0)


if __name__ == "__main__":
  app.run(main)
