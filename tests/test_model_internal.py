"""Internal consistency of the decoder: packed == separate, KV-cache decode == full forward,
scoring == log_softmax(logits / T), sampling log-probs, dtype policy, checkpoint round trips."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import log_softmax

from fr_jax.models import decoder, registry, sampling, scoring
from fr_jax.models.config import ConfigError, from_hf_config, to_hf_config
from fr_jax.models.decoder import Decoder
from fr_jax.models.hf_io import CheckpointError, load_hf, save_hf
from tests.helpers import forward

TINY = sorted(registry.TINY_CONFIGS)


def full_logits(params, cfg, ids):
  ids = np.asarray(ids)[None]
  h, _ = forward(params, cfg, ids, np.arange(ids.shape[1])[None])
  return np.asarray(decoder.logits_from_hidden(params, cfg, h))[0]


@pytest.mark.parametrize("name", TINY)
def test_packed_equals_separate(name):
  m = registry.load(name, seed=1)
  rng = np.random.default_rng(0)
  seqs = [rng.integers(0, 256, n) for n in (7, 12, 5)]
  L = 30  # 24 real tokens + 6 padding
  tokens = np.zeros((1, L), np.int32)
  pos = np.zeros((1, L), np.int32)
  seg = np.zeros((1, L), np.int32)
  col = 0
  for s, ids in enumerate(seqs, 1):
    tokens[0, col:col + len(ids)] = ids
    pos[0, col:col + len(ids)] = np.arange(len(ids))
    seg[0, col:col + len(ids)] = s
    col += len(ids)
  h, _ = forward(m.params, m.config, tokens, pos, seg)
  packed = np.asarray(decoder.logits_from_hidden(m.params, m.config, h))[0]
  col = 0
  for ids in seqs:
    np.testing.assert_allclose(packed[col:col + len(ids)], full_logits(m.params, m.config, ids),
                               atol=1e-5)
    col += len(ids)


@pytest.mark.parametrize("name", TINY)
def test_kv_cache_decode_equals_full_forward(name):
  m = registry.load(name, seed=2)
  cfg = m.config
  rng = np.random.default_rng(1)
  # Two rows with different prompt lengths (right-padded), decoded together.
  prompts = [rng.integers(0, 256, 6), rng.integers(0, 256, 3)]
  conts = [rng.integers(0, 256, 8), rng.integers(0, 256, 8)]
  P = 6
  toks = np.zeros((2, P), np.int32)
  for i, p in enumerate(prompts):
    toks[i, :len(p)] = p
  lengths = np.array([len(p) for p in prompts], np.int32)
  cache = decoder.init_cache(cfg, 2, 24)
  logits, cache = sampling.prefill(m.params, cfg, cache, jnp.asarray(toks), jnp.asarray(lengths))
  steps = [np.asarray(logits)]
  for k in range(7):
    nxt = jnp.asarray([conts[0][k], conts[1][k]], jnp.int32)
    logits, cache = sampling.decode_step(m.params, cfg, cache, nxt, jnp.asarray(lengths + k))
    steps.append(np.asarray(logits))
  for i in range(2):
    ref = full_logits(m.params, cfg, np.concatenate([prompts[i], conts[i][:7]]))
    got = np.stack([s[i] for s in steps])
    np.testing.assert_allclose(got, ref[len(prompts[i]) - 1:], atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_scoring_equals_log_softmax(temperature):
  m = registry.load("tiny-qwen3", seed=4)
  rng = np.random.default_rng(2)
  ids = rng.integers(0, 256, (2, 21))
  pos = np.broadcast_to(np.arange(20), (2, 20))
  h, _ = forward(m.params, m.config, ids[:, :-1], pos)
  logits = np.asarray(decoder.logits_from_hidden(m.params, m.config, h), np.float64)
  ref_all = log_softmax(logits / temperature, axis=-1)
  ref = np.take_along_axis(ref_all, ids[:, 1:, None], -1)[..., 0]
  ref_ent = -(np.exp(ref_all) * ref_all).sum(-1)
  for chunk in (None, 7):  # one chunk, and 40 tokens in padded chunks of 7
    lp, ent = scoring.score_hidden(m.params, m.config, h, jnp.asarray(ids[:, 1:]), temperature,
                                   chunk_size=chunk)
    np.testing.assert_allclose(lp, ref, atol=2e-5)
    np.testing.assert_allclose(ent, ref_ent, atol=2e-5)
  # Gradients through the chunked (rematerialised) path equal the one-chunk path.
  def total(h, chunk):
    return scoring.score_hidden(m.params, m.config, h, jnp.asarray(ids[:, 1:]), temperature,
                                chunk_size=chunk)[0].sum()
  np.testing.assert_allclose(jax.grad(total)(h, 7), jax.grad(total)(h, None), atol=1e-6)


def test_score_packed_matches_manual_shift():
  m = registry.load("tiny-llama", seed=5)
  rng = np.random.default_rng(3)
  seq = rng.integers(0, 256, 12)
  ref = log_softmax(full_logits(m.params, m.config, seq[:-1]).astype(np.float64), -1)
  ref = np.take_along_axis(ref, seq[1:, None], -1)[:, 0]
  lp, _ = scoring.score_packed(m.params, m.config, seq[None, :-1], seq[None, 1:],
                               np.arange(11)[None], np.ones((1, 11), np.int32), 1.0)
  np.testing.assert_allclose(lp[0], ref, atol=2e-5)


def test_sampling_logprobs_are_those_of_the_sampler():
  rng = np.random.default_rng(4)
  logits = jnp.asarray(rng.standard_normal((3, 50)) * 3, jnp.float32)
  temp = jnp.asarray([1.0, 0.5, 2.0])
  top_p = jnp.asarray([1.0, 0.9, 0.5])
  logq = np.asarray(sampling.sampling_logprobs(logits, temp, top_p), np.float64)
  for i in range(3):
    p = np.exp(log_softmax(np.asarray(logits[i], np.float64) / float(temp[i])))
    order = np.argsort(-p)
    keep = np.cumsum(p[order]) - p[order] < float(top_p[i])
    kept = order[keep]
    want = np.full(50, -np.inf)
    want[kept] = np.log(p[kept] / p[kept].sum())
    np.testing.assert_allclose(logq[i][np.isfinite(want)], want[np.isfinite(want)], atol=1e-5)
    assert np.all(np.isneginf(logq[i][~np.isfinite(want)]))
  # Empirical frequencies follow the truncated distribution; the reported log-prob is its own.
  key = jax.random.key(0)
  n = 4000
  toks, lps = jax.vmap(lambda k: sampling.sample(logits[1:2], k, temp[1:2], top_p[1:2]))(
      jax.random.split(key, n))
  toks, lps = np.asarray(toks)[:, 0], np.asarray(lps)[:, 0]
  np.testing.assert_allclose(lps, logq[1][toks], atol=1e-6)
  freq = np.bincount(toks, minlength=50) / n
  assert np.abs(freq - np.exp(logq[1])).max() < 0.04
  # Greedy: argmax, with the model's log_softmax.
  tok, lp = sampling.sample(logits, key, jnp.zeros(3), jnp.ones(3))
  np.testing.assert_array_equal(tok, np.argmax(np.asarray(logits), -1))
  np.testing.assert_allclose(lp, log_softmax(np.asarray(logits, np.float64), -1).max(-1),
                             atol=1e-5)


def test_bf16_compute_is_close_to_f32():
  m32 = registry.load("tiny-llama", seed=7)
  m16 = registry.load("tiny-llama", seed=7, compute_dtype="bfloat16")
  ids = np.random.default_rng(5).integers(0, 256, 24)
  a = full_logits(m32.params, m32.config, ids)
  b = full_logits(m16.params, m16.config, ids)
  assert 0 < np.abs(a - b).max() < 0.05 * np.abs(a).max()
  mbf = registry.load("tiny-llama", seed=7, param_dtype="bfloat16", compute_dtype="bfloat16")
  assert mbf.params["embed"].dtype == jnp.bfloat16


def test_nnx_module_wraps_the_same_params():
  m = registry.load("tiny-qwen3", seed=8)
  model = Decoder(m.config, params=m.params)
  ids = np.random.default_rng(6).integers(0, 256, (1, 9))
  np.testing.assert_allclose(model(ids)[0], full_logits(m.params, m.config, ids[0]), atol=1e-6)
  assert jax.tree.structure(model.params()) == jax.tree.structure(m.params)


# --- checkpoints ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_import_round_trip_is_bit_exact(name, dtype, tmp_path):
  m = registry.load(name, seed=9, param_dtype=dtype)
  save_hf(tmp_path, m.params, m.config)
  cfg, params = load_hf(tmp_path)
  assert cfg == m.config
  for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(params)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16 if dtype == "bfloat16"
                                                     else np.uint32),
                                  np.asarray(b).view(np.uint16 if dtype == "bfloat16"
                                                     else np.uint32))


def test_sharded_export_has_an_index_and_round_trips(tmp_path):
  m = registry.load("tiny-qwen2", seed=10)
  save_hf(tmp_path, m.params, m.config, max_shard_bytes=40_000)
  shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
  assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").exists()
  _, params = load_hf(tmp_path)
  for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


def test_checkpoint_errors_name_the_problem(tmp_path):
  with pytest.raises(CheckpointError, match="config.json"):
    load_hf(tmp_path)
  m = registry.load("tiny-llama")
  save_hf(tmp_path, m.params, m.config)
  import json

  from safetensors.numpy import load_file, save_file
  t = load_file(tmp_path / "model.safetensors")
  del t["model.layers.1.mlp.up_proj.weight"]
  save_file(t, tmp_path / "model.safetensors")
  with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
    load_hf(tmp_path)
  cfg = json.loads((tmp_path / "config.json").read_text())
  with pytest.raises(ConfigError, match="model_type='gpt2'"):
    from_hf_config({**cfg, "model_type": "gpt2"})
  with pytest.raises(ConfigError, match="rope_type='yarn'"):
    from_hf_config({**cfg, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}})


def test_hf_config_round_trip():
  for cfg in registry.TINY_CONFIGS.values():
    assert from_hf_config(to_hf_config(cfg)) == cfg


def test_analytic_flops_match_xla_cost_analysis():
  """`ModelConfig.flops_per_token` / `train_flops` (MFU's model FLOPs) against XLA's own count
  of the compiled forward and forward+backward of an unrolled model whose matmuls dominate.
  XLA also counts elementwise work and the masked half of causal attention: a few percent."""
  from fr_jax.models.config import ModelConfig
  cfg = ModelConfig(family="llama", vocab_size=512, hidden_size=256, intermediate_size=768,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)
  R, L = 2, 16
  # The decode layout's unrolled layer list: XLA counts a scanned layer only once.
  params = decoder.decode_layout(decoder.init_params(cfg, jax.random.key(0)), cfg)
  tokens = jnp.zeros((R, L), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(L), (R, L))

  def fwd(p):
    return decoder.logits_from_hidden(p, cfg, decoder.forward(p, cfg, tokens, pos)[0]).sum()

  def cost(f):
    ca = jax.jit(f).lower(params).compile().cost_analysis()
    return float((ca[0] if isinstance(ca, (list, tuple)) else ca)["flops"])

  forward = cfg.flops_per_token(L) * R * L
  assert cost(fwd) == pytest.approx(forward, rel=0.03)
  assert cost(jax.grad(fwd)) == pytest.approx(cfg.train_flops(R, L), rel=0.05)
