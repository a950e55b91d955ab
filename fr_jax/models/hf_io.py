"""Hugging Face checkpoints: import a directory (config.json + *.safetensors, sharded index
included) and export one that transformers and SGLang (`update_weights_from_disk`) can load.

HF stores linear weights as [out, in]; fr_jax stores [in, out] with layers stacked on a
leading axis. Embeddings and the LM head are [vocab, hidden] in both.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from fr_jax.models import decoder
from fr_jax.models.config import ModelConfig, from_hf_config, to_hf_config

# fr_jax per-layer name -> (HF name under model.layers.{i}., transpose)
_LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "bo": ("self_attn.o_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
    "b_gate": ("mlp.gate_proj.bias", False),
    "b_up": ("mlp.up_proj.bias", False),
    "b_down": ("mlp.down_proj.bias", False),
}
_TOP_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
              "lm_head": "lm_head.weight"}


class CheckpointError(ValueError):
  """A checkpoint that cannot be read, naming the file and what is wrong."""


def _np_dtype(name: str):
  return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _weight_files(path: Path) -> list[Path]:
  index = path / "model.safetensors.index.json"
  if index.exists():
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    missing = [f for f in files if not (path / f).exists()]
    if missing:
      raise CheckpointError(f"{index} names shards that are missing: {missing}")
    return [path / f for f in files]
  files = sorted(path.glob("*.safetensors"))
  if not files:
    raise CheckpointError(f"no *.safetensors files in {path}")
  return files


def _read_tensors(files: list[Path]) -> dict[str, np.ndarray]:
  out = {}
  for f in files:
    with safe_open(str(f), framework="numpy") as st:
      for k in st.keys():
        out[k] = st.get_tensor(k)
  return out


def load_hf(path, *, param_dtype: str | None = None, compute_dtype: str | None = None):
  """Reads a HF model directory. Returns (ModelConfig, params of NumPy arrays)."""
  path = Path(path)
  cfg_file = path / "config.json"
  if not cfg_file.exists():
    raise CheckpointError(f"{cfg_file} not found: a Hugging Face model directory needs "
                          "config.json and *.safetensors")
  hf = json.loads(cfg_file.read_text())
  tensors = _read_tensors(_weight_files(path))
  dtype_name = param_dtype or _dtype_of(tensors)
  overrides = {"param_dtype": dtype_name}
  if compute_dtype:
    overrides["compute_dtype"] = compute_dtype
  cfg = from_hf_config(hf, **overrides)
  if "lm_head.weight" not in tensors and not cfg.tie_embeddings:
    cfg = cfg.replace(tie_embeddings=True)  # some exports omit the tied head
  return cfg, params_from_hf_tensors(tensors, cfg, source=str(path))


def _dtype_of(tensors) -> str:
  d = tensors["model.embed_tokens.weight"].dtype if "model.embed_tokens.weight" in tensors \
      else next(iter(tensors.values())).dtype
  return "bfloat16" if d == ml_dtypes.bfloat16 else "float32"


def params_from_hf_tensors(tensors: dict[str, np.ndarray], cfg: ModelConfig, source=""):
  """HF-named tensors -> fr_jax params (NumPy, cfg.param_dtype)."""
  dtype = _np_dtype(cfg.param_dtype)
  shapes = decoder.param_shapes(cfg)

  def take(name, shape, transpose):
    if name not in tensors:
      raise CheckpointError(f"{source}: tensor {name!r} is missing (expected shape "
                            f"{tuple(reversed(shape)) if transpose else shape})")
    a = np.asarray(tensors[name])
    a = a.T if transpose else a
    if a.shape != tuple(shape):
      raise CheckpointError(f"{source}: {name!r} has shape {a.shape}, config implies {shape}")
    return np.ascontiguousarray(a.astype(dtype, copy=False))

  params = {}
  for k, hf_name in _TOP_NAMES.items():
    if k in shapes:
      params[k] = take(hf_name, shapes[k], False)
  layers = {}
  for k, shape in shapes["layers"].items():
    hf_name, tr = _LAYER_NAMES[k]
    layers[k] = np.stack([take(f"model.layers.{i}.{hf_name}", shape[1:], tr)
                          for i in range(cfg.num_layers)])
  params["layers"] = layers
  return params


def iter_hf_tensors(params, cfg: ModelConfig):
  """(HF name, NumPy array in HF layout) for each tensor, one at a time; linear weights are
  transposed views, not copies, so a caller can convert and write them one by one."""
  for k, hf_name in _TOP_NAMES.items():
    if k in params:
      yield hf_name, np.asarray(params[k])
  for k, stacked in params["layers"].items():
    hf_name, tr = _LAYER_NAMES[k]
    stacked = np.asarray(stacked)
    for i in range(cfg.num_layers):
      yield f"model.layers.{i}.{hf_name}", (stacked[i].T if tr else stacked[i])


def hf_tensors_from_params(params, cfg: ModelConfig) -> dict[str, np.ndarray]:
  return {name: np.ascontiguousarray(a) for name, a in iter_hf_tensors(params, cfg)}


def save_hf(path, params, cfg: ModelConfig, *, tokenizer_files: dict | None = None,
            max_shard_bytes: int = 5 * 2**30) -> Path:
  """Writes config.json and safetensors (sharded with an index above `max_shard_bytes`).

  `tokenizer_files` maps file names (tokenizer.json, tokenizer_config.json, ...) to their
  text, written beside the weights so the directory is self-contained. Files are written
  under a temporary name and renamed, so a reader never sees a half-written checkpoint.
  """
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tensors = hf_tensors_from_params(params, cfg)
  shards, cur, size = [], {}, 0
  for name in sorted(tensors):
    nbytes = tensors[name].nbytes
    if cur and size + nbytes > max_shard_bytes:
      shards.append(cur)
      cur, size = {}, 0
    cur[name] = tensors[name]
    size += nbytes
  shards.append(cur)
  meta = {"format": "pt"}  # transformers expects this metadata key
  for old in path.glob("model*.safetensors*"):
    old.unlink()
  if len(shards) == 1:
    _atomic(path / "model.safetensors", lambda p: save_file(shards[0], p, metadata=meta))
  else:
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
      fname = f"model-{i:05d}-of-{n:05d}.safetensors"
      _atomic(path / fname, lambda p, s=shard: save_file(s, p, metadata=meta))
      weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": weight_map}
    _atomic(path / "model.safetensors.index.json",
            lambda p: Path(p).write_text(json.dumps(index, indent=2)))
  _atomic(path / "config.json",
          lambda p: Path(p).write_text(json.dumps(to_hf_config(cfg), indent=2)))
  for name, text in (tokenizer_files or {}).items():
    _atomic(path / name, lambda p, t=text: Path(p).write_text(t))
  return path


def export_hf(path, params, cfg: ModelConfig, tokenizer=None) -> Path:
  """The one HF export (`Learner.export_hf`, `launch.export`): `save_hf` with the tokenizer's
  files (a `fr_jax.models.tokenizer.Tokenizer`, or None for none) beside the weights."""
  files = tokenizer.files() if tokenizer is not None else None
  return save_hf(path, params, cfg, tokenizer_files=files)


def _atomic(target: Path, write):
  tmp = target.with_name(target.name + ".tmp")
  write(str(tmp))
  os.replace(tmp, target)
