"""LoRA (issue 57): B = 0 adapters leave the model bit for bit as it was; random adapters give
the logits and adapter gradients of PEFT on transformers (the torch peer) on the same
weights, through fr_jax's own PEFT export; the compiled update computes no gradient of a
frozen weight and keeps optimizer state for the adapters only; a mesh trains them as one
device does; checkpoints restore them."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers

from fr_jax.learner import compile as compiling
from fr_jax.learner.learner import Learner
from fr_jax.models import decoder, hf_io, hf_shards, lora, registry, scoring
from fr_jax.models.config import ConfigError
from fr_jax.transport import shards
from tests.helpers import batches, forward, max_diff, tiny_config

ALL = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
ATTENTION = ("wq", "wk", "wv", "wo")
FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe")


def adapted(name, seed=3, rank=4, alpha=8.0, noise=0.05):
  """A tiny model with LoRA on every projection it allows (attention only on the MoE one):
  (base config, LoRA config, base params, adapted params with random A and B)."""
  m = registry.load(name, seed=seed)
  cfg = m.config.replace(lora_rank=rank, lora_alpha=alpha,
                         lora_targets=ATTENTION if m.config.is_moe else ALL)
  base = jax.tree.map(jnp.asarray, m.params)
  p = lora.init_adapters(base, cfg, jax.random.key(seed))
  trainable, frozen = lora.split(p)
  if noise:
    leaves, tree = jax.tree.flatten(trainable)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    trainable = jax.tree.unflatten(tree, [a + noise * jax.random.normal(k, a.shape)
                                          for a, k in zip(leaves, keys)])
  return m.config, cfg, base, lora.join(trainable, frozen)


def logits(params, cfg, tokens):
  pos = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  h, _ = forward(params, cfg, tokens, pos)
  return np.asarray(decoder.logits_from_hidden(params, cfg, h))


def peft_model(tmp_path, base_cfg, cfg, params, trainable=False):
  """transformers' model of the base weights with fr_jax's PEFT export of the adapters on it."""
  _, frozen = lora.split(params)
  hf_io.save_hf(tmp_path / "base", frozen, base_cfg)
  hf_io.save_peft(tmp_path / "adapter", params, cfg)
  base = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "base", attn_implementation="eager", dtype=torch.float32)
  return peft.PeftModel.from_pretrained(base, tmp_path / "adapter",
                                        is_trainable=trainable).eval()


@pytest.mark.parametrize("name", FAMILIES)
def test_zero_b_adapters_leave_logits_and_logprobs_bit_equal(name):
  base_cfg, cfg, base, _ = adapted(name, noise=0.0)
  p = lora.init_adapters(base, cfg, jax.random.key(0))
  trainable, _ = lora.split(p)
  assert trainable and all(not np.any(np.asarray(b)) for k, b in trainable["layers"].items()
                           if k.endswith("_lora_b"))
  assert any(np.any(np.asarray(a)) for k, a in trainable["layers"].items()
             if k.endswith("_lora_a"))  # A is drawn, B is zero
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 32))
  assert np.array_equal(logits(p, cfg, tokens), logits(base, base_cfg, tokens))
  pos = np.broadcast_to(np.arange(32), tokens.shape)
  seg = np.ones_like(tokens)
  lp = [np.asarray(scoring.score_packed(q, c, tokens, np.roll(tokens, -1, 1), pos, seg, 0.7)[0])
        for q, c in ((p, cfg), (base, base_cfg))]
  assert np.array_equal(*lp)


@pytest.mark.parametrize("name", FAMILIES)
def test_random_adapters_equal_peft_on_transformers(name, tmp_path):
  base_cfg, cfg, base, p = adapted(name)
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 40))
  ours = logits(p, cfg, tokens)
  with torch.no_grad():
    theirs = peft_model(tmp_path, base_cfg, cfg, p)(torch.as_tensor(tokens)).logits.numpy()
  assert np.abs(ours - logits(base, base_cfg, tokens)).max() > 0.1  # the adapters matter
  assert np.abs(ours - theirs).max() <= 1e-5
  # The merged export (--format=hf): the plain model transformers loads computes the same.
  hf_io.save_hf(tmp_path / "merged", p, cfg)
  merged = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "merged", attn_implementation="eager", dtype=torch.float32).eval()
  with torch.no_grad():
    assert np.abs(merged(torch.as_tensor(tokens)).logits.numpy() - ours).max() <= 1e-5


@pytest.mark.parametrize("name", ("tiny-qwen2", "tiny-qwen3-moe"))
def test_adapter_gradients_equal_torch_autograd_through_peft(name, tmp_path):
  base_cfg, cfg, _, p = adapted(name)
  rng = np.random.default_rng(2)
  tokens = rng.integers(0, cfg.vocab_size, (2, 24))
  targets = rng.integers(0, cfg.vocab_size, (2, 24))
  pos = np.broadcast_to(np.arange(24), tokens.shape)
  trainable, frozen = lora.split(p)

  def loss(tr):  # the mean log-prob of the targets at temperature 0.8
    lp, _ = scoring.score_packed(lora.join(tr, frozen), cfg, tokens, targets, pos,
                                 np.ones_like(tokens), 0.8)
    return lp.mean()

  ours = jax.grad(loss)(trainable)
  model = peft_model(tmp_path, base_cfg, cfg, p, trainable=True)
  out = model(torch.as_tensor(tokens)).logits.double() / 0.8
  want = torch.log_softmax(out, -1).gather(-1, torch.as_tensor(targets)[..., None]).mean()
  want.backward()
  grads = {n: q.grad.numpy() for n, q in model.named_parameters() if q.grad is not None}
  assert all("lora_" in n for n in grads)  # the peer, too, trains the adapters only
  checked = 0
  for leaf, g in ours["layers"].items():
    w, ab = leaf.rsplit("_lora_", 1)
    module = hf_io._LAYER_NAMES[w][0].removesuffix(".weight")
    for i in range(cfg.num_layers):
      ref = grads[f"base_model.model.model.layers.{i}.{module}.lora_{ab.upper()}.default.weight"]
      np.testing.assert_allclose(np.asarray(g[i]).T, ref, atol=2e-6, rtol=1e-4)
      checked += 1
  assert checked == 2 * len(cfg.lora_targets) * cfg.num_layers
  assert max(np.abs(np.asarray(g)).max() for g in jax.tree.leaves(ours)) > 1e-3


def _dots(hlo: str) -> set[tuple[int, ...]]:
  """The result shapes of every dot in an HLO module's text."""
  return {tuple(int(d) for d in m.group(1).split(",") if d)
          for m in re.finditer(r"= f32\[([\d,]*)\][^=]*? dot\(", hlo)}


def test_update_computes_no_frozen_weight_gradient_and_keeps_adapter_state_only():
  model_cfg = registry.TINY_CONFIGS["tiny-llama"]
  exes = {}
  for rank in (0, 4):
    c = tiny_config(**{"model.lora.rank": rank})
    exes[rank], _, _ = compiling.compile_update_from_shapes(c, model_cfg, 8)
  D, F, V = model_cfg.hidden_size, model_cfg.intermediate_size, model_cfg.vocab_size
  kv = model_cfg.num_kv_heads * model_cfg.head_dim
  weights = {(D, D), (D, kv), (D, F), (F, D), (V, D), (D, V)}  # [in, out] either way round
  full, low = _dots(exes[0].as_text()), _dots(exes[4].as_text())
  # Full fine-tuning contracts over the tokens into each weight's shape; LoRA never does.
  assert weights & {s[-2:] for s in full if len(s) >= 2}
  assert not weights & {s[-2:] for s in low if len(s) >= 2}, low
  flops = {r: e.cost_analysis() for r, e in exes.items()}
  flops = {r: (f[0] if isinstance(f, list) else f)["flops"] for r, f in flops.items()}
  # At least the tied head's gradient is gone: 2 N D V for N = 8 x 128 scored positions.
  assert flops[0] - flops[4] >= 2 * 8 * 128 * D * V
  # Arguments: the train state holds Adam's two moments for the adapters only (f32 each).
  args = {r: e.memory_analysis().argument_size_in_bytes for r, e in exes.items()}
  n_adapters = lora.count(decoder.init_params(
      model_cfg.replace(lora_rank=4, lora_targets=ALL), jax.random.key(0)))
  assert 0 < n_adapters < model_cfg.num_params / 10
  assert args[0] - args[4] == 4 * (2 * model_cfg.num_params - 3 * n_adapters)


def test_learner_trains_the_adapters_only_on_a_mesh_as_on_one_device(tmp_path):
  kw = {"model.lora.rank": 4, "model.lora.alpha": 8.0, "optim.lr": 1e-3}
  single = Learner(tiny_config(**kw), devices=jax.devices()[:1])
  mesh = Learner(tiny_config(**kw, **{"mesh.data": 4, "mesh.fsdp": 2,
                                      "checkpoint.dir": str(tmp_path / "ckpt"),
                                      "checkpoint.every": 1}))
  start = jax.tree.map(np.asarray, single.params)
  assert max_diff(start, mesh.params) == 0.0
  for b in batches(2):
    m1, m8 = single.update(b), mesh.update(b)
    assert m8["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-7)
  mesh.save(force=True)
  trained, frozen = lora.split(jax.tree.map(np.asarray, single.params))
  start_trained, start_frozen = lora.split(start)
  assert max_diff(frozen, start_frozen) == 0.0  # the base did not move, bit for bit
  assert max_diff(trained, start_trained) > 1e-4  # the adapters did
  assert max_diff(single.params, mesh.params) <= 1e-5
  assert jax.tree.structure(single.state.opt_state) == jax.tree.structure(
      jax.eval_shape(single.optimizer.init, start_trained))
  # Engines get the merged model; the adapters' effect is in it.
  snap = single.snapshot_params()
  assert not lora.has_adapters(snap)
  assert max_diff(snap, lora.merged(single.params, single.model_config)) == 0.0
  assert max_diff(snap["layers"]["wq"], start["layers"]["wq"]) > 0
  # A restart restores adapters and their optimizer state.
  mesh.checkpointer.wait()
  again = Learner(tiny_config(**kw, **{"checkpoint.dir": str(tmp_path / "ckpt")}),
                  devices=jax.devices()[:1])
  again.restore()
  assert again.version == 2
  assert max_diff(again.params, mesh.params) == 0.0
  assert max_diff(again.state.opt_state, mesh.state.opt_state) == 0.0
  # Relays get the base and the adapters unmerged (the adapters alone change between
  # versions), under PEFT's names, with the scale to fold them in (tests/test_shards.py).
  mesh.shard_sink = host = shards.ShardHost("float32")
  mesh.publish_shards(version=2)
  mesh.wait_shards()
  m, cfg = host.manifest(2), mesh.model_config
  assert m.lora_scale == 2.0 and len(m.adapters) == 2 * len(cfg.lora_targets) * cfg.num_layers
  assert m.served_tensors == hf_shards.hf_tensor_shapes(cfg)
  q = "model.layers.0.self_attn.q_proj.weight"
  assert m.tensors[hf_io.adapter_name(q, "a")] == (4, m.tensors[q][1])
  assert m.tensors[hf_io.adapter_name(q, "b")] == (m.tensors[q][0], 4)
  for L in (single, mesh, again):
    L.close()


def test_a_bfloat16_base_trains_float32_adapters():
  L = Learner(tiny_config(**{"model.lora.rank": 4, "model.param_dtype": "bfloat16"}),
              devices=jax.devices()[:1])
  trainable, frozen = lora.split(L.params)
  assert {a.dtype for a in jax.tree.leaves(frozen)} == {jnp.dtype(jnp.bfloat16)}
  assert {a.dtype for a in jax.tree.leaves(trainable)} == {jnp.dtype(jnp.float32)}
  before, frozen = jax.tree.map(np.asarray, (trainable, frozen))  # the update donates them
  L.update(batches(1)[0])
  after, frozen_after = lora.split(L.params)
  assert max_diff(after, before) > 1e-4 and max_diff(frozen_after, frozen) == 0.0
  assert {a.dtype for a in jax.tree.leaves(after)} == {jnp.dtype(jnp.float32)}
  L.close()


def test_lora_config_errors_name_the_problem():
  cfg = registry.TINY_CONFIGS["tiny-qwen3-moe"]
  with pytest.raises(ConfigError, match="experts"):
    cfg.replace(lora_rank=4, lora_targets=("wq", "w_up"))
  with pytest.raises(ConfigError, match="not projections"):
    cfg.replace(lora_rank=4, lora_targets=("wq", "lm_head"))
  with pytest.raises(ConfigError, match="no lora_targets"):
    cfg.replace(lora_rank=4)
  assert cfg.replace(lora_rank=2, lora_targets="q_proj,v_proj").lora_targets == ("wq", "wv")
  with pytest.raises(ConfigError, match="lora_rank=0"):
    _ = lora.merged(adapted("tiny-llama")[3], registry.TINY_CONFIGS["tiny-llama"])


def test_a_remote_worker_fetches_the_base_once_then_the_adapters_only():
  """GetWeights for a LoRA run (a worker's client with lora=True): the merged model until the
  learner keeps adapters (from the publication after the first ask), then the frozen base
  and the adapters once, then the adapters' bytes only. What the client hands its engine,
  folded by the engine's own decode layout, is the learner's merged model."""
  from fr_jax.learner.publish import Publisher
  from fr_jax.rollout.embedded import EmbeddedEngine
  from fr_jax.transport import server as srv
  from fr_jax.transport.client import WeightsClient
  L = Learner(tiny_config(**{"model.lora.rank": 4, "model.lora.alpha": 8.0, "optim.lr": 1e-3}),
              devices=jax.devices()[:1])
  pub = Publisher(L)
  server, port = srv.serve(pub)
  client = WeightsClient(f"127.0.0.1:{port}", lora=True)
  fetched = []  # (form asked, bytes that came) per fetch
  fetch = client.fetch_weights

  def counted(*a, **k):
    got = fetch(*a, **k)
    fetched.append((k["form"], sum(x.nbytes for x in got[1].values())))
    return got

  client.fetch_weights = counted
  cfg = L.model_config
  engine = EmbeddedEngine(cfg, L.policy_params(), num_slots=1, max_len=16)
  try:
    pub.publish(0)
    v, params, _ = client.get_weights(0)
    assert v == 0 and not lora.has_adapters(params)  # not kept yet: the merged model
    full = fetched[-1][1]
    for b in batches(2):
      L.update(b)
      pub.publish(L.version)
      v, params, _ = client.get_weights(L.version)
      assert v == L.version and lora.has_adapters(params)
      engine.update_weights(params, v)
      want = decoder.decode_layout(L.policy_params(), cfg.replace(lora_rank=0, lora_targets=()))
      assert max_diff(engine.params, want) <= 1e-6
    adapter_bytes = 4 * lora.count(L.params)
    assert [f for f, _ in fetched] == ["lora", "lora", "adapters"]
    assert fetched[1][1] == full + adapter_bytes  # base (f32, as the merged) + adapters
    assert fetched[2][1] == adapter_bytes < full / 10
  finally:
    client.close()
    srv.stop(server, grace=0)
    L.close()
