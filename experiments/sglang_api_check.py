r"""SGLang API drift check: does the pinned SGLang release still have every HTTP route, request
field and answer field that fr_jax's client uses?

  python -m experiments.sglang_api_check                  # the pinned release (SGLANG_VERSION)
  python -m experiments.sglang_api_check --version=0.5.24 # try a newer one before re-pinning
  python -m experiments.sglang_api_check --wheel=path/to/sglang-*.whl

Design. `USES` is the explicit table of what `fr_jax/rollout/sglang.py` sends and reads (the
weight relay, `launch/weight_relay.py` and `fr_jax/transport/relay.py`, reaches SGLang only
through that client); `tests/test_sglang_api_check.py` checks that the table names every route
and field string in the client's source. The check downloads the release's wheel with pip
(`--no-deps --only-binary=:all:`, about 40 MB, into build/sglang_api), opens it as a zip and
parses SGLang's source with `ast`: nothing is installed or imported.

  route          a decorator `@app.post/get/put/api_route(path, methods=...)` (or
                 `add_api_route`) in sglang/srt/entrypoints/http_server.py, with our method.
  request        a class-level field (dataclass or msgspec Struct, bases in the same file
                 included) of the type the route's handler takes, in
                 sglang/srt/managers/io_struct.py.
  sampling       a field of `SamplingParams` in sglang/srt/sampling/sampling_params.py.
  value          `field=value`: the value is in the field's `Literal[...]`.
  response       /generate: a key of the answer dict that carries `meta_info`
                 (sglang/srt/managers/*.py); other routes: a key of a dict literal in the
                 route's handler.
  meta_info      a key of a `meta_info = {...}` literal or a `meta_info["key"] =` assignment
                 in sglang/srt/managers/*.py.
  finish_reason  a key of the dicts that the finish reasons' `to_json` returns
                 (sglang/srt/managers/schedule_batch.py);
  finish_type    ... and a value of their "type".
  logprob_entry  `name=i`: an output_token_logprobs entry holds `name` at position i (the
                 tuple `detokenize_logprob_tokens` builds in tokenizer_manager.py).
  server_default `arg=value`: the server argument's default (a class-level field in
                 sglang/srt/server_args.py or sglang/srt/arg_groups/); the client reads
                 meta_info.weight_version "default" as "no version given".
  answer         `Struct.field`: a class-level field of `Struct` in io_struct.py, for a route
                 whose handler answers with `msgspec_to_builtins(result)` of that type.
  server_arg     a server argument (a class-level field there), which /server_info reports
                 under its own name: it answers with every resolved server argument
                 (build_server_info -> ServerArgs.resolved_dict, a flat dict).

Releases that ship the generated HTTP contract `sglang/api/v1/api_types.py` enforce it on
/generate (an unknown sampling key is an HTTP 400), so /generate's request, sampling, answer,
meta_info and entry-layout uses must be in its structs too, except where a struct's docstring
says it ignores unknown keys (0.5.23: GenerateRequest and GenerateMetaInfo, not
SamplingParams): such a struct does not refuse a field it lacks, and the Python server parses
the request into, and builds the answer from, its own types (io_struct.py, the managers), so
the field need only be there. The record then names the struct with "(ignores unknown keys)".

Output: one JSON line per use (`ok`, `found_in`, `missing_in`), then a summary line; the exit
status is 1 if anything is missing. Progress goes to stderr.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from absl import app, flags

# Not pinned anywhere else yet (BUILD.md, requirements-device.txt and docs/rollout.md name none):
# the stable release current when this check was written. Record it in BUILD.md.
SGLANG_VERSION = "0.5.23"

flags.DEFINE_string("version", SGLANG_VERSION, "SGLang release whose wheel is checked")
flags.DEFINE_string("wheel", None, "check this wheel file instead of downloading one")
flags.DEFINE_string("dest", "build/sglang_api", "where the downloaded wheel is kept")
FLAGS = flags.FLAGS

HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SAMPLING = "sglang/srt/sampling/sampling_params.py"
MANAGERS = "sglang/srt/managers/"
SCHEDULE_BATCH = "sglang/srt/managers/schedule_batch.py"
CONTRACT = "sglang/api/v1/api_types.py"  # the generated /generate contract, when shipped
SERVER_ARGS = ("sglang/srt/server_args.py", "sglang/srt/arg_groups/")  # file, or folder


class Use(NamedTuple):
  kind: str   # one of the kinds in the module docstring
  route: str
  name: str   # a field, a method (route), `field=value` (value) or `name=position`


USES: tuple[Use, ...] = (
  # Routes and methods (SGLangEngine._call's callers).
  Use("route", "/generate", "POST"),
  Use("route", "/health", "GET"),
  Use("route", "/abort_request", "POST"),
  Use("route", "/pause_generation", "POST"),
  Use("route", "/update_weights_from_disk", "POST"),
  Use("route", "/continue_generation", "POST"),
  Use("route", "/server_info", "GET"),
  Use("route", "/model_info", "GET"),  # the relay: which version a server holds
  Use("response", "/model_info", "weight_version"),
  # /generate body (SGLangEngine.payload).
  Use("request", "/generate", "input_ids"),
  Use("request", "/generate", "sampling_params"),
  Use("request", "/generate", "return_logprob"),
  Use("request", "/generate", "logprob_start_len"),
  Use("request", "/generate", "rid"),
  Use("request", "/generate", "return_routed_experts"),  # routing replay (R3)
  Use("request", "/generate", "routed_experts_start_len"),
  Use("sampling", "/generate", "max_new_tokens"),
  Use("sampling", "/generate", "temperature"),
  Use("sampling", "/generate", "top_p"),
  Use("sampling", "/generate", "skip_special_tokens"),
  Use("sampling", "/generate", "no_stop_trim"),
  Use("sampling", "/generate", "sampling_seed"),
  Use("sampling", "/generate", "stop_token_ids"),
  Use("sampling", "/generate", "stop"),
  # /generate answer (SGLangEngine.parse).
  Use("response", "/generate", "meta_info"),
  Use("meta_info", "/generate", "output_token_logprobs"),
  Use("meta_info", "/generate", "finish_reason"),
  Use("meta_info", "/generate", "weight_version"),
  # Streaming (SGLangEngine._streamed, for a request with on_token: the gateway's): the
  # stream flag, and the count of tokens so far that tells new entries from repeated ones.
  Use("request", "/generate", "stream"),
  Use("meta_info", "/generate", "completion_tokens"),
  Use("finish_reason", "/generate", "type"),
  Use("finish_type", "/generate", "stop"),
  Use("finish_type", "/generate", "length"),
  Use("finish_type", "/generate", "abort"),
  Use("logprob_entry", "/generate", "logprob=0"),
  Use("logprob_entry", "/generate", "token_id=1"),
  Use("meta_info", "/generate", "routed_experts"),
  Use("server_default", "/generate", "weight_version=default"),
  # Routing replay's up-front check (SGLangEngine.check_routing_support): the server flag
  # --enable-return-routed-experts, as /server_info reports it.
  Use("server_arg", "/server_info", "enable_return_routed_experts"),
  # Weight updates (SGLangEngine.update_weights) and aborts (SGLangEngine.generate).
  Use("request", "/pause_generation", "mode"),
  Use("value", "/pause_generation", "mode=abort"),
  Use("request", "/update_weights_from_disk", "model_path"),
  Use("request", "/update_weights_from_disk", "weight_version"),
  Use("request", "/update_weights_from_disk", "flush_cache"),
  Use("response", "/update_weights_from_disk", "success"),
  Use("response", "/update_weights_from_disk", "message"),
  Use("request", "/abort_request", "rid"),
  # LoRA (SGLangEngine.load_adapter): adapters loaded, unloaded and named at run time, and
  # the server's version label set without aborting anything.
  Use("route", "/load_lora_adapter", "POST"),
  Use("route", "/unload_lora_adapter", "POST"),
  Use("route", "/update_weight_version", "POST"),
  Use("request", "/load_lora_adapter", "lora_name"),
  Use("request", "/load_lora_adapter", "lora_path"),
  Use("request", "/unload_lora_adapter", "lora_name"),
  Use("answer", "/load_lora_adapter", "LoRAUpdateOutput.success"),
  Use("answer", "/load_lora_adapter", "LoRAUpdateOutput.error_message"),
  Use("request", "/update_weight_version", "new_version"),
  Use("request", "/update_weight_version", "abort_all_requests"),
  Use("request", "/generate", "lora_path"),
  Use("server_arg", "/server_info", "enable_lora"),  # named in the client's refusal
  Use("server_arg", "/server_info", "max_lora_rank"),
  Use("server_arg", "/server_info", "lora_target_modules"),
  Use("server_arg", "/server_info", "max_loaded_loras"),
)

# /generate uses that the generated contract must also admit: kind -> its struct.
CONTRACT_STRUCT = {"request": "GenerateRequest", "sampling": "SamplingParams",
                   "response": "GenerateResponse", "meta_info": "GenerateMetaInfo",
                   "logprob_entry": "LogprobEntry"}
_ROUTE_DECORATORS = {"get": {"GET"}, "post": {"POST"}, "put": {"PUT"}, "delete": {"DELETE"},
                     "patch": {"PATCH"}}


# --- reading SGLang's source with ast ---
def _str(node) -> str | None:
  return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _strs(node) -> set[str]:
  """The string constants of a list/tuple/set literal."""
  if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
    return {s for s in map(_str, node.elts) if s is not None}
  return set()


def _route_of(call) -> tuple[str, set[str]] | None:
  """(path, methods) of `X.post(path)`, `X.api_route(path, methods=[...])`, or None."""
  if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
    return None
  verb = call.func.attr
  if verb not in _ROUTE_DECORATORS and verb != "api_route":
    return None
  kw = {k.arg: k.value for k in call.keywords}
  path = _str(call.args[0]) if call.args else _str(kw.get("path"))
  if path is None:
    return None
  if verb != "api_route":
    return path, set(_ROUTE_DECORATORS[verb])
  return path, (_strs(kw["methods"]) if "methods" in kw else {"GET"})  # FastAPI's default


def find_routes(tree: ast.Module) -> dict[str, list[tuple[set[str], ast.AST | None]]]:
  """path -> [(methods, handler function)] for every route the module registers."""
  functions = {n.name: n for n in tree.body
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
  routes: dict[str, list] = {}
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      for dec in node.decorator_list:
        r = _route_of(dec)
        if r:
          routes.setdefault(r[0], []).append((r[1], node))
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr == "add_api_route" and node.args and _str(node.args[0])):
      kw = {k.arg: k.value for k in node.keywords}
      handler = node.args[1] if len(node.args) > 1 else kw.get("endpoint")
      fn = functions.get(handler.id) if isinstance(handler, ast.Name) else None
      methods = _strs(kw["methods"]) if "methods" in kw else {"GET"}
      routes.setdefault(_str(node.args[0]), []).append((methods, fn))
  return routes


def _annotation_name(ann) -> str | None:
  """`X`, `Annotated[X, ...]`, `Optional[X]` -> "X"."""
  if isinstance(ann, ast.Name):
    return ann.id
  if isinstance(ann, ast.Attribute):
    return ann.attr
  if isinstance(ann, ast.Subscript):
    inner = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
    return _annotation_name(inner)
  return None


def handler_request_type(fn, classes: Mapping[str, ast.ClassDef]) -> str | None:
  """The first parameter type of a route handler that is a class of `classes`."""
  for a in (fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs) if fn else ():
    name = _annotation_name(a.annotation) if a.annotation is not None else None
    if name in classes:
      return name
  return None


def classes_of(tree: ast.Module) -> dict[str, ast.ClassDef]:
  return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def class_fields(classes: Mapping[str, ast.ClassDef], name: str) -> dict[str, ast.AST]:
  """field -> annotation of a class and its bases defined in the same module, in order
  (bases first): class-level annotated fields (dataclass, msgspec Struct) and, for a plain
  class, the parameters of `__init__`."""
  cls = classes.get(name)
  if cls is None:
    return {}
  fields: dict[str, ast.AST] = {}
  for base in cls.bases:
    if isinstance(base, ast.Name) and base.id != name:
      fields.update(class_fields(classes, base.id))
  for stmt in cls.body:
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
      fields[stmt.target.id] = stmt.annotation
    elif isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":  # a plain class
      a = stmt.args
      for arg in (a.posonlyargs + a.args + a.kwonlyargs)[1:]:  # [0] is self
        fields[arg.arg] = arg.annotation if arg.annotation is not None else ast.Constant(None)
  return fields


def literal_values(ann) -> set[str]:
  """The string values of every `Literal[...]` inside an annotation."""
  out = set()
  for node in ast.walk(ann):
    if isinstance(node, ast.Subscript) and _annotation_name(node.value) == "Literal":
      sl = node.slice
      out |= _strs(sl) if isinstance(sl, ast.Tuple) else ({_str(sl)} - {None})
  return out


def _dict_keys(node: ast.Dict) -> set[str]:
  return {s for s in map(_str, (k for k in node.keys if k is not None)) if s is not None}


def meta_info_keys(trees: Iterable[ast.Module]) -> set[str]:
  """Keys of `meta_info = {...}`, of a `"meta_info": {...}` entry and of `meta_info[k] = ...`
  (also `x["meta_info"][k] = ...`)."""
  keys = set()
  for tree in trees:
    for node in ast.walk(tree):
      if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
          if (isinstance(t, ast.Name) and t.id == "meta_info"
              and isinstance(node.value, ast.Dict)):
            keys |= _dict_keys(node.value)
          if isinstance(t, ast.Subscript) and _str(t.slice) is not None:
            base = t.value
            if ((isinstance(base, ast.Name) and base.id == "meta_info")
                or (isinstance(base, ast.Subscript) and _str(base.slice) == "meta_info")):
              keys.add(_str(t.slice))
      elif isinstance(node, ast.Dict):
        for k, v in zip(node.keys, node.values):
          if k is not None and _str(k) == "meta_info" and isinstance(v, ast.Dict):
            keys |= _dict_keys(v)
  return keys


def answer_keys(trees: Iterable[ast.Module], marker: str) -> set[str]:
  """Keys of every dict literal that has the key `marker`."""
  keys = set()
  for tree in trees:
    for node in ast.walk(tree):
      if isinstance(node, ast.Dict) and marker in _dict_keys(node):
        keys |= _dict_keys(node)
  return keys


def handler_keys(fn) -> set[str]:
  """Keys of the dict literals in a route handler (what it answers with)."""
  if fn is None:
    return set()
  return set().union(*(_dict_keys(n) for n in ast.walk(fn) if isinstance(n, ast.Dict)))


def finish_reasons(tree: ast.Module) -> tuple[set[str], set[str]]:
  """(keys, "type" values) of the dicts returned by `to_json` of `BaseFinishReason` and the
  classes derived from it in the module."""
  classes = classes_of(tree)

  def derived(name, seen=()):
    if name == "BaseFinishReason":
      return True
    cls = classes.get(name)
    return cls is not None and any(isinstance(b, ast.Name) and b.id not in seen
                                   and derived(b.id, seen + (name,)) for b in cls.bases)

  keys, types = set(), set()
  for name, cls in classes.items():
    if not derived(name):
      continue
    for fn in cls.body:
      if isinstance(fn, ast.FunctionDef) and fn.name == "to_json":
        for ret in ast.walk(fn):
          if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Dict):
            keys |= _dict_keys(ret.value)
            for k, v in zip(ret.value.keys, ret.value.values):
              if k is not None and _str(k) == "type" and _str(v) is not None:
                types.add(_str(v))
  return keys, types


def logprob_entry_layouts(trees: Iterable[ast.Module]) -> set[str]:
  """`name=i` for the tuples `detokenize_logprob_tokens` builds: element i is the variable
  `name`."""
  out = set()
  for tree in trees:
    for fn in ast.walk(tree):
      if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) \
          and fn.name == "detokenize_logprob_tokens":
        for t in ast.walk(fn):
          if isinstance(t, ast.Tuple):
            out |= {f"{e.id}={i}" for i, e in enumerate(t.elts) if isinstance(e, ast.Name)}
  return out


def server_fields(trees: Iterable[ast.Module]) -> set[str]:
  """Every class-level annotated field (the server arguments)."""
  return {stmt.target.id for tree in trees for cls in ast.walk(tree)
          if isinstance(cls, ast.ClassDef) for stmt in cls.body
          if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)}


def ignores_unknown_keys(cls: ast.ClassDef | None) -> bool:
  """Whether a generated contract struct says it ignores unknown keys (its docstring)."""
  doc = ast.get_docstring(cls) if cls is not None else None
  return bool(doc) and "unknown keys ignored" in doc


def server_defaults(trees: Iterable[ast.Module]) -> set[str]:
  """`arg=value` for every class-level field with a string default."""
  out = set()
  for tree in trees:
    for cls in ast.walk(tree):
      if isinstance(cls, ast.ClassDef):
        for stmt in cls.body:
          if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
              and _str(stmt.value) is not None):
            out.add(f"{stmt.target.id}={_str(stmt.value)}")
  return out


# --- the check ---
def _parse(sources: Mapping[str, str], path: str) -> ast.Module | None:
  text = sources.get(path)
  return None if text is None else ast.parse(text, filename=path)


def check(sources: Mapping[str, str], uses: Iterable[Use] = USES) -> list[dict]:
  """One record per use: {kind, route, name, ok, found_in, missing_in}. `sources` maps a path
  inside the wheel to its text; a use whose source file is absent is missing from it."""
  server = _parse(sources, HTTP_SERVER)
  io = _parse(sources, IO_STRUCT)
  sampling = _parse(sources, SAMPLING)
  batch = _parse(sources, SCHEDULE_BATCH)
  contract = _parse(sources, CONTRACT)
  managers = [ast.parse(t, filename=p) for p, t in sorted(sources.items())
              if p.startswith(MANAGERS) and p.endswith(".py")]
  routes = find_routes(server) if server else {}
  io_classes = classes_of(io) if io else {}
  sampling_fields = class_fields(classes_of(sampling), "SamplingParams") if sampling else {}
  contract_classes = classes_of(contract) if contract else {}
  finish_keys, finish_types = finish_reasons(batch) if batch else (set(), set())
  meta_keys = meta_info_keys(managers)
  generate_keys = answer_keys(managers, "meta_info")
  layouts = logprob_entry_layouts(managers)
  server_trees = [ast.parse(t, filename=p) for p, t in sorted(sources.items())
                  if p.startswith(SERVER_ARGS) and p.endswith(".py")]
  defaults = server_defaults(server_trees)
  server_args = server_fields(server_trees)

  def handlers(route):
    return [fn for _, fn in routes.get(route, [])]

  def request_fields(route) -> tuple[str, dict]:
    types = {handler_request_type(fn, io_classes) for fn in handlers(route)} - {None}
    if not types:
      return f"{IO_STRUCT}:(no request type for {route})", {}
    fields = {}
    for t in sorted(types):
      fields.update(class_fields(io_classes, t))
    return f"{IO_STRUCT}:{'/'.join(sorted(types))}", fields

  def verdicts(use: Use) -> list[tuple[str, bool]]:
    """(where it was looked for, found there) for one use."""
    if use.kind == "route":
      methods = set().union(*(m for m, _ in routes.get(use.route, [])))
      out = [(HTTP_SERVER, use.name in methods)]
    elif use.kind == "request":
      where, fields = request_fields(use.route)
      out = [(where, use.name in fields)]
    elif use.kind == "value":
      field, value = use.name.split("=", 1)
      where, fields = request_fields(use.route)
      out = [(where, field in fields and value in literal_values(fields[field]))]
    elif use.kind == "sampling":
      out = [(f"{SAMPLING}:SamplingParams", use.name in sampling_fields)]
    elif use.kind == "response" and use.route == "/generate":
      out = [(f"{MANAGERS}*.py", use.name in generate_keys)]
    elif use.kind == "response":
      keys = set().union(*map(handler_keys, handlers(use.route)))
      out = [(f"{HTTP_SERVER}:{use.route}", use.name in keys)]
    elif use.kind == "meta_info":
      out = [(f"{MANAGERS}*.py", use.name in meta_keys)]
    elif use.kind == "finish_reason":
      out = [(f"{SCHEDULE_BATCH}:to_json", use.name in finish_keys)]
    elif use.kind == "finish_type":
      out = [(f"{SCHEDULE_BATCH}:to_json", use.name in finish_types)]
    elif use.kind == "logprob_entry":
      out = [(f"{MANAGERS}*.py:detokenize_logprob_tokens", use.name in layouts)]
    elif use.kind == "server_default":
      out = [(f"{SERVER_ARGS[0]} or {SERVER_ARGS[1]}", use.name in defaults)]
    elif use.kind == "answer":
      struct, field = use.name.split(".", 1)
      out = [(f"{IO_STRUCT}:{struct}", field in class_fields(io_classes, struct))]
    elif use.kind == "server_arg":
      out = [(f"{SERVER_ARGS[0]} or {SERVER_ARGS[1]}", use.name in server_args)]
    else:
      raise ValueError(f"unknown kind {use.kind!r} in {use}: use one of the kinds in "
                       "experiments/sglang_api_check.py's docstring")
    if contract is not None and use.route == "/generate" and use.kind in CONTRACT_STRUCT:
      struct = CONTRACT_STRUCT[use.kind]
      fields = list(class_fields(contract_classes, struct))
      if use.kind == "logprob_entry":
        name, pos = use.name.split("=")
        ok = int(pos) < len(fields) and fields[int(pos)] == name
      else:
        ok = use.name in fields
      if not ok and use.kind != "logprob_entry" \
          and ignores_unknown_keys(contract_classes.get(struct)):
        out.append((f"{CONTRACT}:{struct} (ignores unknown keys)", True))
      else:
        out.append((f"{CONTRACT}:{struct}", ok))
    return out

  records = []
  for use in uses:
    checked = verdicts(use)
    missing = [where for where, ok in checked if not ok]
    records.append({"kind": use.kind, "route": use.route, "name": use.name,
                    "ok": not missing, "found_in": [where for where, ok in checked if ok],
                    "missing_in": missing})
  return records


def read_wheel(path: str) -> dict[str, str]:
  """The texts of the wheel's files that `check` reads."""
  wanted = (HTTP_SERVER, IO_STRUCT, SAMPLING, CONTRACT)

  def read(n):
    return (n in wanted or n.startswith(SERVER_ARGS) and n.endswith(".py")
            or n.startswith(MANAGERS) and n.endswith(".py") and "/" not in n[len(MANAGERS):])

  with zipfile.ZipFile(path) as z:
    return {n: z.read(n).decode("utf-8") for n in z.namelist() if read(n)}


def download(version: str, dest: str) -> str:
  """The release's wheel in `dest`, downloaded by pip unless already there."""
  pattern = os.path.join(dest, f"sglang-{version}-*.whl")
  have = sorted(glob.glob(pattern))
  if have:
    print(f"using {have[0]} (already downloaded)", file=sys.stderr)
    return have[0]
  print(f"downloading sglang=={version} (wheel only, no dependencies) into {dest}...",
        file=sys.stderr)
  cmd = [sys.executable, "-m", "pip", "download", f"sglang=={version}", "--no-deps",
         "--only-binary=:all:", "-d", dest, "--quiet"]
  res = subprocess.run(cmd, capture_output=True, text=True)
  have = sorted(glob.glob(pattern))
  if res.returncode != 0 or not have:
    raise SystemExit(f"pip could not download the sglang {version} wheel for this platform "
                     f"(exit {res.returncode}): {res.stderr.strip()[-800:]}\nPass --version "
                     "with a released version, or --wheel with a wheel file you have.")
  return have[0]


def main(argv):
  del argv
  wheel = FLAGS.wheel or download(FLAGS.version, FLAGS.dest)
  if not os.path.isfile(wheel):
    raise SystemExit(f"--wheel={wheel}: no such file; pass a downloaded sglang-*.whl")
  print(f"reading {wheel}...", file=sys.stderr)
  sources = read_wheel(wheel)
  records = check(sources)
  for r in records:
    print(json.dumps(r), flush=True)
  missing = [f"{r['kind']} {r['route']} {r['name']}" for r in records if not r["ok"]]
  print(json.dumps({"summary": True, "wheel": os.path.basename(wheel), "checked": len(records),
                    "missing": len(missing), "missing_uses": missing,
                    "contract_checked": CONTRACT in sources}), flush=True)
  sys.exit(1 if missing else 0)


if __name__ == "__main__":
  app.run(main)
