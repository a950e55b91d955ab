"""Tokenizers through the `tokenizers` library, from `tokenizer.json` or built from a GGUF's
vocabulary and merges, and chat templates (the model's own Jinja template, or plain ChatML).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from pathlib import Path

import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from fr_jax.models.hf_io import CheckpointError

# GGUF token types (llama.cpp): 3 = control, 4 = user-defined; both are matched whole.
_SPECIAL_TYPES = (3, 4)

# Pre-tokenizer split patterns, by GGUF `tokenizer.ggml.pre`.
_QWEN2_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
              r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str):
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in ("gpt2", "gpt-2", "default", None):  # llama.cpp spells GPT-2's "gpt-2"
    return byte_level
  if pre == "smollm":
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  if pre in ("qwen2", "llama-bpe"):
    pat = _QWEN2_PAT if pre == "qwen2" else _LLAMA3_PAT
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pat), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  raise CheckpointError(f"GGUF tokenizer pre-type {pre!r} is not supported "
                        "(supported: gpt2, smollm, qwen2, llama-bpe)")


def _bytes_to_unicode() -> dict[str, int]:
  """GPT-2's byte <-> printable-character table (character -> byte)."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
          *range(ord("\xae"), ord("\xff") + 1)]
  others = [b for b in range(256) if b not in keep]  # shifted past 255, in byte order
  return {**{chr(b): b for b in keep}, **{chr(256 + n): b for n, b in enumerate(others)}}


_BYTE_OF = _bytes_to_unicode()

CHATML_DEFAULT = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                  "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


class Tokenizer:
  """Text <-> token ids, special tokens and chat templates for one model."""

  def __init__(self, tok: tokenizers.Tokenizer, *, chat_template: str | None = None,
               bos_token: str | None = None, eos_token: str | None = None,
               add_bos: bool = False):
    self.tok = tok
    self._plain_tok: tokenizers.Tokenizer | None = None
    self._plain_lock = threading.Lock()
    self._added_cache: tuple | None = None
    self.chat_template = chat_template
    self.bos_token, self.eos_token, self.add_bos = bos_token, eos_token, add_bos

  # --- construction ---
  @classmethod
  def from_file(cls, path) -> Tokenizer:
    """From a HF directory (or a tokenizer.json path); reads tokenizer_config.json if present."""
    path = Path(path)
    tj = path / "tokenizer.json" if path.is_dir() else path
    if not tj.exists():
      raise CheckpointError(f"{tj} not found")
    tok = tokenizers.Tokenizer.from_file(str(tj))
    conf_file = tj.parent / "tokenizer_config.json"
    conf = json.loads(conf_file.read_text()) if conf_file.exists() else {}

    def content(x):
      return x.get("content") if isinstance(x, dict) else x

    template = conf.get("chat_template")
    jinja_file = tj.parent / "chat_template.jinja"
    if template is None and jinja_file.exists():
      template = jinja_file.read_text()
    return cls(tok, chat_template=template, bos_token=content(conf.get("bos_token")),
               eos_token=content(conf.get("eos_token")),
               add_bos=bool(conf.get("add_bos_token", False)))

  @classmethod
  def from_gguf(cls, reader) -> Tokenizer:
    """Builds a byte-level BPE tokenizer from a GGUF reader's vocabulary and merges."""
    f = lambda k, d=None: (reader.fields[k].contents() if k in reader.fields else d)  # noqa: E731
    model = f("tokenizer.ggml.model")
    if model != "gpt2":
      raise CheckpointError(f"GGUF tokenizer model {model!r} is not supported (only gpt2 BPE)")
    tokens = f("tokenizer.ggml.tokens")
    types = f("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in f("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = _pre_tokenizer(f("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty in _SPECIAL_TYPES]
    tok.add_special_tokens(special)
    bos, eos = f("tokenizer.ggml.bos_token_id"), f("tokenizer.ggml.eos_token_id")
    return cls(tok, chat_template=f("tokenizer.chat_template"),
               bos_token=tokens[bos] if bos is not None else None,
               eos_token=tokens[eos] if eos is not None else None,
               add_bos=bool(f("tokenizer.ggml.add_bos_token", False)))

  @classmethod
  def byte_level(cls) -> Tokenizer:
    """A self-contained byte-level tokenizer: the 256 bytes plus the ChatML specials
    <|endoftext|>, <|im_start|>, <|im_end|> (ids 256-258). For tiny test models that need
    real text in and out (agent loops, smoke runs) without any downloaded vocabulary."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _BYTE_OF[ch])
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    return cls(tok, chat_template=CHATML_DEFAULT, eos_token="<|im_end|>")

  # --- ids ---
  @property
  def vocab_size(self) -> int:
    return self.tok.get_vocab_size(with_added_tokens=True)

  def token_id(self, token: str) -> int | None:
    return self.tok.token_to_id(token)

  @property
  def eos_id(self) -> int | None:
    return None if self.eos_token is None else self.token_id(self.eos_token)

  def stop_ids(self) -> list[int]:
    """Ids that end a model turn: eos and, for ChatML models, <|im_end|>."""
    ids = {self.eos_id, self.token_id("<|im_end|>"), self.token_id("<|endoftext|>")}
    return sorted(i for i in ids if i is not None)

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    """Token ids; special tokens written in the text (e.g. <|im_start|>) map to their ids."""
    ids = self.tok.encode(text, add_special_tokens=False).ids
    if (self.add_bos if add_bos is None else add_bos) and self.bos_token is not None:
      ids = [self.token_id(self.bos_token)] + ids
    return ids

  def encode_pieces(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
    """Ids for text assembled from trusted pieces (the chat template: added tokens written in
    them, such as <|im_start|> or Qwen's <tool_response>, become their ids) and untrusted ones
    (tool output, environment observations: every added token, special or not, stays the
    characters it is written with, so model-written code cannot forge a turn). Text between
    two added tokens is tokenized as one run across pieces, so an untrusted piece holding no
    added-token string encodes exactly as `encode` of the joined text would."""
    added = self._added()
    runs: list = []
    text: list[str] = []
    for piece, trusted in pieces:
      if not trusted or added[0] is None:
        text.append(piece)
        continue
      pos = 0
      for m in added[0].finditer(piece):
        text.append(piece[pos:m.start()])
        runs += ["".join(text), added[1][m.group(0)]]
        text, pos = [], m.end()
      text.append(piece[pos:])
    runs.append("".join(text))
    plain = self._plain()
    ids: list[int] = []
    for r in runs:
      if isinstance(r, int):
        ids.append(r)
      elif r:
        ids += plain.encode(r, add_special_tokens=False).ids
    return ids

  def encode_text(self, text: str) -> list[int]:
    """Untrusted text alone: no added token is recognised in it."""
    return self.encode_pieces([(text, False)])

  def _added(self):
    """(a pattern matching any added token's text, longest first; text -> id)."""
    if self._added_cache is None:
      table = {t.content: i for i, t in self.tok.get_added_tokens_decoder().items()}
      pat = (re.compile("|".join(re.escape(t) for t in sorted(table, key=len, reverse=True)))
             if table else None)
      self._added_cache = (pat, table)
    return self._added_cache

  def _plain(self) -> tokenizers.Tokenizer:
    """The same normaliser, pre-tokenizer and model with no added tokens."""
    with self._plain_lock:
      if self._plain_tok is None:
        spec = json.loads(self.tok.to_str())
        spec["added_tokens"] = []
        self._plain_tok = tokenizers.Tokenizer.from_str(json.dumps(spec))
      return self._plain_tok

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

  # --- chat ---
  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                          **extra) -> str:
    """Renders `messages` with the model's own template (plain ChatML if it has none)."""
    return render_template(self.chat_template or CHATML_DEFAULT, messages,
                           add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                           **extra)

  def chatml(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """Plain ChatML with no implied default system turn."""
    return render_template(CHATML_DEFAULT, messages,
                           add_generation_prompt=add_generation_prompt)

  def files(self) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json texts, for a self-contained HF export."""
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": self.add_bos,
            "bos_token": self.bos_token, "eos_token": self.eos_token,
            "chat_template": self.chat_template}
    return {"tokenizer.json": self.tok.to_str(),
            "tokenizer_config.json": json.dumps(conf, indent=2)}


def _raise(msg):
  raise jinja2.exceptions.TemplateError(msg)


def render_template(template: str, messages, **kw) -> str:
  """Renders a HF-style chat template in a sandbox (trim_blocks, lstrip_blocks, tojson)."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
      x, indent=indent, ensure_ascii=ensure_ascii)
  env.globals["raise_exception"] = _raise
  return env.from_string(template).render(messages=messages, **kw)
