"""Tool-call formats for the OpenAI-compatible gateway (`fr_jax.rollout.gateway`): how a model
is told about the request's `tools`, how its calls are written back into a conversation, and
how its replies are parsed into `tool_calls`.

Three formats:
* `hermes` (Hermes / Qwen2.5, and the agent loop's): calls in `<tool_call>{...}</tool_call>`
  blocks, results as `<tool_response>` inside a user turn;
* `llama3_json` (Llama 3.1-3.3): the whole reply is one JSON object
  `{"name": ..., "parameters": {...}}` (or a list of them), optionally after
  `<|python_tag|>`;
* `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (v3), or
  `[TOOL_CALLS]name[ARGS]{...}` per call (v11 and later).

`detect(chat_template)` names the format a model's own template writes (None: unknown, and
the gateway refuses `tools` for it unless the format is set). A template that renders `tools`
itself gets them as the `tools` variable, as Hugging Face templates expect; one that does not
(SmolLM2's plain ChatML) gets `plain_messages`: the format's tool description appended to the
system turn, calls written into the assistant text and results wrapped as the format writes
them, so the template only ever sees system/user/assistant text.

Model output is hostile input. Parsing is linear in the reply's length (substring searches and
JSON parses), refuses replies over `MAX_REPLY_CHARS` and more than `MAX_CALLS` calls, and a
JSON failure (deep nesting and huge integers included) is a parse error: the reply then comes
back as plain content, with the error named, never as a call.
"""

from __future__ import annotations

import dataclasses
import json

FORMATS = ("hermes", "llama3_json", "mistral")
MAX_REPLY_CHARS = 65_536
MAX_CALLS = 16
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>\n", "\n</tool_response>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: str  # a JSON object's text, as the OpenAI API carries it


@dataclasses.dataclass(frozen=True)
class Parsed:
  content: str  # the reply's text outside its calls (all of it when error is set)
  calls: tuple[ToolCall, ...] = ()
  error: str | None = None  # why calls the reply seems to hold could not be read


def detect(chat_template: str | None) -> str | None:
  """The format a chat template writes, from the markers it holds; None if none is known."""
  t = chat_template or ""
  if CALL_OPEN in t:
    return "hermes"
  if MISTRAL_CALLS in t:
    return "mistral"
  if PYTHON_TAG in t or "ipython" in t:
    return "llama3_json"
  return None


def renders_tools(chat_template: str | None) -> bool:
  """Whether the template reads the `tools` variable itself."""
  return "tools" in (chat_template or "")


def _loads(text: str):
  """JSON, or raises ValueError naming why not (RecursionError and huge ints included)."""
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"not valid JSON ({e.msg})") from None
  except (ValueError, RecursionError) as e:
    raise ValueError(f"not valid JSON ({type(e).__name__})") from None


def _call(obj, args_keys=("arguments",)) -> ToolCall:
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
    raise ValueError("a call needs a \"name\" string")
  args = next((obj[k] for k in args_keys if k in obj), {})
  if isinstance(args, str):  # some models write the arguments as a JSON string
    args = _loads(args)
  if not isinstance(args, dict):
    raise ValueError(f"call {obj['name'][:64]!r}: arguments must be a JSON object")
  return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _calls(objs, args_keys=("arguments",)) -> tuple[ToolCall, ...]:
  if len(objs) > MAX_CALLS:
    raise ValueError(f"{len(objs)} calls in one reply (at most {MAX_CALLS})")
  return tuple(_call(o, args_keys) for o in objs)


def _hermes(text: str) -> Parsed:
  start = text.find(CALL_OPEN)
  if start < 0:
    return Parsed(text)
  bodies, pos = [], start
  while pos >= 0:
    end = text.find(CALL_CLOSE, pos + len(CALL_OPEN))
    if end < 0:
      raise ValueError(f"{CALL_OPEN} without {CALL_CLOSE}")
    if len(bodies) == MAX_CALLS:
      raise ValueError(f"more than {MAX_CALLS} calls in one reply")
    bodies.append(_loads(text[pos + len(CALL_OPEN):end].strip()))
    pos = text.find(CALL_OPEN, end + len(CALL_CLOSE))
  return Parsed(text[:start].strip(), _calls(bodies))


def _llama3(text: str) -> Parsed:
  body = text.strip()
  if body.startswith(PYTHON_TAG):
    body = body[len(PYTHON_TAG):].strip()
  elif not body.startswith(("{", "[")):
    return Parsed(text)
  obj = _loads(body)
  objs = obj if isinstance(obj, list) else [obj]
  return Parsed("", _calls(objs, ("parameters", "arguments")))


def _mistral(text: str) -> Parsed:
  start = text.find(MISTRAL_CALLS)
  if start < 0:
    return Parsed(text)
  body = text[start + len(MISTRAL_CALLS):].strip()
  if body.startswith("[") and not body.startswith(MISTRAL_CALLS):  # v3: one JSON list
    objs = _loads(body)
    if not isinstance(objs, list):
      raise ValueError("[TOOL_CALLS] must be followed by a JSON list")
  else:  # v11: name[ARGS]{...}, each call after its own [TOOL_CALLS]
    parts = body.split(MISTRAL_CALLS, MAX_CALLS)
    if len(parts) > MAX_CALLS:
      raise ValueError(f"more than {MAX_CALLS} calls in one reply")
    objs = []
    for p in parts:
      name, sep, args = p.partition(MISTRAL_ARGS)
      if not sep:
        raise ValueError(f"a call without {MISTRAL_ARGS}")
      objs.append({"name": name.strip(), "arguments": _loads(args.strip())})
  return Parsed(text[:start].strip(), _calls(objs))


_PARSERS = {"hermes": _hermes, "llama3_json": _llama3, "mistral": _mistral}


def parse(fmt: str, text: str) -> Parsed:
  """A model reply's content and calls in format `fmt`; a reply whose calls cannot be read
  comes back whole as content, with `error` set."""
  if fmt not in _PARSERS:
    raise ValueError(f"unknown tool format {fmt!r}; choose one of {FORMATS}")
  if len(text) > MAX_REPLY_CHARS:
    return Parsed(text, (), f"reply of {len(text)} characters is over {MAX_REPLY_CHARS}; "
                  "not parsed for calls")
  try:
    return _PARSERS[fmt](text)
  except ValueError as e:
    return Parsed(text, (), str(e))


# --- writing tools, calls and results for a template that does not render tools ---

def _tool_json(tools) -> list[str]:
  return [json.dumps(t, ensure_ascii=False) for t in tools]


def describe(fmt: str, tools) -> str:
  """The format's description of `tools` (OpenAI function specs), for the system turn."""
  lines = "\n".join(_tool_json(tools))
  if fmt == "hermes":
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\nFor each function call, return a json object with "
            "function name and arguments within <tool_call></tool_call> XML tags:\n"
            "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
            "</tool_call>")
  if fmt == "llama3_json":
    return ("Given the following functions, please respond with a JSON for a function call "
            "with its proper arguments that best answers the given prompt.\n\nRespond in the "
            "format {\"name\": function name, \"parameters\": dictionary of argument name and "
            "its value}. Do not use variables.\n\n" + lines)
  if fmt == "mistral":
    return ("You can call these functions. To call them, write [TOOL_CALLS] followed by a "
            "JSON list of {\"name\": ..., \"arguments\": {...}} objects.\n\n" + lines)
  raise ValueError(f"unknown tool format {fmt!r}; choose one of {FORMATS}")


def write_calls(fmt: str, calls) -> str:
  """`calls` ((name, arguments JSON text) pairs) as the format writes them in a reply."""
  objs = []
  for name, args in calls:
    try:
      args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
      pass  # kept as the text the agent sent
    objs.append((name, args))
  if fmt == "hermes":
    return "\n".join(f"{CALL_OPEN}\n" + json.dumps({"name": n, "arguments": a},
                                                   ensure_ascii=False) + f"\n{CALL_CLOSE}"
                     for n, a in objs)
  if fmt == "llama3_json":
    one = [{"name": n, "parameters": a} for n, a in objs]
    return json.dumps(one[0] if len(one) == 1 else one, ensure_ascii=False)
  if fmt == "mistral":
    return MISTRAL_CALLS + json.dumps([{"name": n, "arguments": a} for n, a in objs],
                                      ensure_ascii=False)
  raise ValueError(f"unknown tool format {fmt!r}; choose one of {FORMATS}")


# The result wrapper around a tool turn's text: (turn role, before, after, between results).
_RESULTS = {"hermes": ("user", RESPONSE_OPEN, RESPONSE_CLOSE, "\n"),
            "llama3_json": ("ipython", "", "", "\n"),
            "mistral": ("user", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "")}


def result_wrap(fmt: str) -> tuple[str, str, str, str]:
  return _RESULTS[fmt]
