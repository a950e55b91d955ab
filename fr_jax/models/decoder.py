"""One decoder for the Llama, Qwen2, Qwen3-dense and Qwen3-MoE families.

RMSNorm, RoPE (with optional Llama-3 scaling), grouped-query attention, SwiGLU MLP, tied or
untied embeddings; Qwen2 adds q/k/v biases, Qwen3 adds per-head RMSNorm on q and k. Qwen3-MoE
replaces the MLP of its sparse layers (`ModelConfig.moe_layers`) by a mixture of experts
(`fr_jax.models.moe`). The learner's scoring is `fr_jax.models.scoring`.

The math is a set of pure functions over a nested dict of arrays (`params`), so hot paths
jit them directly; `Decoder` is the Flax NNX module that owns those arrays (split/merge at
the edges). Layer weights are stacked on a leading axis and applied with `lax.scan`, so a
30-layer model compiles one layer body.

Forward modes (all the same `forward`):
* packed: tokens [R, L], positions [R, L], segment_ids [R, L]; attention is causal within a
  segment and blocked across segments (segment 0 is padding); `ModelConfig.attention` picks
  the path (`fr_jax.models.attention`: by default a flash kernel, O(L) memory, for rows
  longer than one block, or for every row on a GPU);
* cached: tokens [B, T] at positions [B, T] (contiguous per row) written into a preallocated
  KV cache, attending to cache entries at positions <= the query's. Prefill is T = prompt
  length, decode is T = 1.

Mixture of experts: `params["layers"]` holds every layer's attention, `params["moe"]` the sparse
layers' routers [n, D, E] and experts (`moe.moe_shapes`), `params["mlp"]` the MLPs of an MoE
model's dense layers, if any, each stacked over its own layers. Packed forwards can replay
routing (`routes`, rollout routing replay) and return what it did (`routing_out`).

Dtype policy: parameters are stored in `param_dtype`; matmul inputs are cast to
`compute_dtype` and accumulate in float32; the residual stream, norms, softmax and logits are
float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fr_jax.models import lora
from fr_jax.models.attention import attend, attend_cache, packed_visibility
from fr_jax.models.config import ModelConfig
from fr_jax.models.moe import assemble_routing, moe_block, moe_shapes, stack_layer

Params = dict[str, Any]
F32 = jnp.float32

# Per-layer parameter names -> shapes (without the leading layer axis).


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Weights every layer has (attention, norms; the MLP too in a dense model)."""
  D = cfg.hidden_size
  q, kv, hd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
  shapes = {
      "attn_norm": (D,), "wq": (D, q), "wk": (D, kv), "wv": (D, kv), "wo": (q, D),
      "mlp_norm": (D,),
  }
  if not cfg.is_moe:
    shapes.update(mlp_shapes(cfg))
  if cfg.qkv_bias:
    shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
  if cfg.o_bias:
    shapes.update(bo=(D,))
  if cfg.qk_norm:
    shapes.update(q_norm=(hd,), k_norm=(hd,))
  shapes.update(lora.adapter_shapes(cfg, shapes))
  return shapes


def mlp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """A dense layer's SwiGLU MLP (with its LoRA adapters, if any)."""
  D, F = cfg.hidden_size, cfg.intermediate_size
  shapes = {"w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}
  if cfg.mlp_bias:
    shapes.update(b_gate=(F,), b_up=(F,), b_down=(D,))
  shapes.update(lora.adapter_shapes(cfg, shapes))
  return shapes


def param_shapes(cfg: ModelConfig) -> Params:
  """The full params tree as shapes; `lm_head` only when embeddings are untied; `moe` (and
  `mlp` for its dense layers) only in an MoE model."""
  out = {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,),
         "layers": {k: (cfg.num_layers, *s) for k, s in layer_shapes(cfg).items()}}
  if cfg.is_moe:
    out["moe"] = {k: (len(cfg.moe_layers), *s) for k, s in moe_shapes(cfg).items()}
    if cfg.dense_layers:
      out["mlp"] = {k: (len(cfg.dense_layers), *s) for k, s in mlp_shapes(cfg).items()}
  if not cfg.tie_embeddings:
    out["lm_head"] = (cfg.vocab_size, cfg.hidden_size)
  return out


STACKS = ("layers", "moe", "mlp")  # subtrees whose leaves carry a leading stacked-layer axis


def init_params(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> Params:
  """Random params in `cfg.param_dtype`: normal(0, std) matrices, ones for norms, zeros for
  biases; LoRA adapters as `lora.init_leaf` draws them (B = 0, float32)."""
  dtype = jnp.dtype(cfg.param_dtype)
  flat, tree = jax.tree.flatten_with_path(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(key, len(flat))
  leaves = []
  for (path, shape), k in zip(flat, keys):
    name = path[-1].key
    if lora.is_adapter(name):
      leaves.append(lora.init_leaf(name, shape, k))
    elif name.endswith("norm"):
      leaves.append(jnp.ones(shape, dtype))
    elif name.startswith("b"):  # biases
      leaves.append(jnp.zeros(shape, dtype))
    else:
      leaves.append((std * jax.random.normal(k, shape, F32)).astype(dtype))
  return jax.tree.unflatten(tree, leaves)


# --- building blocks -----------------------------------------------------------------------

def rms_norm(x, scale, eps):
  x = x.astype(F32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return x * scale.astype(F32)


def dense(x, w, b=None, cd=F32):
  y = jnp.einsum("...i,io->...o", x.astype(cd), w.astype(cd), preferred_element_type=F32)
  return y if b is None else y + b.astype(F32)


def project(cfg: ModelConfig, x, lp, w: str, b: str | None, cd):
  """x times the layer's projection `w` (plus its bias `b`, and its LoRA adapter: scale x A B,
  when the layer has one)."""
  y = dense(x, lp[w], lp.get(b), cd)
  if w + "_lora_a" in lp:
    y = y + cfg.lora_scale * dense(dense(x, lp[w + "_lora_a"], cd=cd), lp[w + "_lora_b"], cd=cd)
  return y


def decode_layout(params: Params, cfg: ModelConfig) -> Params:
  """The same weights with the layer stack split into a tuple of per-layer dicts, and each
  layer's q/k/v and gate/up projections fused into one matrix each (`wqkv`, `w_gate_up`).
  An MoE model's sparse layers take their router and experts from `moe`, its dense ones
  their MLP from `mlp`.

  `forward` then runs the layers as an unrolled loop over separate buffers. For decoding a
  few tokens this matters: a scan over stacked weights copies each layer's slice out of the
  stack on every step, doubling the weight traffic that bounds decode speed; and five
  matmuls per layer instead of seven cut the per-step op count. LoRA adapters are folded
  into their projections (`lora.merged`).
  """
  out = {k: v for k, v in params.items() if k not in STACKS}
  params = lora.merged(params, cfg)  # adapters folded in once: decoding pays nothing for them
  layers = []
  for i, (stack, j) in enumerate(_feed_forward_source(cfg)):
    lp = jax.tree.map(lambda a, i=i: a[i], params["layers"])
    if stack != "layers":
      lp.update(jax.tree.map(lambda a, j=j: a[j], params[stack]))
    layers.append(_fuse_projections(lp))
  out["layer_list"] = tuple(layers)
  return out


def _feed_forward_source(cfg: ModelConfig) -> list[tuple[str, int]]:
  """For each layer, where its feed-forward weights live: ("layers", i) in a dense model,
  ("moe", j) for the j-th sparse layer, ("mlp", j) for the j-th dense layer of an MoE model."""
  if not cfg.is_moe:
    return [("layers", i) for i in range(cfg.num_layers)]
  moe, mlp = cfg.moe_layers, cfg.dense_layers
  return [("moe", moe.index(i)) if i in moe else ("mlp", mlp.index(i))
          for i in range(cfg.num_layers)]


def _fuse_projections(lp: dict) -> dict:
  lp = dict(lp)
  for fused, parts, biases in (("wqkv", ("wq", "wk", "wv"), ("bq", "bk", "bv")),
                               ("w_gate_up", ("w_gate", "w_up"), ("b_gate", "b_up"))):
    if parts[0] not in lp:  # a sparse layer: its experts stay as they are
      continue
    lp[fused] = jnp.concatenate([lp.pop(k) for k in parts], axis=-1)
    if biases[0] in lp:
      lp["b" + fused[1:]] = jnp.concatenate([lp.pop(k) for k in biases])
  return lp


def rope_tables(cfg: ModelConfig, positions):
  """cos, sin [..., head_dim] for integer positions [...] (HF rotate-half layout)."""
  inv_freq = jnp.asarray(cfg.inv_freq(), F32)
  angles = positions.astype(F32)[..., None] * inv_freq
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
  """x [B, L, heads, hd]; cos/sin [B, L, hd]."""
  h = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)
  return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def _write_cache(cache, new, start, keys: bool):
  """One layer's cache <- new [B, T, KVH, hd] at positions start[b] + t: keys into
  [B, KVH, hd, S], values into [B, KVH, S, hd]. A scatter into the buffer, updated in place:
  only the new entries move. Entries past the cache's end are dropped (the engine aims idle
  rows and bucket padding there)."""
  B, T = new.shape[:2]
  rows = jnp.arange(B)[:, None]
  cols = start[:, None] + jnp.arange(T)[None, :]
  at = cache.at[rows, :, :, cols] if keys else cache.at[rows, :, cols]
  return at.set(new.astype(cache.dtype), mode="drop")


def _attention(cfg: ModelConfig, h, lp, cos, sin, vis, cache_kv, cache_start, window):
  """A layer's attention block with its residual. Packed mode: `vis` is the rows'
  Visibility and cache_kv None. Cached mode: `vis` is the queries' positions [B, T] and
  cache_kv this layer's (k, v) buffers."""
  cd = jnp.dtype(cfg.compute_dtype)
  B, L, _ = h.shape
  H, KVH, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  x = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
  if "wqkv" in lp:  # decode layout: one fused projection
    q, k, v = jnp.split(dense(x, lp["wqkv"], lp.get("bqkv"), cd), [H * hd, (H + KVH) * hd], -1)
  else:
    q, k, v = (project(cfg, x, lp, w, b, cd) for w, b in (("wq", "bq"), ("wk", "bk"),
                                                           ("wv", "bv")))
  q, k, v = q.reshape(B, L, H, hd), k.reshape(B, L, KVH, hd), v.reshape(B, L, KVH, hd)
  if cfg.qk_norm:
    q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
  q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
  if cache_kv is not None:
    cache_kv = (_write_cache(cache_kv[0], k, cache_start, keys=True),
                _write_cache(cache_kv[1], v, cache_start, keys=False))
    a = attend_cache(q, *cache_kv, vis, cd, cfg.attention, window)
  else:
    a = attend(q, k, v, vis, cd, cfg.attention)
  a = a.reshape(B, L, H * hd)
  return h + project(cfg, a, lp, "wo", "bo", cd), cache_kv


def _mlp(cfg: ModelConfig, x, lp):
  cd = jnp.dtype(cfg.compute_dtype)
  if "w_gate_up" in lp:
    g, u = jnp.split(dense(x, lp["w_gate_up"], lp.get("b_gate_up"), cd), 2, -1)
  else:
    g = project(cfg, x, lp, "w_gate", "b_gate", cd)
    u = project(cfg, x, lp, "w_up", "b_up", cd)
  return project(cfg, jax.nn.silu(g) * u, lp, "w_down", "b_down", cd)


def _layer(cfg: ModelConfig, h, lp, cos, sin, vis, cache_kv, cache_start, window=None,
           routes=None, valid=None):
  """One decoder layer: (h, cache_kv, LayerRouting or None for a dense layer)."""
  h, cache_kv = _attention(cfg, h, lp, cos, sin, vis, cache_kv, cache_start, window)
  x = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
  if "router" in lp:
    y, r = moe_block(cfg, x, lp, routes, valid)
  else:
    y, r = _mlp(cfg, x, lp), None
  return h + y, cache_kv, r


def forward(params: Params, cfg: ModelConfig, tokens, positions, segment_ids=None, *,
            cache: dict | None = None, remat: bool = False, window: int | None = None,
            routes=None, routing_out: bool = False):
  """Final hidden states [B, L, D] (f32, after the final norm) and the updated cache, and
  with `routing_out` the `Routing` as a third value.

  Packed mode: pass `segment_ids` (and no cache). Cached mode: pass `cache` from
  `init_cache`; positions must be contiguous within each row. `window` (static, cached mode
  only): the queries see only cache slots below it, so attention reads `window` slots, not
  the whole cache (every position must be < window). `routes` (packed mode, MoE models):
  int [B, L, sparse layers, k], the experts to use (rollout routing replay).
  """
  tokens = jnp.asarray(tokens)
  positions = jnp.asarray(positions)
  h = params["embed"][tokens].astype(F32)
  cos, sin = rope_tables(cfg, positions)
  per = []
  if cache is not None:
    if routes is not None:
      raise ValueError("routing replay is for packed (learner) forwards, not cached decoding")
    # Per-layer cache buffers, so the layers run unrolled (the decode layout).
    if "layer_list" not in params:
      params = decode_layout(params, cfg)
    ks, vs = list(cache["k"]), list(cache["v"])
    start = positions[:, 0]
    for i, lp in enumerate(params["layer_list"]):
      h, (ks[i], vs[i]), r = _layer(cfg, h, lp, cos, sin, positions, (ks[i], vs[i]), start,
                                    window)
      if r is not None:
        per.append(stack_layer(r))
    cache = {"k": tuple(ks), "v": tuple(vs)}
  else:
    seg = jnp.ones_like(tokens) if segment_ids is None else jnp.asarray(segment_ids)
    vis = packed_visibility(seg)
    valid = seg > 0
    if routes is not None:
      if not cfg.is_moe:
        raise ValueError("routes were given to a dense model")
      routes = jnp.moveaxis(jnp.asarray(routes), 2, 0)  # [sparse layers, B, L, k]

    def body(h, xs):
      lp, rt = xs
      h, _, r = _layer(cfg, h, lp, cos, sin, vis, None, None, routes=rt, valid=valid)
      return h, r

    if remat:
      body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    if "layer_list" in params:  # decode layout: unrolled over separate per-layer buffers
      j = 0
      for lp in params["layer_list"]:
        rt = None
        if routes is not None and "router" in lp:
          rt, j = routes[j], j + 1
        h, r = body(h, (lp, rt))
        if r is not None:
          per.append(stack_layer(r))
    else:
      for stack, (a, b), (c, d) in _runs(cfg):
        lp = _slice(params["layers"], a, b, cfg.num_layers)
        if stack != "layers":
          lp = {**lp, **_slice(params[stack], c, d, jax.tree.leaves(params[stack])[0].shape[0])}
        rt = routes[c:d] if stack == "moe" and routes is not None else None
        h, r = jax.lax.scan(body, h, (lp, rt))
        if r is not None:
          per.append(r)
  h = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
  return (h, cache, assemble_routing(cfg, per, tokens.shape)) if routing_out else (h, cache)


def _slice(tree, a, b, n):
  return tree if (a, b) == (0, n) else jax.tree.map(lambda x: x[a:b], tree)


def _runs(cfg: ModelConfig):
  """Maximal runs of consecutive layers whose feed-forward weights live in the same stack:
  [(stack, (first layer, end), (first stack index, end))]. One run for a dense model and for
  an all-sparse MoE model (Qwen3-MoE's releases), so the forward is one scan."""
  runs = []
  for i, (stack, j) in enumerate(_feed_forward_source(cfg)):
    if runs and runs[-1][0] == stack:
      runs[-1][1][1], runs[-1][2][1] = i + 1, j + 1
    else:
      runs.append([stack, [i, i + 1], [j, j + 1]])
  return [(s, tuple(x), tuple(y)) for s, x, y in runs]


def unembed(params: Params) -> jax.Array:
  return params["embed"] if "lm_head" not in params else params["lm_head"]


def logits_from_hidden(params: Params, cfg: ModelConfig, hidden):
  """[..., D] -> [..., V] float32 logits."""
  cd = jnp.dtype(cfg.compute_dtype)
  return jnp.einsum("...d,vd->...v", hidden.astype(cd), unembed(params).astype(cd),
                    preferred_element_type=F32)


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> dict:
  """A zeroed KV cache {k, v}, each a tuple of one buffer per layer: keys
  [batch, kv_heads, head_dim, length] and values [batch, kv_heads, length, head_dim]. A
  layer's attention reads its own buffers in the layouts its two matmuls want (q.K and p.V
  with no transposes), with no slicing out of a layer stack."""
  dtype = jnp.dtype(dtype or cfg.compute_dtype)
  B, H, hd = batch, cfg.num_kv_heads, cfg.head_dim
  return {"k": tuple(jnp.zeros((B, H, hd, length), dtype) for _ in range(cfg.num_layers)),
          "v": tuple(jnp.zeros((B, H, length, hd), dtype) for _ in range(cfg.num_layers))}


# --- the NNX module ----------------------------------------------------------------------------

class Layers(nnx.Module):
  """Stacked per-layer weights, each with a leading layer axis (all layers, or an MoE
  model's sparse or dense ones)."""

  def __init__(self, arrays: dict[str, jax.Array]):
    for name, a in arrays.items():
      setattr(self, name, nnx.Param(a))


class Decoder(nnx.Module):
  """Flax NNX decoder. `params()` gives the pure tree the jitted functions take."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None,
               params: Params | None = None):
    self.config = cfg
    if params is None:
      rngs = rngs or nnx.Rngs(0)
      params = init_params(cfg, rngs.params())
    self.embed = nnx.Param(params["embed"])
    self.final_norm = nnx.Param(params["final_norm"])
    self.layers = Layers(params["layers"])
    for stack in ("moe", "mlp"):  # an MoE model's sparse layers, and its dense ones if any
      if stack in params:
        setattr(self, stack, Layers(params[stack]))
    if "lm_head" in params:
      self.lm_head = nnx.Param(params["lm_head"])

  def params(self) -> Params:
    return nnx.to_pure_dict(nnx.state(self, nnx.Param))

  def __call__(self, tokens, positions=None, segment_ids=None):
    """Logits [B, L, V] for a packed (or single-sequence-per-row) batch."""
    tokens = jnp.asarray(tokens)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
    p = self.params()
    h, _ = forward(p, self.config, tokens, positions, segment_ids)
    return logits_from_hidden(p, self.config, h)
