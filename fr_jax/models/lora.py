"""Low-rank adapters (LoRA, Hu et al. 2021) on the decoder's projections.

A targeted projection W [in, out] gains two leaves beside it in the same layer stack,
`<W>_lora_a` [in, r] and `<W>_lora_b` [r, out], and computes

    y = x W + (alpha / r) (x A) B

(`ModelConfig.lora_scale`; PEFT's layout transposed to the decoder's [in, out]). A is drawn
as PEFT draws it (Kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))) and B is
zero, so an adapted model starts as its base exactly. Adapters are stored in float32 whatever
the base's dtype (`ADAPTER_DTYPE`): a bfloat16 base with float32 adapters is the usual way to
fit a large model, and updates of lr ~ 1e-5 would round away in bfloat16.

The adapters live in the params tree itself (`layers`, and `mlp` for an MoE model's dense
layers), so the stacked scan, sharding and checkpoints carry them as they carry any weight.
Everything that trains picks them out by name (`split`); everything that only runs the
policy can fold them into the base weights once (`merged`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fr_jax.models.config import ModelConfig

Params = dict[str, Any]
SUFFIXES = ("_lora_a", "_lora_b")
ADAPTER_DTYPE = jnp.float32


def config_fields(model) -> dict:
  """The ModelConfig LoRA fields of a learner config's `model` section (a ConfigDict, or the
  dict a checkpoint's meta holds): none when its `lora.rank` is 0 or it has no `lora`."""
  lc = model.get("lora")
  if not lc or not lc["rank"]:
    return {}
  # ModelConfig parses the targets ("wq,wv" or a list) and names the bad ones.
  return dict(lora_rank=int(lc["rank"]), lora_alpha=float(lc["alpha"]),
              lora_targets=lc["targets"])


def is_adapter(name: str) -> bool:
  return name.endswith(SUFFIXES)


def adapter_shapes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]
                   ) -> dict[str, tuple[int, ...]]:
  """The adapters of one layer's weights `shapes` (name -> [in, out], no layer axis): for each
  of `cfg.lora_targets` that the layer has."""
  r, out = cfg.lora_rank, {}
  for name in cfg.lora_targets if r else ():
    if name in shapes:
      d_in, d_out = shapes[name]
      out[name + "_lora_a"], out[name + "_lora_b"] = (d_in, r), (r, d_out)
  return out


def init_leaf(name: str, shape: tuple[int, ...], key: jax.Array) -> jax.Array:
  """One adapter leaf ([..., in, r] or [..., r, out]), float32: A ~ U(-1/sqrt(in),
  1/sqrt(in)), B = 0."""
  if name.endswith("_lora_b"):
    return jnp.zeros(shape, ADAPTER_DTYPE)
  bound = shape[-2] ** -0.5
  return jax.random.uniform(key, shape, ADAPTER_DTYPE, -bound, bound)


def cast(params: Params, dtype) -> Params:
  """`params` with the base weights in `dtype` and the adapters in float32 (copies: the
  learner donates its state's buffers, which must not alias the caller's)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, a: jnp.array(a, ADAPTER_DTYPE if is_adapter(_name(path)) else dtype,
                                copy=True), params)


def has_adapters(params: Params) -> bool:
  return any(is_adapter(_name(p)) for p, _ in jax.tree_util.tree_leaves_with_path(params))


def _name(path) -> str:
  return str(getattr(path[-1], "key", ""))


def split(params: Params) -> tuple[Params, Params]:
  """(trainable, frozen): with adapters, the adapter leaves and the rest, each a nested dict
  of the same layout; without, the whole tree and {} (full fine-tuning)."""
  if not has_adapters(params):
    return params, {}

  def part(tree, keep):
    out = {}
    for k, v in tree.items():
      if isinstance(v, dict):
        sub = part(v, keep)
        if sub:
          out[k] = sub
      elif is_adapter(k) == keep:
        out[k] = v
    return out

  return part(params, True), part(params, False)


def join(trainable: Params, frozen: Params) -> Params:
  """The inverse of `split`: one tree holding both."""
  out = dict(frozen)
  for k, v in trainable.items():
    out[k] = join(v, out[k]) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
  return out


def merge_layer(lp: dict, cfg: ModelConfig) -> dict:
  """One layer's (or stack's) weights with each adapter folded into its projection,
  W + scale A B in float32, stored back in W's dtype; the adapter leaves dropped."""
  lp = dict(lp)
  for name in [k[: -len("_lora_a")] for k in lp if k.endswith("_lora_a")]:
    a, b, w = lp.pop(name + "_lora_a"), lp.pop(name + "_lora_b"), lp[name]
    delta = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    lp[name] = (w.astype(jnp.float32) + cfg.lora_scale * delta).astype(w.dtype)
  return lp


def merged(params: Params, cfg: ModelConfig) -> Params:
  """The plain model the adapted one computes: every adapter folded into its base weight
  (what the engines run and `--format=hf` exports). Params without adapters come back as
  they are."""
  if not has_adapters(params):
    return params
  return {k: merge_layer(v, cfg) if isinstance(v, dict) else v for k, v in params.items()}


def init_adapters(params: Params, cfg: ModelConfig, key: jax.Array) -> Params:
  """`params` (a base model's) with fresh adapters added for `cfg`'s LoRA targets (B = 0,
  float32). Adapters already present are kept (a restored run)."""
  if not cfg.lora_rank or has_adapters(params):
    return params
  adapters = {}
  for stack in ("layers", "mlp"):
    if stack not in params:
      continue
    weights = params[stack]
    shapes = adapter_shapes(cfg, {k: tuple(v.shape[1:]) for k, v in weights.items()
                                  if len(v.shape) == 3})
    n = next(iter(weights.values())).shape[0]
    keys = jax.random.split(jax.random.fold_in(key, len(adapters)), max(len(shapes), 1))
    adapters[stack] = {name: init_leaf(name, (n, *s), k)
                       for (name, s), k in zip(sorted(shapes.items()), keys)}
  return join({k: v for k, v in adapters.items() if v}, params)


def count(params: Params) -> int:
  """Trainable adapter parameters in `params`."""
  trainable, frozen = split(params)
  return sum(x.size for x in jax.tree.leaves(trainable)) if frozen else 0
