"""Peer tests: our decoder vs transformers' PyTorch Llama / Qwen2 / Qwen3 on the same random
weights, in both checkpoint directions (HF save -> our import, our export -> HF load)."""

import numpy as np
import pytest
import torch
import transformers

from fr_jax.models import decoder, registry
from fr_jax.models.config import to_hf_config
from fr_jax.models.hf_io import load_hf, save_hf

HF_CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
              "qwen3": transformers.Qwen3ForCausalLM}


def hf_model(cfg, seed):
  hf_cfg = transformers.AutoConfig.for_model(**to_hf_config(cfg))
  hf_cfg._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = HF_CLASSES[cfg.family](hf_cfg).eval()
  with torch.no_grad():  # randomise everything, norms and biases included
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.05) + (1.0 if p.ndim == 1 else 0))
  return model


def hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.as_tensor(tokens)).logits.float().numpy()


def our_logits(params, cfg, tokens):
  tokens = np.asarray(tokens)
  pos = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  h, _ = decoder.forward(params, cfg, tokens, pos)
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
