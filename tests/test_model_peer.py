"""Peer tests: our decoder vs transformers' PyTorch Llama / Qwen2 / Qwen3 on the same random
weights, in both checkpoint directions (HF save -> our import, our export -> HF load)."""

import numpy as np
import pytest
import torch
import transformers

from experiments.peer_models import HF_CLASSES, hf_logits, hf_model
from fr_jax.models import decoder, registry
from fr_jax.models.hf_io import load_hf, save_hf
from tests.helpers import forward


def our_logits(params, cfg, tokens):
  tokens = np.asarray(tokens)
  pos = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  h, _ = forward(params, cfg, tokens, pos)
  return np.asarray(decoder.logits_from_hidden(params, cfg, h))


@pytest.mark.parametrize("name", sorted(registry.TINY_CONFIGS))
def test_hf_to_ours_logits_match(name, tmp_path):
  cfg = registry.TINY_CONFIGS[name]
  model = hf_model(cfg, seed=0)
  model.save_pretrained(tmp_path)
  got_cfg, params = load_hf(tmp_path)
  assert got_cfg == cfg
  # 64 positions: past the Llama-3 scaling's original 32-token context in tiny-llama.
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 64))
  want = hf_logits(model, tokens)
  got = our_logits(params, cfg, tokens)
  assert np.abs(want).max() > 1.0  # a non-trivial model
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", sorted(registry.TINY_CONFIGS))
def test_ours_to_hf_logits_match(name, tmp_path):
  m = registry.load(name, seed=3)
  save_hf(tmp_path, m.params, m.config)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager", dtype=torch.float32).eval()
  assert type(model) is HF_CLASSES[m.config.family]
  tokens = np.random.default_rng(1).integers(0, m.config.vocab_size, (3, 40))
  np.testing.assert_allclose(our_logits(m.params, m.config, tokens), hf_logits(model, tokens),
                             atol=1e-4, rtol=0)
