"""Hugging Face checkpoints: import a directory (config.json + *.safetensors, sharded index
included) and export one that transformers and SGLang (`update_weights_from_disk`) can load.

HF stores linear weights as [out, in]; fr_jax stores [in, out] with layers stacked on a
leading axis. Embeddings and the LM head are [vocab, hidden] in both.

Qwen3-MoE. A sparse layer i has its router at `model.layers.{i}.mlp.gate.weight` [E, D] and
each expert's SwiGLU at `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`
([F, D], [F, D], [D, F]): the released checkpoints' layout (Qwen/Qwen3-30B-A3B), and what
transformers 5's `save_pretrained` writes too. Its dense layers (mlp_only_layers,
decoder_sparse_step) keep `mlp.{gate,up,down}_proj`. Export writes that layout; import also
reads transformers 5's in-memory fused experts (`mlp.experts.gate_up_proj` [E, 2F, D], gate
rows first, and `mlp.experts.down_proj` [E, D, F]). fr_jax keeps each kind stacked over the
sparse layers and experts (`params["moe"]`, see `fr_jax.models.decoder`), so import fills
one preallocated array per kind, reading one tensor at a time from the memory-mapped files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from fr_jax import durable
from fr_jax.models import decoder, lora
from fr_jax.models.config import LORA_TARGETS, ModelConfig, from_hf_config, to_hf_config

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
# Qwen3-MoE, under model.layers.{i}.mlp.: the router, and each expert's projections (under
# experts.{e}.; all transposed).
_ROUTER_NAME = "gate.weight"
_EXPERT_NAMES = {"experts_gate": "gate_proj.weight", "experts_up": "up_proj.weight",
                 "experts_down": "down_proj.weight"}


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


class _Tensors(Mapping):
  """The tensors of safetensors files by name, each read from its (memory-mapped) file when
  asked for, so an import holds one source tensor at a time beside the params it fills."""

  def __init__(self, files: list[Path]):
    self._file = {}
    for f in files:
      try:
        handle = safe_open(str(f), framework="numpy")
      except Exception as e:  # safetensors raises its own error types for a bad file
        raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from e
      self._file.update(dict.fromkeys(handle.keys(), handle))

  def __getitem__(self, name: str) -> np.ndarray:
    return self._file[name].get_tensor(name)

  def __contains__(self, name) -> bool:
    return name in self._file

  def __iter__(self):
    return iter(self._file)

  def __len__(self) -> int:
    return len(self._file)

  def dtype(self, name: str) -> str:
    """The stored dtype's safetensors name (F32, BF16, ...), without reading the tensor."""
    return self._file[name].get_slice(name).get_dtype()


def load_hf(path, *, param_dtype: str | None = None, compute_dtype: str | None = None):
  """Reads a HF model directory. Returns (ModelConfig, params of NumPy arrays)."""
  path = Path(path)
  cfg_file = path / "config.json"
  if not cfg_file.exists():
    raise CheckpointError(f"{cfg_file} not found: a Hugging Face model directory needs "
                          "config.json and *.safetensors")
  hf = json.loads(cfg_file.read_text())
  tensors = _Tensors(_weight_files(path))
  overrides = {"param_dtype": param_dtype or _dtype_of(tensors)}
  if compute_dtype:
    overrides["compute_dtype"] = compute_dtype
  cfg = from_hf_config(hf, **overrides)
  if "lm_head.weight" not in tensors and not cfg.tie_embeddings:
    cfg = cfg.replace(tie_embeddings=True)  # some exports omit the tied head
  return cfg, params_from_hf_tensors(tensors, cfg, source=str(path))


def _dtype_of(tensors: _Tensors) -> str:
  name = "model.embed_tokens.weight"
  d = tensors.dtype(name if name in tensors else next(iter(tensors)))
  return "bfloat16" if d == "BF16" else "float32"


def params_from_hf_tensors(tensors: Mapping[str, np.ndarray], cfg: ModelConfig, source=""):
  """HF-named tensors -> fr_jax params (NumPy, cfg.param_dtype). Each stacked parameter is
  one array allocated up front and filled a tensor at a time (no list of copies to stack)."""
  dtype = _np_dtype(cfg.param_dtype)
  shapes = decoder.param_shapes(cfg)

  def take(name, shape, transpose):
    """Tensor `name` in fr_jax's layout (its last two axes swapped if `transpose`), checked
    against `shape`; a view where it can be."""
    shape = tuple(shape)
    if name not in tensors:
      hf_shape = (*shape[:-2], shape[-1], shape[-2]) if transpose else shape
      raise CheckpointError(f"{source}: tensor {name!r} is missing (expected shape {hf_shape})")
    a = np.asarray(tensors[name])
    a = np.swapaxes(a, -1, -2) if transpose else a
    if a.shape != shape:
      raise CheckpointError(f"{source}: {name!r} has shape {a.shape}, config implies {shape}")
    return a

  def stacked(shape, names, transpose):
    out = np.empty(shape, dtype)
    for j, name in enumerate(names):
      out[j] = take(name, shape[1:], transpose)
    return out

  def per_layer(tree, layers):  # the base weights (a LoRA config's adapters are not HF's)
    return {k: stacked(shape, [f"model.layers.{i}.{_LAYER_NAMES[k][0]}" for i in layers],
                       _LAYER_NAMES[k][1]) for k, shape in tree.items() if k in _LAYER_NAMES}

  params = {k: np.ascontiguousarray(take(hf_name, shapes[k], False).astype(dtype, copy=False))
            for k, hf_name in _TOP_NAMES.items() if k in shapes}
  params["layers"] = per_layer(shapes["layers"], range(cfg.num_layers))
  if "moe" in shapes:
    params["moe"] = _moe_from_hf(shapes["moe"], cfg, tensors, take, dtype)
  if "mlp" in shapes:
    params["mlp"] = per_layer(shapes["mlp"], cfg.dense_layers)
  return params


def _moe_from_hf(shapes, cfg: ModelConfig, tensors, take, dtype) -> dict[str, np.ndarray]:
  """params["moe"]: routers and experts of the sparse layers, from per-expert tensors (the
  released format) or transformers 5's fused ones."""
  out = {k: np.empty(shape, dtype) for k, shape in shapes.items()}
  E, F = cfg.num_experts, cfg.moe_intermediate_size
  for j, i in enumerate(cfg.moe_layers):
    pre = f"model.layers.{i}.mlp."
    out["router"][j] = take(pre + _ROUTER_NAME, shapes["router"][1:], True)
    if pre + "experts.gate_up_proj" in tensors:
      gate_up = take(pre + "experts.gate_up_proj", (E, cfg.hidden_size, 2 * F), True)
      out["experts_gate"][j] = gate_up[..., :F]
      out["experts_up"][j] = gate_up[..., F:]
      out["experts_down"][j] = take(pre + "experts.down_proj", shapes["experts_down"][1:], True)
      continue
    for e in range(E):
      for k, hf_name in _EXPERT_NAMES.items():
        out[k][j, e] = take(f"{pre}experts.{e}.{hf_name}", shapes[k][2:], True)
  return out


def hf_leaves(cfg: ModelConfig, adapters: bool = False) -> dict:
  """How each fr_jax parameter ('/'-joined path: "embed", "layers/wq", "moe/experts_up", ...)
  maps onto HF tensors: {path: (lead, name, transpose)}. Its first `lead` axes index separate
  HF tensors, `name(indices)` is the HF name of the one at those indices, and its other axes
  are that tensor's, the last two swapped if `transpose`. In the order `iter_hf_tensors`
  yields them. With `adapters` (a model with LoRA leaves), each adapter too, under PEFT's
  name for it (`adapter_name`)."""
  out: dict = {k: (0, lambda _, n=n: n, False) for k, n in _TOP_NAMES.items()}

  def per_layer(group, layers):
    for k, (n, tr) in _LAYER_NAMES.items():
      out[f"{group}/{k}"] = (1, lambda ix, n=n: f"model.layers.{layers[ix[0]]}.{n}", tr)
      if adapters and k in cfg.lora_targets:
        for ab in ("a", "b"):  # PEFT's [r, in] and [out, r]: ours transposed
          out[f"{group}/{k}_lora_{ab}"] = (
              1, lambda ix, n=n, ab=ab: adapter_name(f"model.layers.{layers[ix[0]]}.{n}", ab),
              True)

  per_layer("layers", list(range(cfg.num_layers)))
  moe = list(cfg.moe_layers)
  out["moe/router"] = (1, lambda ix: f"model.layers.{moe[ix[0]]}.mlp.{_ROUTER_NAME}", True)
  for k, n in _EXPERT_NAMES.items():
    out[f"moe/{k}"] = (2, lambda ix, n=n: f"model.layers.{moe[ix[0]]}.mlp.experts.{ix[1]}.{n}",
                       True)
  per_layer("mlp", list(cfg.dense_layers))
  shapes = decoder.param_shapes(cfg)

  def present(path):
    node = shapes
    for p in path.split("/"):
      if not isinstance(node, dict) or p not in node:
        return False
      node = node[p]
    return True

  return {k: v for k, v in out.items() if present(k)}


def hf_blocks(layout, block, start=None):
  """(HF name, start in that tensor, NumPy block in HF layout) for a block of one fr_jax
  parameter: `block` (NumPy or a device array) at `start` (default: the whole parameter)
  in it, mapped by `layout` (an entry of `hf_leaves`). A transposed block is a view, not a
  copy; a device array comes to the host one index of its first axis at a time (one layer's
  or one sparse layer's experts)."""
  lead, name, transpose = layout
  start = (0,) * block.ndim if start is None else tuple(start)
  tail = start[lead:]
  if transpose:
    tail = (*tail[:-2], tail[-1], tail[-2])
  if lead == 0:
    a = np.asarray(block)
    yield name(()), tail, (np.swapaxes(a, -1, -2) if transpose else a)
    return
  for i in range(block.shape[0]):
    sub = np.asarray(block[i])
    for rest in np.ndindex(*block.shape[1:lead]):
      a = sub[rest]
      yield (name((start[0] + i, *(s + r for s, r in zip(start[1:lead], rest)))), tail,
             np.swapaxes(a, -1, -2) if transpose else a)


def iter_hf_tensors(params, cfg: ModelConfig):
  """(HF name, NumPy array in HF layout) for each tensor, one at a time; linear weights are
  transposed views, not copies, so a caller can convert and write them one by one. A
  Qwen3-MoE model's experts come one expert at a time, in the released checkpoints' names,
  from one sparse layer's stack on the host at a time (`hf_blocks`). LoRA adapters are
  folded into their projections first (`lora.merged`): the plain model they compute."""
  params = lora.merged(params, cfg)
  for path, layout in hf_leaves(cfg).items():
    group, _, leaf = path.rpartition("/")
    a = params[group][leaf] if group else params[leaf]
    for name, _, block in hf_blocks(layout, a):
      yield name, block


def save_hf(path, params, cfg: ModelConfig, *, tokenizer_files: dict | None = None,
            max_shard_bytes: int = 5 * 2**30) -> Path:
  """Writes config.json and safetensors (sharded with an index above `max_shard_bytes`).

  `tokenizer_files` maps file names (tokenizer.json, tokenizer_config.json, ...) to their
  text, written beside the weights so the directory is self-contained. Every file is written
  as a temporary first and renamed into place only when all are whole (`durable.write_files`):
  a full disk part-way leaves the old checkpoint untouched. Shards of an earlier export that
  this one does not write are removed last. A directory that others read while it is
  rewritten (published versions, exports) goes through `durable.write_dir` instead, which
  swaps it whole.
  """
  path = Path(path)
  tensors = {name: np.ascontiguousarray(a) for name, a in iter_hf_tensors(params, cfg)}
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
  files: dict = {}
  if len(shards) == 1:
    files["model.safetensors"] = lambda p: save_file(shards[0], str(p), metadata=meta)
  else:
    weight_map = {}
    for i, shard in enumerate(shards, 1):
      fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
      files[fname] = lambda p, s=shard: save_file(s, str(p), metadata=meta)
      weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": weight_map}
    files["model.safetensors.index.json"] = json.dumps(index, indent=2)
  files["config.json"] = json.dumps(to_hf_config(cfg), indent=2)
  files.update(tokenizer_files or {})
  stale = [p.name for p in path.glob("model*.safetensors*")] if path.is_dir() else []
  return durable.write_files(path, files, remove=stale)


def export_hf(path, params, cfg: ModelConfig, tokenizer=None) -> Path:
  """The one HF export (`Learner.export_hf`, `launch.export`): `save_hf` with the tokenizer's
  files (a `fr_jax.models.tokenizer.Tokenizer`, or None for none) beside the weights."""
  files = tokenizer.files() if tokenizer is not None else None
  return save_hf(path, params, cfg, tokenizer_files=files)


HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"
UNTIED_HEAD_FILE = "lm_head.safetensors"


def _safetensors_entry(file: Path, name: str) -> tuple[dict, bytes]:
  """(header entry {dtype, shape, data_offsets}, raw bytes) of tensor `name` in a
  safetensors file, read without converting its dtype (bf16 included)."""
  with open(file, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(n))
    if name not in header:
      raise CheckpointError(f"{file} has no tensor {name!r}")
    entry = header[name]
    start, end = entry["data_offsets"]
    f.seek(8 + n + start)
    return entry, f.read(end - start)


def untie_head(path) -> bool:
  """Makes an HF directory whose LM head is tied to the embeddings an untied one with the
  same values: `lm_head.safetensors` holds a copy of `model.embed_tokens.weight` (its dtype
  and bytes as they are), config.json says tie_word_embeddings false, and a sharded index
  names the new file. Every file is written whole (`durable.write_files`). Returns False for
  a directory that is untied already. The result is for vLLM, which reads every
  *.safetensors of a directory without an index (transformers reads model.safetensors alone
  then, and would miss the head; with an index both read it).

  Why: vLLM 0.32 on CPU packs each linear layer's weights into a kernel copy when it loads
  them; an in-place reload repacks only the layers it loads weights for, and a tied head has
  none of its own, so it kept the old weights after a reload (measured: tokens sampled from
  the new embeddings and the old head). Untied, the head is loaded and repacked like any
  other layer."""
  path = Path(path)
  config = json.loads((path / "config.json").read_text())
  if not config.get("tie_word_embeddings", False):
    return False
  index_file = path / "model.safetensors.index.json"
  index = json.loads(index_file.read_text()) if index_file.is_file() else None
  source = path / (index["weight_map"][EMBED] if index else "model.safetensors")
  entry, raw = _safetensors_entry(source, EMBED)
  head = {HEAD: {"dtype": entry["dtype"], "shape": entry["shape"],
                 "data_offsets": [0, len(raw)]}, "__metadata__": {"format": "pt"}}
  header = json.dumps(head, separators=(",", ":")).encode()
  header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
  files = {UNTIED_HEAD_FILE: len(header).to_bytes(8, "little") + header + raw,
           "config.json": json.dumps(config | {"tie_word_embeddings": False}, indent=2)}
  if index:
    index["weight_map"][HEAD] = UNTIED_HEAD_FILE
    files[index_file.name] = json.dumps(index, indent=2)
  durable.write_files(path, files)
  return True


# --- PEFT adapters ---------------------------------------------------------------------------

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def adapter_name(weight: str, ab: str) -> str:
  """PEFT's name for the A ("a") or B ("b") factor of the adapter on HF tensor `weight`
  ("model.layers.0.self_attn.q_proj.weight" -> "base_model.model.model.layers.0.self_attn
  .q_proj.lora_A.weight")."""
  return f"{_PEFT_PREFIX}{weight.removesuffix('.weight')}.lora_{ab.upper()}.weight"


def adapted_weight(name: str) -> tuple[str, str] | None:
  """(the HF tensor it adapts, "a" or "b") for a PEFT adapter name; None for any other."""
  for ab in ("a", "b"):
    suffix = f".lora_{ab.upper()}.weight"
    if name.startswith(_PEFT_PREFIX) and name.endswith(suffix):
      return name[len(_PEFT_PREFIX):-len(suffix)] + ".weight", ab
  return None


def save_peft(path, params, cfg: ModelConfig, *, base_model: str = "") -> Path:
  """Writes the LoRA adapters of `params` as a PEFT adapter directory (adapter_config.json,
  adapter_model.safetensors) that `peft.PeftModel.from_pretrained` loads onto the base model
  (the HF export of the same params without adapters: `save_hf` of `lora.split`'s frozen
  part). PEFT's lora_A.weight is [r, in] and lora_B.weight [out, r]: ours transposed.
  Written whole or not at all (`durable.write_files`)."""
  if not cfg.lora_rank or not lora.has_adapters(params):
    raise ValueError("these params have no LoRA adapters (model.lora.rank = 0): export them "
                     "with --format=hf")
  tensors = {}
  for where, layout in hf_leaves(cfg, adapters=True).items():
    group, _, leaf = where.rpartition("/")
    if lora.is_adapter(leaf) and leaf in params.get(group, {}):
      for name, _, block in hf_blocks(layout, params[group][leaf]):
        tensors[name] = np.ascontiguousarray(block)
  config = peft_config(cfg.lora_rank, cfg.lora_alpha,
                       [LORA_TARGETS[t] for t in cfg.lora_targets], base_model)
  files = {PEFT_WEIGHTS: lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
           PEFT_CONFIG: json.dumps(config, indent=2)}
  return durable.write_files(Path(path), files)


def peft_config(rank: int, alpha: float, modules, base_model: str = "") -> dict:
  """PEFT's adapter_config.json for LoRA factors of `rank` and `alpha` on the HF modules
  `modules` ("q_proj", ...)."""
  return {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
      "r": int(rank), "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
      "target_modules": sorted(set(modules)), "fan_in_fan_out": False, "use_rslora": False,
      "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
      "inference_mode": True,
  }
