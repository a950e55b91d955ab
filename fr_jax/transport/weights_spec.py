"""What a weight relay knows of the model it relays: the model's HF config and tokenizer
from the run config (never its weights), and one check of every version received against
it, whether it came whole (fr_jax parameter names) or as a shards manifest (HF names).
The relay's loop is `fr_jax.transport.relay`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fr_jax.models import decoder, hf_shards
from fr_jax.models.config import ModelConfig
from fr_jax.transport import codec


class RelayError(RuntimeError):
  """Something a retry cannot fix: the weights do not fit the configured model."""


# --- the model's HF config and tokenizer, without its weights ---
def model_spec(name: str, *, param_dtype: str = "float32",
               compute_dtype: str = "float32") -> tuple[ModelConfig, dict | None]:
  """(ModelConfig, tokenizer files or None) of a registry model name, read from its shapes,
  GGUF metadata or config.json; no weights are loaded."""
  from fr_jax.models import registry
  from fr_jax.models.tokenizer import Tokenizer
  dt = dict(param_dtype=param_dtype, compute_dtype=compute_dtype)
  if name in registry.TINY_CONFIGS:
    tok = Tokenizer.byte_level() if name in registry.TINY_TOKENIZED else None
    return registry.TINY_CONFIGS[name].replace(**dt), tok.files() if tok else None
  if name.startswith("random:"):
    return registry.shape_config(name.removeprefix("random:"), **dt), None
  if name == registry.DEFAULT_MODEL or name.startswith("gguf:") or name.endswith(".gguf"):
    import gguf

    from fr_jax.models.gguf_io import config_from_gguf
    path = (registry.smollm2_gguf_path() if name == registry.DEFAULT_MODEL
            else Path(name.removeprefix("gguf:")))
    if not path.is_file():
      raise registry.ModelNotFound(f"GGUF file {path} not found")
    reader = gguf.GGUFReader(str(path))  # memory-mapped: only the metadata is read
    return config_from_gguf(reader, **dt), Tokenizer.from_gguf(reader).files()
  from fr_jax.models.config import from_hf_config
  path = Path(name.removeprefix("hf:"))
  if not (path / "config.json").is_file():
    raise registry.ModelNotFound(f"unknown model {name!r}: not one of {registry.names()}, "
                                 "not a directory with config.json and not a .gguf file")
  cfg = from_hf_config(json.loads((path / "config.json").read_text()), **dt)
  tok = Tokenizer.from_file(path).files() if (path / "tokenizer.json").is_file() else None
  return cfg, tok


def received_config(cfg: ModelConfig, has_head: bool, dtype: str) -> ModelConfig:
  """`cfg` as the learner published it: tied embeddings when no LM head came (as `load_hf`
  reads a checkpoint), and the received dtype."""
  if not has_head and not cfg.tie_embeddings:
    cfg = cfg.replace(tie_embeddings=True)
  return cfg.replace(param_dtype=dtype)


def check_shapes(cfg: ModelConfig, got: dict, want: dict) -> ModelConfig:
  """The one check: the received tensors' {name: shape} are exactly the model's; RelayError
  naming the first tensor that differs (missing, extra or another shape)."""
  for name in sorted(set(want) | set(got)):
    g = tuple(got[name]) if name in got else None
    w = tuple(want[name]) if name in want else None
    if g != w:
      raise RelayError(
          f"the learner's tensor {name!r} has shape {g}, the configured model "
          f"({cfg.family}, {cfg.num_layers} layers, hidden {cfg.hidden_size}) expects "
          f"{w}: give --config the learner's run config")
  return cfg


def check_flat(cfg: ModelConfig, flat: dict) -> ModelConfig:
  """Whole weights (fr_jax names): the configured model with their dtype, once checked."""
  embed = flat.get("embed")
  dtype = codec._dtype_name(embed) if embed is not None else cfg.param_dtype
  cfg = received_config(cfg, "lm_head" in flat, dtype)
  return check_shapes(cfg, {k: a.shape for k, a in flat.items()},
                      codec.flatten(decoder.param_shapes(cfg)))


def check_manifest(cfg: ModelConfig, manifest: hf_shards.Manifest) -> ModelConfig:
  """A shards manifest (HF names): the configured model with its dtype, once checked (a
  LoRA model's adapters are checked against their weights by the manifest itself)."""
  cfg = received_config(cfg, "lm_head.weight" in manifest.tensors, manifest.dtype)
  return check_shapes(cfg, manifest.served_tensors, hf_shards.hf_tensor_shapes(cfg))


def hf_major(params: dict) -> dict:
  """The same values, each stacked layer matrix [L, in, out] re-laid in place as a transposed
  view of [L, out, in] memory, one layer at a time (a temporary of one layer's matrix). HF
  stores these matrices [out, in], so `save_hf`'s per-layer transposes become contiguous
  views instead of a second copy of the model: the relay peaks at one model, not two."""
  layers = params["layers"]
  for k, a in layers.items():
    if a.ndim != 3:
      continue
    if not (a.flags.writeable and a.flags.c_contiguous):
      a = np.array(a)
    n, d_in, d_out = a.shape
    t = a.reshape(n, d_out, d_in)  # the same memory; layer i keeps its own bytes
    for i in range(n):
      t[i] = a[i].T.copy()
    layers[k] = t.transpose(0, 2, 1)
  return params
