"""GGUF import and export with the `gguf` package.

Import (`load_gguf`): metadata -> ModelConfig, tensors dequantized to float32, and the rope
permutation that llama.cpp's converter applies to Llama Q/K undone.

Export (`save_gguf`) is its exact inverse: the same tensor names, the Llama Q/K rows
permuted back, and every metadata key `config_from_gguf` reads, plus what llama.cpp (and so
Ollama) needs to run the file: `{arch}.rope.dimension_count`, `general.file_type`, and the
tokenizer (`tokenizer.ggml.*`, `tokenizer.chat_template`). The tokenizer is copied from the
GGUF the model came from (`tokenizer_kv_from_gguf`) or built from a byte-level BPE
`tokenizers` tokenizer (`tokenizer_kv_from_tokenizer`); the token list is padded with unused
`[PAD{i}]` entries to the embedding's rows, as llama.cpp's converter does, and bos/eos are the
config's ids where it has them (else the tokenizer's). Pre-tokenizers get llama.cpp's names
(GPT-2's is "gpt-2"), which `Tokenizer.from_gguf` reads back as well. Tensors are
written one at a time (the header first, from shapes alone), so an export holds one converted
tensor beside the parameters. Types: f32; f16 (1-D tensors stay f32, as llama.cpp's
converter keeps them); q8_0 (2-D tensors whose rows are whole 32-blocks; other 2-D tensors
f16, 1-D f32).

llama.cpp stores Llama q/k rows interleaved for its rope kernel: per head, HF row
(j, half h) goes to row 2j + h. Qwen2/Qwen3 GGUFs use the NeoX layout and are not permuted.

Qwen3-MoE (llama.cpp's `qwen3moe`, experts stacked in `ffn_*_exps` tensors) is refused both
ways with one line that points to the Hugging Face format.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import numpy as np
from gguf.gguf_writer import GGUFValue

from fr_jax import durable
from fr_jax.models.config import ModelConfig
from fr_jax.models.hf_io import CheckpointError, iter_hf_tensors, params_from_hf_tensors

log = logging.getLogger("fr_jax.models.gguf_io")

_ARCH_FAMILY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# GGUF tensor name (after "blk.{i}.") -> HF name (after "model.layers.{i}.")
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute` for q/k weights [n_heads * head_dim, in] (or biases)."""
  hd = w.shape[0] // n_heads
  return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's permutation (HF layout -> GGUF layout); for tests and writers."""
  hd = w.shape[0] // n_heads
  return w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f32_decimal(x) -> float:
  """GGUF stores floats as f32: 1e-5 reads back as 9.99999974e-06. Recover the shortest
  decimal that rounds to the same f32 (what the original HF config said)."""
  return float(str(np.float32(x)))


def _field(reader, key, default=None):
  f = reader.fields.get(key)
  return default if f is None else f.contents()


_MOE_REFUSAL = ("llama.cpp's qwen3moe GGUF tensor layout (stacked ffn_*_exps experts) is not "
                 "supported here")


def config_from_gguf(reader, **overrides) -> ModelConfig:
  arch = _field(reader, "general.architecture")
  if arch == "qwen3moe":
    raise CheckpointError(f"GGUF architecture 'qwen3moe': {_MOE_REFUSAL}; import the Hugging "
                          "Face checkpoint (hf:DIR) instead")
  if arch not in _ARCH_FAMILY:
    raise CheckpointError(f"GGUF architecture {arch!r} is not supported ({sorted(_ARCH_FAMILY)})")
  if any(t.name == "rope_freqs.weight" for t in reader.tensors):
    raise CheckpointError("this GGUF carries rope_freqs (Llama-3.1 rope scaling); import the "
                          "Hugging Face checkpoint instead")
  g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
  H = int(g("attention.head_count"))
  D = int(g("embedding_length"))
  names = {t.name for t in reader.tensors}
  vocab = g("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
  kw = dict(
      family=_ARCH_FAMILY[arch], vocab_size=int(vocab), hidden_size=D,
      intermediate_size=int(g("feed_forward_length")), num_layers=int(g("block_count")),
      num_heads=H, num_kv_heads=int(g("attention.head_count_kv", H)),
      head_dim=int(g("attention.key_length", D // H)),
      rope_theta=_f32_decimal(g("rope.freq_base", 10000.0)),
      rms_norm_eps=_f32_decimal(g("attention.layer_norm_rms_epsilon", 1e-6)),
      tie_embeddings="output.weight" not in names,
      qkv_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
      max_position_embeddings=int(g("context_length", 8192)),
      bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
      eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
  )
  kw.update(overrides)
  return ModelConfig(**kw)


def load_gguf(path, *, param_dtype: str = "float32", compute_dtype: str = "float32"):
  """Reads a GGUF file. Returns (ModelConfig, params of NumPy arrays, reader)."""
  path = Path(path)
  if not path.is_file():
    raise CheckpointError(f"GGUF file {path} not found")
  try:
    reader = gguf.GGUFReader(str(path))
  except Exception as e:  # the gguf package raises assorted errors on a bad file
    raise CheckpointError(f"{path} is not a readable GGUF file: {e}") from e
  cfg = config_from_gguf(reader, param_dtype=param_dtype, compute_dtype=compute_dtype)
  permuted = cfg.family == "llama"
  tensors = {}
  for t in reader.tensors:
    a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    if t.name in _TOP:
      name = _TOP[t.name]
    elif t.name.startswith("blk."):
      _, i, rest = t.name.split(".", 2)
      if rest not in _LAYER:
        raise CheckpointError(f"{path}: unexpected tensor {t.name!r}")
      name = f"model.layers.{i}.{_LAYER[rest]}"
      if permuted and rest.startswith(("attn_q.", "attn_k.")):
        heads = cfg.num_heads if rest.startswith("attn_q.") else cfg.num_kv_heads
        a = unpermute_rope(a, heads)
    else:
      raise CheckpointError(f"{path}: unexpected tensor {t.name!r}")
    tensors[name] = a
  params = params_from_hf_tensors(tensors, cfg, source=str(path))
  return cfg, params, reader


# --- export ------------------------------------------------------------------------------------

GGUF_DTYPES = ("f32", "f16", "q8_0")
_FILE_TYPE = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
_GGUF_OF_HF = {**{hf: g for g, hf in _TOP.items()},
               **{f"layer.{hf}": g for g, hf in _LAYER.items()}}
_T = gguf.GGMLQuantizationType
_V = gguf.GGUFValueType


def _gguf_name(hf_name: str) -> str:
  if hf_name.startswith("model.layers."):
    i, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{i}.{_GGUF_OF_HF[f'layer.{rest}']}"
  return _GGUF_OF_HF[hf_name]


def _tensor_type(shape, dtype: str):
  """llama.cpp's converter's choice: 1-D tensors (norms, biases) stay f32; q8_0 needs rows of
  whole 32-value blocks and falls back to f16 for others."""
  if dtype == "f32" or len(shape) == 1:
    return _T.F32
  block, _ = gguf.GGML_QUANT_SIZES[_T.Q8_0]
  return _T.Q8_0 if dtype == "q8_0" and shape[-1] % block == 0 else _T.F16


def _encode(a: np.ndarray, qtype) -> np.ndarray:
  a = np.ascontiguousarray(a, np.float32)
  if qtype == _T.F32:
    return a
  if qtype == _T.F16:
    return a.astype(np.float16)
  return gguf.quants.quantize(a, qtype)


def check_gguf_exportable(cfg: ModelConfig) -> None:
  """Raises CheckpointError for what `load_gguf` (and so this writer) cannot represent."""
  if cfg.is_moe:
    raise CheckpointError(f"family {cfg.family!r}: {_MOE_REFUSAL}; export --format=hf")
  if cfg.family not in _ARCH_FAMILY.values():
    raise CheckpointError(f"family {cfg.family!r} has no GGUF architecture here "
                          f"({sorted(_ARCH_FAMILY)}); export --format=hf")
  if cfg.rope_llama3 is not None:
    raise CheckpointError(f"rope_llama3={cfg.rope_llama3}: Llama-3 rope scaling goes in GGUF "
                          "as a rope_freqs tensor, which fr_jax does not read or write; "
                          "export --format=hf")
  if cfg.o_bias or cfg.mlp_bias:
    raise CheckpointError(f"o_bias={cfg.o_bias}, mlp_bias={cfg.mlp_bias}: output-projection "
                          "and MLP biases have no GGUF tensor names here; export --format=hf")


def tokenizer_kv_from_gguf(reader) -> dict[str, GGUFValue]:
  """Every `tokenizer.*` field of a GGUF (vocabulary, merges, token types, special ids, chat
  template), with its stored types, for `save_gguf`."""
  out = {}
  for key, f in reader.fields.items():
    if key.startswith("tokenizer."):
      vtype = _V(f.types[0])
      sub = _V(f.types[-1]) if vtype == _V.ARRAY else None
      out[key] = GGUFValue(f.contents(), vtype, sub)
  return out


def _pre_semantics(node):
  """The parts of a `tokenizers` pre-tokenizer spec that change how text is split."""
  if not isinstance(node, dict):
    return node
  keep = ("type", "use_regex", "add_prefix_space", "individual_digits", "pattern",
          "behavior", "invert")
  out = {k: node[k] for k in keep if k in node}
  if "pretokenizers" in node:
    out["pretokenizers"] = [_pre_semantics(p) for p in node["pretokenizers"]]
  return out


# fr_jax's pre-tokenizer names (`tokenizer._pre_tokenizer`) -> llama.cpp's `tokenizer.ggml.pre`
# (llama.cpp spells GPT-2's "gpt-2"; fr_jax's reader takes both spellings).
_LLAMA_CPP_PRE = {"gpt2": "gpt-2", "smollm": "smollm", "qwen2": "qwen2",
                  "llama-bpe": "llama-bpe"}


def _gguf_pre(spec: dict | None, has_merges: bool) -> str:
  """The `tokenizer.ggml.pre` whose splitting is `spec`'s: the llama.cpp name of the fr_jax
  pre-tokenizer (`tokenizer._pre_tokenizer`) that serialises to the same splitting rules."""
  import tokenizers

  from fr_jax.models import tokenizer as toklib
  want = _pre_semantics(spec)
  for name, llama_cpp_name in _LLAMA_CPP_PRE.items():
    t = tokenizers.Tokenizer(tokenizers.models.BPE())
    t.pre_tokenizer = toklib._pre_tokenizer(name)
    if _pre_semantics(json.loads(t.to_str())["pre_tokenizer"]) == want:
      return llama_cpp_name
  if not has_merges and want == {"type": "ByteLevel", "use_regex": False,
                                 "add_prefix_space": False}:
    # With no merges every byte is its own token however text is split; "default" is a
    # name both llama.cpp and fr_jax's reader accept.
    return "default"
  raise CheckpointError(f"pre-tokenizer {json.dumps(spec)[:300]} is not one fr_jax maps to a "
                        f"llama.cpp pre-type ({', '.join(_LLAMA_CPP_PRE)}); "
                        "export --format=hf")


def tokenizer_kv_from_tokenizer(tok) -> dict[str, GGUFValue]:
  """GGUF tokenizer fields for a byte-level BPE tokenizer (a `fr_jax.models.tokenizer.
  Tokenizer`), the inverse of `Tokenizer.from_gguf`: token types 3 (control) for special
  added tokens, 4 (user-defined) for other added tokens, 1 for the rest."""
  spec = json.loads(tok.tok.to_str())
  model = spec.get("model") or {}
  if model.get("type") != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
    raise CheckpointError(f"tokenizer model {model.get('type')!r} with decoder "
                          f"{(spec.get('decoder') or {}).get('type')!r}: only byte-level BPE "
                          "(GPT-2 style) tokenizers can be written to GGUF; export --format=hf")
  norm = (spec.get("normalizer") or {}).get("type")
  if norm not in (None, "NFC"):
    raise CheckpointError(f"tokenizer normalizer {norm!r} has no llama.cpp equivalent; "
                          "export --format=hf")
  merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
  ids = dict(model["vocab"])
  types = {i: 1 for i in ids.values()}
  for a in spec.get("added_tokens", []):
    ids[a["content"]] = a["id"]
    types[a["id"]] = 3 if a.get("special") else 4
  n = max(ids.values()) + 1
  tokens = [f"[PAD{i}]" for i in range(n)]
  type_list = [int(gguf.TokenType.UNUSED)] * n
  for t, i in ids.items():
    tokens[i], type_list[i] = t, types[i]
  out = {"tokenizer.ggml.model": GGUFValue("gpt2", _V.STRING),
         "tokenizer.ggml.pre": GGUFValue(_gguf_pre(spec.get("pre_tokenizer"), bool(merges)),
                                         _V.STRING),
         "tokenizer.ggml.tokens": GGUFValue(tokens, _V.ARRAY, _V.STRING),
         "tokenizer.ggml.token_type": GGUFValue(type_list, _V.ARRAY, _V.INT32),
         "tokenizer.ggml.merges": GGUFValue(merges, _V.ARRAY, _V.STRING),
         "tokenizer.ggml.add_bos_token": GGUFValue(bool(tok.add_bos), _V.BOOL)}
  for key, token in (("bos", tok.bos_token), ("eos", tok.eos_token)):
    if token is not None and tok.token_id(token) is not None:
      out[f"tokenizer.ggml.{key}_token_id"] = GGUFValue(tok.token_id(token), _V.UINT32)
  if tok.chat_template:
    out["tokenizer.chat_template"] = GGUFValue(tok.chat_template, _V.STRING)
  return out


def _fit_vocab(kv: dict[str, GGUFValue], cfg: ModelConfig) -> dict[str, GGUFValue]:
  """Pads the token list to the embedding's rows (llama.cpp sizes its vocabulary by the list)
  and sets the config's bos/eos ids where it has them (what `config_from_gguf` reads back)."""
  kv = dict(kv)
  if "tokenizer.ggml.tokens" not in kv:
    raise CheckpointError("the tokenizer fields have no tokenizer.ggml.tokens")
  tokens = list(kv["tokenizer.ggml.tokens"].value)
  V = cfg.vocab_size
  if len(tokens) > V:
    raise CheckpointError(f"the tokenizer has {len(tokens)} tokens but the model's embedding "
                          f"has {V} rows: this tokenizer is not the model's")
  types = list(kv.get("tokenizer.ggml.token_type", GGUFValue([1] * len(tokens), _V.ARRAY,
                                                             _V.INT32)).value)
  pad = range(len(tokens), V)
  kv["tokenizer.ggml.tokens"] = GGUFValue(tokens + [f"[PAD{i}]" for i in pad], _V.ARRAY,
                                          _V.STRING)
  kv["tokenizer.ggml.token_type"] = GGUFValue(types + [int(gguf.TokenType.UNUSED)] * len(pad),
                                              _V.ARRAY, _V.INT32)
  for key, i in (("bos", cfg.bos_token_id), ("eos", cfg.eos_token_id)):
    if i is not None:
      kv[f"tokenizer.ggml.{key}_token_id"] = GGUFValue(int(i), _V.UINT32)
  return kv


class _Writer(gguf.GGUFWriter):
  """GGUFWriter that also writes empty arrays (a byte-level tokenizer has no merges, and
  llama.cpp requires the key); the gguf package refuses them."""

  def _pack_val(self, val, vtype, add_vtype, sub_type=None):
    if vtype == _V.ARRAY and sub_type is not None and len(val) == 0:
      return ((self._pack("I", vtype) if add_vtype else b"") + self._pack("I", sub_type)
              + self._pack("Q", 0))
    return super()._pack_val(val, vtype, add_vtype, sub_type)


def save_gguf(path, params, cfg: ModelConfig, tokenizer_kv: dict[str, GGUFValue], *,
              dtype: str = "f32", name: str = "") -> Path:
  """Writes `params` (fr_jax layout, NumPy or JAX, any float dtype) as one GGUF file that
  `load_gguf` and llama.cpp read. `tokenizer_kv` comes from `tokenizer_kv_from_gguf` or
  `tokenizer_kv_from_tokenizer`. The file is written under a temporary name and renamed."""
  if dtype not in GGUF_DTYPES:
    raise CheckpointError(f"GGUF dtype {dtype!r}: choose one of {GGUF_DTYPES}")
  check_gguf_exportable(cfg)
  path = Path(path)
  arch = next(a for a, fam in _ARCH_FAMILY.items() if fam == cfg.family)
  w = _Writer(None, arch)
  if name:
    w.add_name(name)
  w.add_file_type(int(_FILE_TYPE[dtype]))
  if dtype == "q8_0":
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
  for add, value in ((w.add_vocab_size, cfg.vocab_size),
                     (w.add_context_length, cfg.max_position_embeddings),
                     (w.add_embedding_length, cfg.hidden_size), (w.add_block_count, cfg.num_layers),
                     (w.add_feed_forward_length, cfg.intermediate_size),
                     (w.add_head_count, cfg.num_heads), (w.add_head_count_kv, cfg.num_kv_heads),
                     (w.add_key_length, cfg.head_dim), (w.add_value_length, cfg.head_dim),
                     (w.add_rope_dimension_count, cfg.head_dim),
                     (w.add_rope_freq_base, cfg.rope_theta),
                     (w.add_layer_norm_rms_eps, cfg.rms_norm_eps)):
    add(value)
  for key, v in _fit_vocab(tokenizer_kv, cfg).items():
    w.add_key_value(key, v.value, v.type, v.sub_type)

  permuted = cfg.family == "llama"

  def gguf_tensors():
    """(GGUF name, HF-layout array view, rows permuted as llama.cpp stores them)."""
    for hf_name, a in iter_hf_tensors(params, cfg):
      g = _gguf_name(hf_name)
      rest = g.split(".", 2)[-1]
      if permuted and rest.startswith(("attn_q.", "attn_k.")):
        a = permute_rope(a, cfg.num_heads if rest.startswith("attn_q.") else cfg.num_kv_heads)
      yield g, a

  for g, a in gguf_tensors():  # the header: names, shapes, types and sizes, nothing converted
    qtype = _tensor_type(a.shape, dtype)
    nbytes = int(np.prod(gguf.quants.quant_shape_to_byte_shape(a.shape, qtype)))
    # raw_dtype sets the stored type; the array dtype only matters for uint8 (raw bytes)
    w.add_tensor_info(g, a.shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
  def write(tmp):
    try:
      w.write_header_to_file(tmp)
      w.write_kv_data_to_file()
      w.write_ti_data_to_file()
      n = len(w.tensors[0])
      for k, (_name, a) in enumerate(gguf_tensors(), 1):
        w.write_tensor_data(_encode(a, _tensor_type(a.shape, dtype)))
        if k % 50 == 0 or k == n:
          log.info("GGUF %s: %d/%d tensors written", dtype, k, n)
    finally:
      w.close()

  durable.write_file(path, write)
  log.info("wrote %s (%.1f MB, %s)", path, path.stat().st_size / 1e6, dtype)
  return path
