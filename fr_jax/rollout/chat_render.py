"""Requests to the OpenAI-compatible gateway, read and rendered: messages in one canonical
form, tools, sampling parameters, and the chat template's rendering with the agent's texts
and the gateway's own replies marked (`fr_jax.rollout.gateway` uses it to feed only the new
turns of an episode; see its docstring).

Marks are private-use characters: `\ue000N\ue001` stands for the agent's N-th text (numbered
in the order the texts appear, so a conversation's earlier turns render to the same marked
text whatever follows them), `\ue002I\ue003` for the gateway's reply at message I. Encoding a
marked text splits it there: the template's own text is trusted (special tokens written in it
are tokens), the agent's texts untrusted (`Tokenizer.encode_pieces`). `Rendered.exact` says
whether the template renders the real texts as it renders their marks (a template that reads
them, say to strip reasoning, does not).
"""

from __future__ import annotations

import dataclasses
import json
import re

from fr_jax.rollout import tool_formats

_TEXT = re.compile("\ue000(\\d+)\ue001")  # an agent's text, by number
ROLES = ("system", "user", "assistant", "tool")


def _text_mark(i: int) -> str:
  return f"\ue000{i}\ue001"


def reply_mark(i: int) -> str:
  return f"\ue002{i}\ue003"


class GatewayError(Exception):
  """A refused call: HTTP status, a named reason (the OpenAI error `code`) and a message."""

  def __init__(self, status: int, code: str, message: str):
    super().__init__(message)
    self.status, self.code = status, code


def bad_request(message: str, code: str = "invalid_request") -> GatewayError:
  return GatewayError(400, code, message)


# --- requests: messages, tools and sampling parameters ---

def _content(m: dict, i: int) -> str:
  c = m.get("content")
  if c is None:
    return ""
  if isinstance(c, str):
    return c
  if isinstance(c, list):  # content parts: text only
    out = []
    for p in c:
      if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
        raise bad_request(f"messages[{i}]: only text content parts are supported")
      out.append(p["text"])
    return "".join(out)
  raise bad_request(f"messages[{i}].content must be a string, a list of text parts or null")


def canonical_arguments(text) -> str:
  """A call's arguments in one canonical JSON text (two spellings of one object compare
  equal); text that is not JSON stays as it is."""
  if not isinstance(text, str):
    raise bad_request("a tool call's function.arguments must be a string")
  try:
    return json.dumps(json.loads(text), sort_keys=True, ensure_ascii=False)
  except (ValueError, RecursionError):
    return text


def normalize_messages(raw, max_messages: int) -> list[dict]:
  """The request's messages in one canonical form: role, text content, and for assistant
  turns their calls as (name, arguments) pairs. Fields the gateway does not read (ids,
  `refusal`, `annotations`, ...) are dropped, so a message the agent echoes back as the
  client library returned it compares equal to the reply it got."""
  if not isinstance(raw, list) or not raw:
    raise bad_request("messages must be a non-empty list")
  if len(raw) > max_messages:
    raise bad_request(f"{len(raw)} messages (at most {max_messages})")
  out = []
  for i, m in enumerate(raw):
    if not isinstance(m, dict):
      raise bad_request(f"messages[{i}] must be an object")
    role = "system" if m.get("role") == "developer" else m.get("role")
    if role not in ROLES:
      raise bad_request(f"messages[{i}].role={m.get('role')!r}: use one of {ROLES}")
    n = {"role": role, "content": _content(m, i)}
    calls = m.get("tool_calls") if role == "assistant" else None
    if calls:
      if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list")
      pairs = []
      for c in calls:
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str)):
          raise bad_request(f"messages[{i}].tool_calls: each needs function.name")
        pairs.append([f["name"], canonical_arguments(f.get("arguments", "{}"))])
      n["tool_calls"] = pairs
    out.append(n)
  if out[-1]["role"] == "assistant":
    raise bad_request("the last message is an assistant turn; the gateway writes that one")
  return out


def normalize_tools(body: dict) -> list | None:
  tools = body.get("tools")
  if not tools or body.get("tool_choice") == "none":
    return None
  if not isinstance(tools, list) or not all(
      isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
      and isinstance(t["function"].get("name"), str) for t in tools):
    raise bad_request("tools must be a list of "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}")
  return tools


@dataclasses.dataclass(frozen=True)
class Sampling:
  max_tokens: int | None
  temperature: float
  top_p: float
  stop: tuple[str, ...]
  seed: int | None
  logprobs: bool


def sampling(body: dict, max_stop: int) -> Sampling:
  """The call's sampling parameters, checked (OpenAI's names and defaults)."""
  if body.get("n", 1) != 1:
    raise bad_request("n must be 1: one rollout per call")

  def number(key, default, lo, hi):
    v = body.get(key)
    if v is None:
      return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
      raise bad_request(f"{key}={v!r} must be a number in [{lo}, {hi}]")
    return float(v)

  mt = body.get("max_completion_tokens", body.get("max_tokens"))
  if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
    raise bad_request(f"max_tokens={mt!r} must be a positive integer")
  stop = body.get("stop") or ()
  stop = (stop,) if isinstance(stop, str) else stop
  if not (isinstance(stop, (list, tuple)) and len(stop) <= max_stop
          and all(isinstance(s, str) and 0 < len(s) <= 256 for s in stop)):
    raise bad_request(f"stop must be a string or a list of at most {max_stop} non-empty strings")
  seed = body.get("seed")
  if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
    raise bad_request(f"seed={seed!r} must be an integer")
  top_p = number("top_p", 1.0, 0.0, 1.0)
  if top_p == 0:
    raise bad_request("top_p must be in (0, 1]")
  return Sampling(mt, number("temperature", 1.0, 0.0, 2.0), top_p, tuple(stop),
                  None if seed is None else seed % 2**32, bool(body.get("logprobs")))


# --- rendering: the chat template, with the agent's texts and the gateway's replies marked ---

@dataclasses.dataclass
class Rendered:
  text: str  # the template's output; agent texts as _text_mark, gateway replies as reply_mark
  texts: list[str]  # the agent's texts, by mark number
  exact: bool  # the template renders the real texts as it renders their marks


class Renderer:
  """Renders conversations with a tokenizer's chat template and a tool format."""

  def __init__(self, tok, tool_format: str = "auto"):
    self.tok = tok
    template = tok.chat_template
    if tool_format == "auto":
      self.fmt = tool_formats.detect(template)
    elif tool_format == "none":
      self.fmt = None
    elif tool_format in tool_formats.FORMATS:
      self.fmt = tool_format
    else:
      raise ValueError(f"tool_format={tool_format!r}: use auto, none or one of "
                       f"{tool_formats.FORMATS}")
    # The template writes tools itself only if it renders them and writes this format.
    self.native = (self.fmt is not None and tool_formats.renders_tools(template)
                   and tool_formats.detect(template) == self.fmt)

  def _plain(self, msgs: list[dict], tools, texts: list[str], replies) -> list[dict]:
    """msgs as the template gets them: texts marked, replies as sentinels, and (for a template
    that does not render tools) tools, calls and results written by the format."""
    def mark(s: str) -> str:
      texts.append(s)
      return _text_mark(len(texts) - 1)

    out: list[dict] = []
    wrap = tool_formats.result_wrap(self.fmt) if self.fmt and not self.native else None
    for i, m in enumerate(msgs):
      if i in replies:
        out.append({"role": "assistant", "content": reply_mark(i)})
        continue
      if m["role"] == "tool" and wrap is not None:
        role, before, after, between = wrap
        piece = before + mark(m["content"]) + after
        if out and out[-1].get("_results"):
          out[-1]["content"] += between + piece
        else:
          out.append({"role": role, "content": piece, "_results": True})
        continue
      content = mark(m["content"]) if m["content"] else ""
      n = {"role": m["role"], "content": content}
      if m.get("tool_calls"):
        if self.native:
          n["tool_calls"] = [{"type": "function", "function": {"name": a, "arguments": _obj(b)}}
                             for a, b in m["tool_calls"]]
        elif self.fmt:
          calls = mark(tool_formats.write_calls(self.fmt, m["tool_calls"]))
          n["content"] = content + ("\n" if content else "") + calls
      out.append(n)
    if tools and not self.native:
      spec = mark(tool_formats.describe(self.fmt, tools))
      if out and out[0]["role"] == "system":
        out[0]["content"] += ("\n\n" if out[0]["content"] else "") + spec
      else:
        out.insert(0, {"role": "system", "content": spec})
    # Number the texts in the order they appear, so that a conversation's earlier turns
    # render to the same marked text whatever follows them.
    order: list[str] = []

    def renumber(m):
      order.append(texts[int(m.group(1))])
      return _text_mark(len(order) - 1)

    for n in out:
      n.pop("_results", None)
      n["content"] = _TEXT.sub(renumber, n["content"])
    texts[:] = order
    return out

  def render(self, msgs: list[dict], tools=None, replies=()) -> Rendered:
    texts: list[str] = []
    plain = self._plain(msgs, tools, texts, set(replies))
    kw = {"tools": tools} if (tools and self.native) else {}
    text = self.tok.apply_chat_template(plain, add_generation_prompt=True, **kw)
    real = [{**n, "content": _TEXT.sub(lambda m: texts[int(m.group(1))], n["content"])}
            for n in plain]
    exact = (self.tok.apply_chat_template(real, add_generation_prompt=True, **kw)
             == _TEXT.sub(lambda m: texts[int(m.group(1))], text))
    return Rendered(text, texts, exact)

  def encode(self, text: str, texts: list[str]) -> list[int]:
    """Ids of marked text: the template's text trusted, the agent's texts untrusted."""
    pieces, pos = [], 0
    for m in _TEXT.finditer(text):
      pieces += [(text[pos:m.start()], True), (texts[int(m.group(1))], False)]
      pos = m.end()
    pieces.append((text[pos:], True))
    return self.tok.encode_pieces(pieces)

  def prompt(self, r: Rendered) -> list[int]:
    """A new segment's prompt ids (the tokenizer's BOS first, if it adds one)."""
    if r.exact:
      ids = self.encode(r.text, r.texts)
    else:  # the template reads the texts: encode its real output, trusted
      ids = self.tok.encode(_TEXT.sub(lambda m: r.texts[int(m.group(1))], r.text), add_bos=False)
    tok = self.tok
    if tok.add_bos and tok.bos_token is not None:
      ids = [tok.token_id(tok.bos_token)] + ids
    return ids


def _obj(args: str):
  try:
    return json.loads(args)
  except ValueError:
    return args
