"""The SGLang API drift check (experiments/sglang_api_check.py), without the network.

* Its table (`USES`) names every route and field string in the client's source, so a new
  field the client starts sending cannot escape the check; the weight relay reaches SGLang
  only through the client.
* Its `ast` parsing, on a small synthetic SGLang tree with deliberate gaps: each gap is
  reported missing (hand-listed below, where it is missing from), everything else found. A
  contract struct that says it ignores unknown keys need not list a field; one that rejects
  them (or says nothing) must.
"""

import ast
import json
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from experiments import sglang_api_check as chk

ROOT = Path(__file__).resolve().parents[1]
# The SGLang client and the HTTP code it shares with the vLLM engine.
CLIENT = (ROOT / "fr_jax/rollout/sglang.py", ROOT / "fr_jax/rollout/http_engine.py")
RELAYS = (ROOT / "launch/weight_relay.py", ROOT / "fr_jax/transport/relay.py",
          ROOT / "fr_jax/transport/weights_spec.py")
ROUTE = re.compile(r"^/[a-z_]+$")
NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# Lower-case identifier-like strings in the client that are not SGLang's API.
NOT_API = {"replace",  # bytes.decode(errors="replace") on an error body
           "hf",  # the engines' weight_format (an HF directory)
           "error"}  # HTTPClient.events: a streamed answer's error event (vLLM's stream)


def code_strings(path):
  """Every string constant of a module except its docstrings (f-string pieces included)."""
  tree = ast.parse(path.read_text())
  docs = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      body = node.body
      if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        docs.add(id(body[0].value))
  return {n.value for n in ast.walk(tree)
          if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs}


def table_strings():
  out = set()
  for use in chk.USES:
    out.add(use.route)
    out |= set(re.split(r"[=.]", use.name))
  return out


def test_table_names_every_route_and_field_the_client_uses():
  strings = set().union(*(code_strings(p) for p in CLIENT))
  routes = {s for s in strings if ROUTE.match(s)}
  names = {s for s in strings if NAME.match(s)}
  assert routes >= {"/generate", "/update_weights_from_disk"}, routes  # the scan sees them
  assert routes - {u.route for u in chk.USES} == set()
  unlisted = names - table_strings() - NOT_API
  assert not unlisted, (
      f"the client uses {sorted(unlisted)}, which the API table does not list: add them to "
      "USES in experiments/sglang_api_check.py (or to NOT_API here if not SGLang's API)")
  assert NOT_API <= names, "NOT_API lists strings the client no longer has"


def test_weight_relay_reaches_sglang_only_through_the_client():
  for path in RELAYS:
    assert {s for s in code_strings(path) if ROUTE.match(s)} == set(), path


# --- a synthetic SGLang tree ---
def _src(text):
  return textwrap.dedent(text).lstrip()


SYNTHETIC = {
  chk.HTTP_SERVER: _src("""
    app = FastAPI()

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate_request(obj: GenerateReqInput, request: Request):
      return await serve(obj)

    @app.get("/health")
    @app.get("/health_generate")
    async def health(request: Request):
      return Response(status_code=200)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(obj: Annotated[UpdateWeightFromDiskReqInput, Body()],
                                       request: Request):
      ok = await manager.update(obj)
      content = {"success": ok, "num_paused_requests": 0}
      return ORJSONResponse(content)

    @app.post("/pause_generation")
    async def pause_generation(obj: Annotated[PauseGenerationReqInput, Body()]):
      return {"status": "ok"}

    @app.get("/abort_request")
    async def abort_request(obj: AbortReq):
      return Response(status_code=200)

    async def continue_generation(obj: ContinueGenerationReqInput):
      return {"status": "ok"}

    app.add_api_route("/continue_generation", continue_generation, methods=["POST"])

    @app.get("/server_info")
    async def server_info():
      return {**build_server_info(server_args), "version": __version__}

    @app.api_route("/load_lora_adapter", methods=["POST"])
    async def load_lora_adapter(obj: Annotated[LoadLoRAAdapterReqInput, Body()]):
      return ORJSONResponse(msgspec_to_builtins(await manager.load_lora_adapter(obj)))

    @app.api_route("/unload_lora_adapter", methods=["POST"])
    async def unload_lora_adapter(obj: Annotated[UnloadLoRAAdapterReqInput, Body()]):
      return ORJSONResponse(msgspec_to_builtins(await manager.unload_lora_adapter(obj)))

    @app.post("/update_weight_version")
    async def update_weight_version(obj: Annotated[UpdateWeightVersionReqInput, Body()]):
      return {"success": True}

    @app.get("/model_info")
    async def model_info():
      result = {"model_path": manager.model_path,
                "weight_version": manager.config_value("weight_version")}
      return result
    """),
  chk.IO_STRUCT: _src("""
    @dataclass
    class GenerateReqInput:
      text: Optional[str] = None
      input_ids: Optional[List[int]] = None
      sampling_params: Optional[Dict[str, Any]] = None
      return_logprob: bool = False
      return_routed_experts: bool = False
      routed_experts_start_len: int = 0
      stream: bool = False
      lora_path: Optional[Union[List[Optional[str]], str]] = None
      rid: Optional[str] = field(default=None, kw_only=True)

    class BaseReq(msgspec.Struct, kw_only=True):
      rid: Optional[str] = None

    class AbortReq(BaseReq, kw_only=True):
      abort_all: bool = False

    class PauseGenerationReqInput(BaseReq, kw_only=True):
      mode: Literal["retract", "in_place"] = "retract"

    class ContinueGenerationReqInput(BaseReq, kw_only=True):
      pass

    class UpdateWeightFromDiskReqInput(BaseReq, kw_only=True):
      model_path: str
      weight_version: Optional[str] = None
      flush_cache: bool = True

    class UpdateWeightVersionReqInput(BaseReq, kw_only=True):
      new_version: str
      abort_all_requests: bool = True

    class LoadLoRAAdapterReqInput(BaseReq, kw_only=True):
      lora_name: str
      lora_path: str

    class UnloadLoRAAdapterReqInput(BaseReq, kw_only=True):
      lora_name: str

    class LoRAUpdateOutput(BaseReq, kw_only=True):
      success: bool
    """),
  chk.SAMPLING: _src("""
    class SamplingParams:
      def __init__(self, max_new_tokens: int = 128, stop=None, stop_token_ids=None,
                   temperature: float = 1.0, top_p: float = 1.0, skip_special_tokens=True,
                   no_stop_trim=False):
        self.max_new_tokens = max_new_tokens
    """),
  "sglang/srt/managers/tokenizer_manager.py": _src("""
    class TokenizerManager:
      def handle(self, recv, i, state):
        meta_info = {"id": recv.rids[i], "finish_reason": recv.finished_reasons[i]}
        meta_info["output_token_logprobs"] = state.output_token_logprobs
        meta_info["completion_tokens"] = len(state.output_ids)
        if recv.routed_experts[i] is not None:
          meta_info["routed_experts"] = recv.routed_experts[i]
        return {"text": state.text, "meta_info": meta_info}

      def detokenize_logprob_tokens(self, vals, idxs, decode_to_text):
        return [(logprob, token_id, None) for logprob, token_id in zip(vals, idxs)]
    """),
  "sglang/srt/managers/detokenizer_manager.py": _src("""
    def stamp(out, version):
      out["meta_info"]["weight_version"] = version
    """),
  chk.SCHEDULE_BATCH: _src("""
    class BaseFinishReason:
      def to_json(self):
        raise NotImplementedError

    class FINISH_MATCHED_TOKEN(BaseFinishReason):
      def to_json(self):
        return {"type": "stop", "matched": self.matched}

    class FINISH_LENGTH(FINISH_MATCHED_TOKEN):
      def to_json(self):
        return {"type": "length", "length": self.length}

    class NotAFinishReason:
      def to_json(self):
        return {"type": "abort"}
    """),
  "sglang/srt/server_args.py": _src("""
    @dataclass
    class ServerArgs:
      weight_version: str = "default"
    """),
  "sglang/srt/arg_groups/fields/exec_.py": _src("""
    class ExecFeatures(msgspec.Struct):
      enable_return_routed_experts: A[bool, "Enable returning routed experts."] = False

    class LoRAArgs(msgspec.Struct):
      enable_lora: Optional[bool] = None
      max_lora_rank: Optional[int] = None
      lora_target_modules: Optional[List[str]] = None
      max_loaded_loras: Optional[int] = None
    """),
  chk.CONTRACT: _src("""
    class GenerateRequest(msgspec.Struct, kw_only=True):
      'sglang.api.v1.GenerateRequest: JSON object (unknown keys ignored).'
      rid: Optional[str] = None
      input_ids: Optional[List[int]] = None
      sampling_params: Optional[SamplingParams] = None
      return_logprob: Optional[bool] = None
      logprob_start_len: Optional[int] = None
      routed_experts_start_len: int = 0

    class SamplingParams(msgspec.Struct, kw_only=True):
      max_new_tokens: Optional[int] = 128
      stop_token_ids: Optional[List[int]] = None
      temperature: Optional[float] = 1.0
      top_p: Optional[float] = 1.0
      skip_special_tokens: Optional[bool] = True
      no_stop_trim: Optional[bool] = False
      sampling_seed: Optional[int] = None

    class GenerateResponse(msgspec.Struct, kw_only=True):
      text: str = ""
      meta_info: Optional[GenerateMetaInfo] = None

    class GenerateMetaInfo(msgspec.Struct, kw_only=True):
      'sglang.api.v1.GenerateMetaInfo: JSON object (unknown keys ignored).'
      finish_reason: Optional[Any] = None
      output_token_logprobs: Optional[List[Any]] = None
      weight_version: Optional[str] = None

    class LogprobEntry(msgspec.Struct, kw_only=True):
      token_id: int = 0
      logprob: Optional[float] = None
      text: Optional[str] = None
    """),
}
IO = f"{chk.IO_STRUCT}:"
CONTRACT_SP = f"{chk.CONTRACT}:SamplingParams"
CONTRACT_LP = f"{chk.CONTRACT}:LogprobEntry"
# Every gap put in SYNTHETIC on purpose -> where it is missing from.
GAPS = {
  ("route", "/abort_request", "POST"): [chk.HTTP_SERVER],  # registered as GET
  ("request", "/generate", "logprob_start_len"): [IO + "GenerateReqInput"],  # contract has it
  ("sampling", "/generate", "sampling_seed"): [f"{chk.SAMPLING}:SamplingParams"],
  ("sampling", "/generate", "stop"): [CONTRACT_SP],  # sampling_params.py has it
  ("value", "/pause_generation", "mode=abort"): [IO + "PauseGenerationReqInput"],
  ("response", "/update_weights_from_disk", "message"):
      [f"{chk.HTTP_SERVER}:/update_weights_from_disk"],
  ("finish_type", "/generate", "abort"): [f"{chk.SCHEDULE_BATCH}:to_json"],
  ("logprob_entry", "/generate", "logprob=0"): [CONTRACT_LP],  # contract swaps the two
  ("logprob_entry", "/generate", "token_id=1"): [CONTRACT_LP],
  ("answer", "/load_lora_adapter", "LoRAUpdateOutput.error_message"):
      [IO + "LoRAUpdateOutput"],  # only `success` there
}


def by_use(records):
  return {(r["kind"], r["route"], r["name"]): r for r in records}


def test_synthetic_tree_reports_exactly_its_gaps():
  records = by_use(chk.check(SYNTHETIC))
  assert len(records) == len(chk.USES)
  missing = {u: r["missing_in"] for u, r in records.items() if not r["ok"]}
  assert missing == GAPS
  # Found ones name where: the route handler's own request type, inherited fields included.
  assert records["request", "/abort_request", "rid"]["found_in"] == [IO + "AbortReq"]
  assert records["request", "/update_weights_from_disk", "model_path"]["found_in"] == [
      IO + "UpdateWeightFromDiskReqInput"]
  assert records["sampling", "/generate", "stop"]["found_in"] == [
      f"{chk.SAMPLING}:SamplingParams"]
  assert records["logprob_entry", "/generate", "logprob=0"]["found_in"] == [
      f"{chk.MANAGERS}*.py:detokenize_logprob_tokens"]
  assert records["route", "/continue_generation", "POST"]["ok"]  # add_api_route
  # Not in the contract's GenerateRequest / GenerateMetaInfo, which ignore unknown keys.
  assert records["request", "/generate", "return_routed_experts"]["found_in"] == [
      IO + "GenerateReqInput", f"{chk.CONTRACT}:GenerateRequest (ignores unknown keys)"]
  assert records["meta_info", "/generate", "routed_experts"]["found_in"] == [
      f"{chk.MANAGERS}*.py", f"{chk.CONTRACT}:GenerateMetaInfo (ignores unknown keys)"]
  assert records["request", "/generate", "routed_experts_start_len"]["found_in"] == [
      IO + "GenerateReqInput", f"{chk.CONTRACT}:GenerateRequest"]
  assert records["server_arg", "/server_info", "enable_return_routed_experts"]["ok"]
  assert records["route", "/health", "GET"]["ok"]  # a stacked decorator


def test_a_contract_struct_that_rejects_unknown_keys_must_list_the_field():
  sources = dict(SYNTHETIC)
  sources[chk.CONTRACT] = sources[chk.CONTRACT].replace(
      "GenerateRequest: JSON object (unknown keys ignored)",
      "GenerateRequest: JSON object (unknown keys rejected)")
  records = by_use(chk.check(sources))
  assert records["request", "/generate", "return_routed_experts"]["missing_in"] == [
      f"{chk.CONTRACT}:GenerateRequest"]
  assert records["request", "/generate", "input_ids"]["ok"]


def test_a_server_argument_not_declared_is_missing():
  sources = {p: t for p, t in SYNTHETIC.items() if "arg_groups" not in p}
  records = by_use(chk.check(sources))
  assert records["server_arg", "/server_info", "enable_return_routed_experts"]["missing_in"] == [
      f"{chk.SERVER_ARGS[0]} or {chk.SERVER_ARGS[1]}"]


def test_without_the_contract_only_sglangs_own_source_counts():
  sources = {p: t for p, t in SYNTHETIC.items() if p != chk.CONTRACT}
  missing = {u for u, r in by_use(chk.check(sources)).items() if not r["ok"]}
  assert missing == {u for u, where in GAPS.items() if not where[0].startswith(chk.CONTRACT)}


def test_a_handler_without_a_request_type_misses_its_fields():
  sources = dict(SYNTHETIC)
  sources[chk.HTTP_SERVER] = sources[chk.HTTP_SERVER].replace(
      "obj: Annotated[PauseGenerationReqInput, Body()]", "request: Request")
  records = by_use(chk.check(sources))
  assert not records["request", "/pause_generation", "mode"]["ok"]
  assert records["route", "/pause_generation", "POST"]["ok"]


def test_empty_tree_misses_everything():
  assert not any(r["ok"] for r in chk.check({}))


def test_unknown_kind_is_named():
  with pytest.raises(ValueError, match="'headers'"):
    chk.check(SYNTHETIC, [chk.Use("headers", "/generate", "x")])


def _wheel(tmp_path):
  path = tmp_path / "sglang-0.0.0-py3-none-any.whl"
  with zipfile.ZipFile(path, "w") as z:
    for name, text in SYNTHETIC.items():
      z.writestr(name, text)
    z.writestr("sglang/srt/managers/sub/deep.py", "meta_info = {'decoy': 1}\n")
    z.writestr("sglang/srt/other.py", "x = 1\n")
  return path


def test_read_wheel_takes_only_the_files_checked(tmp_path):
  sources = chk.read_wheel(str(_wheel(tmp_path)))
  assert sources == SYNTHETIC


def test_command_prints_a_line_per_use_and_fails_on_gaps(tmp_path):
  r = subprocess.run([sys.executable, "-m", "experiments.sglang_api_check",
                      f"--wheel={_wheel(tmp_path)}"],
                     cwd=ROOT, capture_output=True, text=True, timeout=120)
  lines = [json.loads(ln) for ln in r.stdout.splitlines()]
  assert r.returncode == 1, r.stderr[-2000:]
  assert len(lines) == len(chk.USES) + 1
  summary = lines[-1]
  assert summary["summary"] and summary["checked"] == len(chk.USES)
  assert summary["missing"] == len(GAPS) and summary["contract_checked"]
  assert "reading" in r.stderr
