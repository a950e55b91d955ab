"""AdamW with global-norm clipping and a warm-up + cosine schedule to a minimum ratio."""

from __future__ import annotations

import jax
import optax

# Weight decay applies to matrices (embeddings, projections, an MoE model's routers and
# experts), not to norms or biases.
_DECAYED = {"embed", "lm_head", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "router",
            "experts_gate", "experts_up", "experts_down"}


def schedule(ocfg) -> optax.Schedule:
  """Linear warm-up over warmup_frac of total_steps, then cosine to lr * min_lr_ratio."""
  total = int(ocfg.total_steps)
  warmup = int(round(ocfg.warmup_frac * total))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0 if warmup else ocfg.lr, peak_value=ocfg.lr, warmup_steps=warmup,
      decay_steps=max(total, warmup + 1), end_value=ocfg.lr * ocfg.min_lr_ratio)


def decay_mask(params):
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", None) in _DECAYED, params)


def make_optimizer(ocfg) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(ocfg.clip_norm),
      optax.adamw(schedule(ocfg), b1=ocfg.b1, b2=ocfg.b2, eps=ocfg.eps,
                  weight_decay=ocfg.weight_decay, mask=decay_mask),
  )
