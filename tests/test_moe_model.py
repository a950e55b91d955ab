"""Qwen3-MoE against transformers' PyTorch Qwen3-MoE and against NumPy: checkpoints saved by
transformers imported (logits and routing, both expert paths), fr_jax's export exact on
re-import and loadable by transformers, the grouped paths' gradients (ragged_dot, gmm) equal
to the dense reference's, the load-balancing loss equal to transformers'
`load_balancing_loss_func` (and to a NumPy recomputation that leaves padding out), and
routing replay's gate weights."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from fr_jax.models import decoder, moe, registry
from fr_jax.models.config import ModelConfig
from fr_jax.models.gguf_io import check_gguf_exportable, load_gguf, save_gguf
from fr_jax.models.hf_io import CheckpointError, export_hf, iter_hf_tensors, load_hf, save_hf
from tests.helpers import forward

E, K = 8, 2
# Two layouts of a 4-layer model: sparse layers 0, 2, 3 (layer 1 dense, mlp_only_layers) with
# renormalised top-k weights; sparse layers 1, 3 (decoder_sparse_step 2) without.
CASES = {
    "mlp_only": dict(norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1),
    "step2": dict(norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2),
}
SPARSE = {"mlp_only": (0, 2, 3), "step2": (1, 3)}


def model_config(case, **kw) -> ModelConfig:
  """The fr_jax config of CASES[case], written out field by field (not read from HF)."""
  c = CASES[case]
  return ModelConfig(
      family="qwen3_moe", vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=4,
      num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6,
      tie_embeddings=False, qk_norm=True, max_position_embeddings=512, bos_token_id=1,
      eos_token_id=2, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=16,
      norm_topk_prob=c["norm_topk_prob"], decoder_sparse_step=c["decoder_sparse_step"],
      mlp_only_layers=tuple(c["mlp_only_layers"]), **kw)


def hf_model(case, seed=0):
  """transformers' Qwen3-MoE of CASES[case], every weight random (std 0.1, norms around 1)
  so the routing is far from uniform."""
  hc = transformers.Qwen3MoeConfig(
      vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
      num_experts=E, num_experts_per_tok=K, max_position_embeddings=512,
      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, **CASES[case])
  hc._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = transformers.Qwen3MoeForCausalLM(hc).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
  return model


def random_params(cfg, seed):
  """fr_jax params of `cfg` as NumPy, every tensor random (norms around 1)."""
  rng = np.random.default_rng(seed)
  dtype = np.dtype(jnp.dtype(cfg.param_dtype))
  return jax.tree_util.tree_map_with_path(
      lambda path, s: ((1.0 if path[-1].key.endswith("norm") else 0.0)
                       + 0.1 * rng.standard_normal(s)).astype(dtype),
      decoder.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))


def hf_run(model, tokens):
  """transformers' logits [B, T, V] and, per sparse layer, its router's logits and top-k
  experts ([B*T, E], [B*T, k]), caught by hooks on the routers."""
  caught = []
  hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: caught.append(o))
           for layer in model.model.layers if hasattr(layer.mlp, "gate")
           and hasattr(layer.mlp, "experts")]
  try:
    with torch.no_grad():
      logits = model(torch.as_tensor(np.asarray(tokens))).logits.numpy()
  finally:
    for h in hooks:
      h.remove()
  return logits, [(o[0], o[2].numpy()) for o in caught]


@functools.partial(jax.jit, static_argnames="cfg")
def _forward(params, cfg, tokens, segment_ids, routes):
  pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  h, _, routing = forward(params, cfg, tokens, pos, segment_ids, routes=routes,
                                  routing_out=True)
  return decoder.logits_from_hidden(params, cfg, h), routing


def ours(params, cfg, tokens, segment_ids=None, routes=None):
  """(logits [B, T, V], Routing) of fr_jax's packed forward (compiled once per config, so
  the tests share compilations)."""
  tokens = np.asarray(tokens)
  seg = np.ones(tokens.shape, np.int32) if segment_ids is None else segment_ids
  logits, routing = _forward(params, cfg, tokens, seg, routes)
  return np.asarray(logits), routing


def leaves(tree):
  return {jax.tree_util.keystr(p): np.asarray(a) for p, a in jax.tree_util.tree_leaves_with_path(
      tree)}


TOKENS = np.random.default_rng(0).integers(0, 96, (2, 12))


@pytest.fixture(scope="module", params=sorted(CASES))
def saved(request, tmp_path_factory):
  """(case, transformers model, its save_pretrained directory)."""
  case = request.param
  model = hf_model(case)
  path = tmp_path_factory.mktemp(case)
  model.save_pretrained(path)
  return case, model, path


# --- checkpoints written by transformers ---------------------------------------------------------

def test_save_pretrained_writes_per_expert_tensors(saved):
  """transformers 5 fuses the experts in memory but writes the released per-expert names."""
  case, _, path = saved
  names = set(load_file(path / "model.safetensors"))
  i = SPARSE[case][0]
  assert {f"model.layers.{i}.mlp.experts.{e}.{w}_proj.weight" for e in range(E)
          for w in ("gate", "up", "down")} <= names
  assert f"model.layers.{i}.mlp.gate.weight" in names
  assert not any("gate_up_proj" in n for n in names)


@pytest.mark.parametrize("impl", ["dense", "ragged"])
def test_transformers_checkpoint_logits_and_routing(saved, impl):
  case, model, path = saved
  m = registry.load(f"hf:{path}")
  assert m.config == model_config(case)
  assert m.config.moe_layers == SPARSE[case]
  cfg = m.config.replace(moe_impl=impl)
  want, routers = hf_run(model, TOKENS)
  got, routing = ours(m.params, cfg, TOKENS)
  diff = np.abs(got - want).max()
  print(f"\n{case} {impl}: max |logit diff| vs transformers {diff:.2e} "
        f"(max |logit| {np.abs(want).max():.2f})")
  assert np.abs(want).max() > 1.0 and diff <= 1e-4
  experts = np.asarray(routing.experts)  # [B, T, sparse layers, k]
  assert experts.shape == (*TOKENS.shape, len(SPARSE[case]), K)
  for j, (_, idx) in enumerate(routers):
    np.testing.assert_array_equal(np.sort(experts[:, :, j].reshape(-1, K), -1),
                                  np.sort(idx, -1), err_msg=f"sparse layer {j}")
  # Routing is not degenerate: every expert is somebody's choice.
  assert len(np.unique(experts)) == E


def test_fused_tensors_import(saved, tmp_path):
  """transformers 5's in-memory layout (fused gate_up_proj / down_proj) reads as the
  per-expert checkpoint does."""
  _, model, path = saved
  fused = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
  save_file(fused, tmp_path / "model.safetensors", metadata={"format": "pt"})
  (tmp_path / "config.json").write_text((path / "config.json").read_text())
  cfg_f, got = load_hf(tmp_path)
  cfg_p, want = load_hf(path)
  assert cfg_f == cfg_p
  want = leaves(want)
  for k, a in leaves(got).items():
    np.testing.assert_array_equal(a, want[k], err_msg=k)
  # A fused checkpoint missing its down_proj names it.
  name = next(k for k in fused if k.endswith("mlp.experts.down_proj"))
  save_file({k: v for k, v in fused.items() if k != name}, tmp_path / "model.safetensors")
  with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
    load_hf(tmp_path)


# --- fr_jax's export -----------------------------------------------------------------------------

@pytest.mark.parametrize("case,dtype", [("mlp_only", "float32"), ("step2", "float32"),
                                        ("mlp_only", "bfloat16")])
def test_hf_round_trip_is_exact(case, dtype, tmp_path):
  cfg = model_config(case, param_dtype=dtype)
  params = random_params(cfg, seed=5)
  if dtype == "bfloat16":  # sharded, through an index
    save_hf(tmp_path, params, cfg, max_shard_bytes=40_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
  else:
    export_hf(tmp_path, params, cfg)
  got_cfg, got = load_hf(tmp_path)
  assert got_cfg == cfg
  assert jax.tree.structure(got) == jax.tree.structure(params)
  want = leaves(params)
  for k, a in leaves(got).items():
    assert a.dtype == want[k].dtype and np.array_equal(a, want[k]), k
  names = [n for n, _ in iter_hf_tensors(params, cfg)]
  assert len(names) == len(set(names))
  i = SPARSE[case][-1]
  assert f"model.layers.{i}.mlp.experts.{E - 1}.down_proj.weight" in names


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_loads_in_transformers(case, tmp_path):
  cfg = model_config(case, moe_impl="ragged")
  params = random_params(cfg, seed=7)
  export_hf(tmp_path / "ours", params, cfg.replace(moe_impl="auto"))
  model = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "ours", attn_implementation="eager", dtype=torch.float32).eval()
  assert type(model) is transformers.Qwen3MoeForCausalLM
  want, _ = hf_run(model, TOKENS)
  got, _ = ours(params, cfg, TOKENS)
  diff = np.abs(got - want).max()
  print(f"\n{case}: our export in transformers, max |logit diff| {diff:.2e}")
  assert np.abs(want).max() > 1.0 and diff <= 1e-4
  # transformers writes back the same tensor names and values.
  model.save_pretrained(tmp_path / "theirs")
  theirs = load_file(tmp_path / "theirs" / "model.safetensors")
  ours_t = dict(iter_hf_tensors(params, cfg))
  assert set(theirs) == set(ours_t)
  for k, a in theirs.items():
    np.testing.assert_array_equal(a, ours_t[k], err_msg=k)


def test_missing_tensor_is_named(tmp_path):
  cfg = model_config("mlp_only")
  save_hf(tmp_path, random_params(cfg, seed=1), cfg)
  t = load_file(tmp_path / "model.safetensors")
  for name in ("model.layers.2.mlp.experts.5.up_proj.weight", "model.layers.3.mlp.gate.weight",
               "model.layers.1.mlp.down_proj.weight"):
    save_file({k: v for k, v in t.items() if k != name}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is missing"):
      load_hf(tmp_path)


def test_gguf_refuses_moe(tmp_path):
  cfg = registry.TINY_CONFIGS["tiny-qwen3-moe"]
  with pytest.raises(CheckpointError, match="qwen3moe GGUF tensor layout .* --format=hf"):
    check_gguf_exportable(cfg)
  with pytest.raises(CheckpointError, match="qwen3moe"):
    save_gguf(tmp_path / "m.gguf", random_params(cfg, 0), cfg, {})
  assert not (tmp_path / "m.gguf").exists()
  import gguf
  w = gguf.GGUFWriter(str(tmp_path / "moe.gguf"), "qwen3moe")
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_ti_data_to_file()
  w.close()
  with pytest.raises(CheckpointError, match="architecture 'qwen3moe'.*hf:DIR"):
    load_gguf(tmp_path / "moe.gguf")


def test_registry_moe_models():
  info = registry.describe("random:qwen3-30b-a3b")
  c = info.config
  assert (c.family, c.num_layers, c.num_experts, c.num_experts_per_tok, c.head_dim) == (
      "qwen3_moe", 48, 128, 8, 128)
  assert c.moe_layers == tuple(range(48)) and c.norm_topk_prob
  assert round(c.num_params / 1e9, 1) == 30.5 and round(c.num_active_params / 1e9, 1) == 3.4
  chat = registry.describe("tiny-chat-moe")
  assert chat.config.vocab_size == 320 and chat.config.is_moe
  assert chat.tokenizer is not None


# --- gradients -----------------------------------------------------------------------------------

@pytest.mark.parametrize("replay,impl", [(False, "ragged"), (True, "ragged"), (True, "gmm")])
def test_grouped_gradients_equal_dense(replay, impl):
  """On a 2-layer model (layer 0 dense, layer 1 sparse: both stacks, and little to
  compile). gmm: fr_jax.models.gmm's kernels in Pallas interpret mode."""
  cfg = model_config("mlp_only").replace(num_layers=2, mlp_only_layers=(0,))
  params = jax.tree.map(jnp.asarray, random_params(cfg, seed=2))
  rng = np.random.default_rng(3)
  B, T = 2, 10
  tokens = rng.integers(0, cfg.vocab_size, (B, T))
  pos = np.broadcast_to(np.arange(T), (B, T))
  seg = np.ones((B, T), np.int32)
  seg[1, 7:] = 0  # padding
  w = rng.standard_normal((B, T, cfg.vocab_size)).astype(np.float32)
  routes = None
  if replay:
    n = len(cfg.moe_layers)
    routes = np.argsort(rng.random((B, T, n, E)), -1)[..., :K]  # distinct experts

  def loss(p, c):
    h, _, r = forward(p, c, tokens, pos, seg, routes=routes, routing_out=True)
    return jnp.sum(decoder.logits_from_hidden(p, c, h) * w) + 10.0 * r.balance

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  grads = {i: leaves(grad(params, cfg.replace(moe_impl=i))) for i in ("dense", impl)}
  worst = 0.0
  for k, want in grads["dense"].items():
    rel = np.abs(grads[impl][k] - want).max() / np.abs(want).max()
    worst = max(worst, rel)
    assert rel <= 1e-5, (k, rel)
  assert np.abs(grads["dense"]["['moe']['router']"]).max() > 0
  print(f"\nreplay={replay}: worst relative gradient diff {impl} vs dense {worst:.2e}")


def kept_pairs(idx, devices, ranks, experts, capacity):
  """NumPy: which (position, slot) pairs of idx [B, L, k] find a slot when the rows are split
  over `devices` in order and each device's pairs, in position-major order, fill `capacity`
  slots per rank (rank = expert // (experts / ranks)), first come first served."""
  B = idx.shape[0]
  keep = np.ones(idx.shape, bool)
  for d in range(devices):
    rows = slice(d * B // devices, (d + 1) * B // devices)
    used = np.zeros(ranks, int)
    for pos in np.ndindex(*idx[rows].shape):
      r = idx[rows][pos] // (experts // ranks)
      keep[rows][pos] = used[r] < capacity
      used[r] += 1
  return keep


@pytest.mark.parametrize("shape", [(1, 2, 4), (2, 1, 4)])
def test_expert_parallel_equals_dense(shape):
  """Expert parallelism (moe._experts_dispatched) on 8 CPU devices, the expert axis of 4
  ranks each owning 2 of the 8 experts: output and every gradient (positions, experts, gate
  weights) equal the dense reference's on one device, for random routing, when every pair
  goes to one rank (the dropless buffers' bound: all N pairs in one rank's slots) and when two
  ranks get nothing. With a capacity factor of 1 (N / 4 slots per rank), the result is the
  dense reference's without the pairs that NumPy finds over capacity, and the dropped count
  is theirs."""
  from fr_jax.learner import mesh as meshlib
  cfg = model_config("step2", moe_impl="ragged", expert_shard_axis="fsdp",
                     expert_parallel_axis="expert")
  rng = np.random.default_rng(7)
  B, L, D, F = 8, 6, cfg.hidden_size, cfg.moe_intermediate_size
  x = rng.standard_normal((B, L, D)).astype(np.float32)
  mp = {"experts_gate": rng.standard_normal((E, D, F)).astype(np.float32) * 0.3,
        "experts_up": rng.standard_normal((E, D, F)).astype(np.float32) * 0.3,
        "experts_down": rng.standard_normal((E, F, D)).astype(np.float32) * 0.3}
  w = rng.random((B, L, K)).astype(np.float32)
  r = rng.standard_normal((B, L, D)).astype(np.float32)
  routings = {"random": np.argsort(rng.random((B, L, E)), -1)[..., :K],
              "one_rank": np.broadcast_to([5, 4], (B, L, K)),  # experts 4, 5: rank 2's
              "two_ranks_empty": np.broadcast_to([0, 7], (B, L, K))}  # ranks 0 and 3 only

  def loss(x, mp, w, idx, c):
    y, dropped = moe._experts(c, x, mp, idx, w)
    return jnp.sum(y * r), dropped

  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=4)
  mesh = meshlib.make_mesh(shape[0], shape[1], expert=shape[2])
  for (name, idx), capacity in [(kv, c) for kv in routings.items() for c in (0.0, 1.0)]:
    idx = idx.astype(np.int32)
    keep = np.ones(idx.shape, bool)
    if capacity:  # N = 1 row x 6 positions x top-2 = 12 pairs per device, 3 slots per rank
      keep = kept_pairs(idx, 8, 4, E, 3)
    (want_y, _), want_g = f(x, mp, w * keep, idx, cfg.replace(moe_impl="dense"))
    with jax.set_mesh(mesh):
      c = cfg.replace(moe_capacity_factor=capacity)
      if name == "random" and not capacity:  # the dispatch path, not a gather of all tokens
        assert "all_to_all" in f.lower(x, mp, w, idx, c).as_text()
      (got_y, dropped), got_g = f(x, mp, w, idx, c)
    assert float(dropped) == (~keep).sum(), (name, capacity)
    assert float(got_y) == pytest.approx(float(want_y), rel=1e-5), (name, capacity)
    want_g = (want_g[0], want_g[1], np.asarray(want_g[2]) * keep)  # d/dw of a dropped pair: 0
    for got, want in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
      err = np.abs(np.asarray(got) - np.asarray(want)).max()
      assert err <= 1e-5 * np.abs(want).max(), (name, capacity)
  assert (~kept_pairs(routings["one_rank"], 8, 4, E, 3)).sum() == 8 * 9  # the case drops


# --- the load-balancing loss ---------------------------------------------------------------------

def np_balance(router_logits, valid, k):
  """Switch Transformer's loss over the valid positions of every sparse layer, pooled:
  E * sum_e f_e P_e (f_e: top-k selections of e per valid position and layer, P_e: mean
  probability of e), in float64 with explicit loops."""
  n_e = router_logits[0].shape[-1]
  counts, probs, rows = np.zeros(n_e), np.zeros(n_e), 0
  for z in router_logits:
    z = np.asarray(z, np.float64)
    for t in np.flatnonzero(valid):
      p = np.exp(z[t] - z[t].max())
      p /= p.sum()
      counts[np.argsort(-p)[:k]] += 1
      probs += p
      rows += 1
  return n_e * float(np.sum((counts / rows) * (probs / rows)))


def test_balance_matches_transformers(saved):
  case, model, path = saved
  m = registry.load(f"hf:{path}")
  cfg = m.config.replace(moe_impl="ragged")
  _, routers = hf_run(model, TOKENS)
  gate_logits = tuple(z for z, _ in routers)
  want = float(load_balancing_loss_func(gate_logits, E, K))
  _, routing = ours(m.params, cfg, TOKENS)
  got = float(routing.balance)
  print(f"\n{case}: balance {got:.6f} vs transformers {want:.6f} "
        f"(relative diff {abs(got - want) / want:.1e})")
  np.testing.assert_allclose(got, want, rtol=1e-5)
  # Padding (segment 0) is left out. Right-padded rows: the valid positions' routers see what
  # they see unpadded, so transformers' logits of the full rows serve.
  seg = np.ones(TOKENS.shape, np.int32)
  seg[0, 9:] = 0
  seg[1, 4:] = 0
  _, padded = ours(m.params, cfg, TOKENS, segment_ids=seg)
  ref = np_balance([z.numpy() for z in gate_logits], seg.reshape(-1) > 0, K)
  masked = float(load_balancing_loss_func(gate_logits, E, K, torch.as_tensor(seg > 0)))
  print(f"{case}: padded balance {float(padded.balance):.6f} vs NumPy {ref:.6f} (relative "
        f"diff {abs(float(padded.balance) - ref) / ref:.1e}), transformers (masked) "
        f"{masked:.6f}")
  np.testing.assert_allclose(float(padded.balance), ref, rtol=1e-5)
  np.testing.assert_allclose(masked, ref, rtol=1e-5)
  assert abs(ref - np_balance([z.numpy() for z in gate_logits], seg.reshape(-1) >= 0, K)) > 1e-3


# --- routing replay ------------------------------------------------------------------------------

def test_replaying_own_routes_changes_nothing():
  cfg = model_config("step2", moe_impl="ragged")
  params = random_params(cfg, seed=4)
  want, routing = ours(params, cfg, TOKENS)
  got, again = ours(params, cfg, TOKENS, routes=np.asarray(routing.experts))
  diff = np.abs(got - want).max()
  print(f"\nreplaying its own routes: max |logit diff| {diff:.2e}")
  assert diff <= 1e-6
  np.testing.assert_array_equal(again.experts, routing.experts)
  assert not np.asarray(again.drift).any()


@pytest.mark.parametrize("case,impl", [("mlp_only", "ragged"), ("step2", "dense")])
def test_replayed_routes_use_current_probabilities(case, impl):
  """With routes other than its own top-k, a sparse layer's output is the replayed experts'
  outputs weighted by the current router's probabilities of them (renormalised over them with
  norm_topk_prob), computed here in NumPy."""
  cfg = model_config(case, moe_impl=impl)
  params = random_params(cfg, seed=6)
  j = 1  # the second sparse layer
  mp = {k: a[j] for k, a in params["moe"].items()}
  rng = np.random.default_rng(8)
  L = 9
  x = rng.standard_normal((1, L, cfg.hidden_size)).astype(np.float32)
  routes = np.argsort(rng.random((1, L, E)), -1)[..., :K]
  block = jax.jit(moe.moe_block, static_argnums=0)
  y, r = block(cfg, jnp.asarray(x), mp, routes=jnp.asarray(routes))
  y = np.asarray(y)

  def silu(v):
    return v / (1.0 + np.exp(-v))

  f64 = {k: a.astype(np.float64) for k, a in mp.items()}
  own_differs = []
  for t in range(L):
    xt = x[0, t].astype(np.float64)
    z = xt @ f64["router"]
    p = np.exp(z - z.max())
    p /= p.sum()
    sel = routes[0, t]
    gw = p[sel] / (p[sel].sum() if cfg.norm_topk_prob else 1.0)
    want = sum(g * (silu(xt @ f64["experts_gate"][e]) * (xt @ f64["experts_up"][e]))
               @ f64["experts_down"][e] for g, e in zip(gw, sel))
    np.testing.assert_allclose(y[0, t], want, rtol=1e-5, atol=1e-6, err_msg=f"position {t}")
    own_differs.append(set(np.argsort(-p)[:K]) != set(sel))
  np.testing.assert_array_equal(np.asarray(r.drift)[0], own_differs)
  assert any(own_differs)
  np.testing.assert_array_equal(np.asarray(r.experts), routes)
