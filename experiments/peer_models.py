"""The transformers peers of fr_jax's tiny models: a random PyTorch model for a ModelConfig,
every tensor random (norms and biases included), and its logits. Used by tests/test_model_peer.py
and by the device check's fixtures (experiments/device_check.py); needs torch and transformers,
which fr_jax itself never imports."""

import numpy as np
import torch
import transformers

from fr_jax.models.config import to_hf_config

HF_CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
              "qwen3": transformers.Qwen3ForCausalLM,
              "qwen3_moe": transformers.Qwen3MoeForCausalLM}


def hf_model(cfg, seed):
  """transformers' model of `cfg`'s family and shapes (eager attention, eval mode)."""
  hf_cfg = transformers.AutoConfig.for_model(**to_hf_config(cfg))
  hf_cfg._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = HF_CLASSES[cfg.family](hf_cfg).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.05) + (1.0 if p.ndim == 1 else 0))
  return model


def hf_logits(model, tokens):
  """f32 logits [B, T, V] for int tokens [B, T]."""
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(tokens))).logits.float().numpy()
