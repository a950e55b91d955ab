r"""A vLLM server the way the fleet needs it (fr_jax/rollout/vllm.py), from .venv-vllm.

  make vllm-tools                      # once: .venv-vllm, vLLM 0.32 for CPU (requirements-vllm.txt)
  export VLLM_API_KEY=<a secret>       # the server requires it; workers and relays present it
  python -m launch.vllm_server --model=smollm2-135m-instruct --port=30000
  python -m launch.vllm_server --model=/path/to/hf_dir --dtype=bfloat16 --port=30001

--model is an HF directory (config.json, safetensors, tokenizer.json) or a registry model
name (smollm2-135m-instruct, tiny-chat-hd64, ...), written as an HF directory under
--export_dir first (`hf_io.save_hf`; weights as the registry loads them). A model whose LM
head is tied to its embeddings (SmolLM2) is served from an untied copy under --export_dir
(the head a tensor of its own; safetensors linked, not copied): vLLM 0.32 on CPU keeps a
tied head's old weights through an in-place weight update (fr_jax/rollout/vllm.py).

The server is `vllm.entrypoints.openai.api_server` with:
* `--logprobs-mode processed_logprobs`: each token's log-prob from the distribution that
  sampled it;
* `--enable-scale-out`: token ids in and out (`/inference/v1/generate`);
* `--no-enable-chunked-prefill`: vLLM 0.32 on CPU crashes when it chunks the prefill of a
  seeded request, so each prompt is prefilled whole instead;
* `VLLM_SERVER_DEV_MODE=1`: the pause, reload and version routes;
* the key from $VLLM_API_KEY, never on a command line (`ps` shows those to every user),
  required on every route but GET /health (`--middleware launch.vllm_guard.RequireKey`: vLLM
  0.32 checks it only under /v1, /v2, /inference and /cohere, which left /pause,
  /collective_rpc and the other weight routes open);
* on CPU, a KV cache of --kv_cache_gib (vLLM's default takes most of the machine's memory),
  and OpenMP threads left to float (`VLLM_CPU_OMP_THREADS_BIND=nobind`: vLLM's default pins
  one core and keeps the other for itself, which on 2 cores leaves nothing for the learner).

For a LoRA run (`model.lora.rank` R in the learner's config) give `--lora_rank=R` and the
base model (the learner's frozen weights): each version then loads as a PEFT adapter beside
them (`--enable-lora`, `VLLM_ALLOW_RUNTIME_LORA_UPDATING`; the relay writes adapter
directories), a few megabytes instead of the whole model.

It prints `vllm: serving <model> at http://host:port (ready in N s)` once /health answers,
then stays in the foreground with the server; SIGTERM or Ctrl-C stops both. The server's own
log goes to --log (default: stderr). Any further arguments after `--` go to vLLM as they are.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

KEY_ENV = "VLLM_API_KEY"
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


class ServerError(RuntimeError):
  """The server did not start: the reason and the tail of its log."""


def lora_args(rank: int) -> tuple[str, ...]:
  """vLLM's flags for a LoRA run's adapters of `rank` (fr_jax/rollout/vllm.py, "LoRA"): a
  few loaded at once, as `VLLMEngine.ADAPTERS_KEPT` keeps them."""
  from fr_jax.rollout.vllm import VLLMEngine
  return ("--enable-lora", "--max-lora-rank", str(rank),
          "--max-loras", str(VLLMEngine.ADAPTERS_KEPT + 1))


def server_command(model_dir, *, host: str = "127.0.0.1", port: int = 30000,
                   enforce_eager: bool = True,
                   dtype: str = "float32", max_model_len: int = 2048, python=None,
                   served_name: str | None = None, extra=()) -> list[str]:
  """The command line (no key on it: `server_env` carries it)."""
  from fr_jax.rollout.vllm import SERVER_FLAGS
  return [str(python or DEFAULT_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
          "--model", str(model_dir), "--host", host, "--port", str(port), "--dtype", dtype,
          "--max-model-len", str(max_model_len), *(["--enforce-eager"] if enforce_eager else []),
          # every prompt prefilled whole in one step (chunked prefill is off: SERVER_FLAGS)
          "--max-num-batched-tokens", str(max(max_model_len, 2048)),
          "--disable-uvicorn-access-log",  # a line per request would swamp the log
          # the key on every route, not only vLLM's /v1, /inference, ... (launch/vllm_guard.py)
          "--middleware", "launch.vllm_guard.RequireKey",
          "--served-model-name", served_name or Path(model_dir).name, *SERVER_FLAGS, *extra]


def server_env(api_key: str | None, *, kv_cache_gib: int = 1, threads: int | None = None,
               base=None, lora: bool = False) -> dict:
  """The server's environment: the dev routes, the key, a bounded CPU KV cache."""
  from fr_jax.rollout.vllm import SERVER_ENV
  env = dict(os.environ if base is None else base)
  env.pop(KEY_ENV, None)
  env |= SERVER_ENV | {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
                       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_NO_USAGE_STATS": "1",
                       "VLLM_DO_NOT_TRACK": "1"}
  if threads:
    env["OMP_NUM_THREADS"] = str(threads)
  if lora:  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
  # the guard middleware (launch/vllm_guard.py) is imported by the server from this checkout
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
  if api_key:
    env[KEY_ENV] = api_key
  return env


def start(model_dir, *, port: int, api_key: str | None, host: str = "127.0.0.1",
          enforce_eager: bool = True,
          dtype: str = "float32", max_model_len: int = 2048, kv_cache_gib: int = 1,
          log=None, python=None, threads: int | None = None, extra=(),
          lora_rank: int = 0) -> subprocess.Popen:
  """Starts a server process (its own process group, so `stop` ends its engine too);
  `lora_rank` > 0 lets it load a LoRA run's adapters of that rank at run time."""
  python = Path(python or DEFAULT_PYTHON)
  if not python.exists():
    raise ServerError(f"{python} not found: run `make vllm-tools` first (it builds "
                      ".venv-vllm from requirements-vllm.txt)")
  if not (Path(model_dir) / "config.json").is_file():
    raise ServerError(f"{model_dir}: not an HF model directory (no config.json)")
  # vLLM refuses a max_model_len beyond the model's positions: the longest it takes
  positions = json.loads((Path(model_dir) / "config.json").read_text()).get(
      "max_position_embeddings")
  if positions:
    max_model_len = min(max_model_len, int(positions))
  out = open(log, "ab") if log else None  # noqa: SIM115 (the child keeps it)
  return subprocess.Popen(
      server_command(model_dir, host=host, port=port, dtype=dtype, python=python,
                     max_model_len=max_model_len, enforce_eager=enforce_eager,
                     extra=(*extra, *(lora_args(lora_rank) if lora_rank else ()))),
      env=server_env(api_key, kv_cache_gib=kv_cache_gib, threads=threads, lora=lora_rank > 0),
      stdout=out or subprocess.DEVNULL, stderr=subprocess.STDOUT if out else None,
      stdin=subprocess.DEVNULL, start_new_session=True)


def url_of(host: str, port: int) -> str:
  return f"http://{host}:{port}"


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float = 300.0, log=None) -> float:
  """Seconds until `url`/health answers 200; ServerError if the process exits first or the
  time runs out (with the end of `log`)."""
  t0 = time.monotonic()
  while time.monotonic() - t0 < timeout_s:
    if proc.poll() is not None:
      raise ServerError(f"the vLLM server exited with status {proc.returncode} before it was "
                        f"ready{_tail(log)}")
    try:
      with urllib.request.urlopen(url + "/health", timeout=2) as r:
        if r.status == 200:
          return time.monotonic() - t0
    except (urllib.error.URLError, OSError):
      pass
    time.sleep(0.5)
  raise ServerError(f"the vLLM server at {url} was not ready after {timeout_s:g} s{_tail(log)}")


def _tail(log, n: int = 15) -> str:
  if not log or not Path(log).exists():
    return ""
  lines = Path(log).read_text(errors="replace").splitlines()[-n:]
  return ":\n" + "\n".join(lines)


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
  """SIGTERM to the server's process group, SIGKILL after `timeout_s`."""
  if proc.poll() is not None:
    return
  for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
    try:
      os.killpg(proc.pid, sig)
    except ProcessLookupError:
      return
    try:
      proc.wait(wait)
      return
    except subprocess.TimeoutExpired:
      continue


def kill(proc: subprocess.Popen) -> None:
  """SIGKILL to the whole process group at once (a crash: the API server and its engine)."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  proc.wait(10)


def export_model(name: str, out_dir, *, param_dtype: str = "float32") -> Path:
  """An HF directory for `name` (a registry model) under `out_dir/<name>`, written once,
  its LM head untied (`hf_io.untie_head`: what the vLLM engine's weight updates need)."""
  from fr_jax.models import hf_io, registry
  d = Path(out_dir) / name.replace("/", "_").replace(":", "_")
  if (d / "config.json").is_file():
    return d
  m = registry.load(name, param_dtype=param_dtype)
  if m.tokenizer is None:
    raise ServerError(f"model {name!r} has no tokenizer; vLLM needs tokenizer.json")
  tmp = d.with_name(f".{d.name}.tmp")
  shutil.rmtree(tmp, ignore_errors=True)
  hf_io.save_hf(tmp, m.params, m.config, tokenizer_files=m.tokenizer.files())
  hf_io.untie_head(tmp)
  tmp.rename(d)
  return d


def untied(model_dir, out_dir) -> Path:
  """`model_dir` itself if its LM head is untied; otherwise an untied copy under `out_dir`
  (its safetensors linked, not copied; `hf_io.untie_head` adds the head), made once."""
  from fr_jax.models import hf_io
  model_dir = Path(model_dir).absolute()
  config = json.loads((model_dir / "config.json").read_text())
  if not config.get("tie_word_embeddings", False):
    return model_dir
  d = Path(out_dir).absolute() / f"{model_dir.name}-untied"
  if (d / hf_io.UNTIED_HEAD_FILE).is_file():
    return d
  tmp = d.with_name(f".{d.name}.tmp")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  for f in model_dir.iterdir():
    if f.is_file():
      if f.suffix == ".safetensors":
        (tmp / f.name).symlink_to(f)
      else:
        shutil.copy2(f, tmp / f.name)
  hf_io.untie_head(tmp)
  shutil.rmtree(d, ignore_errors=True)
  tmp.rename(d)
  return d


def main(argv=None) -> int:
  from absl import flags
  flags.DEFINE_string("model", "smollm2-135m-instruct", "an HF directory or a registry model")
  flags.DEFINE_string("export_dir", "runs/vllm_models", "where a registry model is written")
  flags.DEFINE_string("host", "127.0.0.1", "address to bind")
  flags.DEFINE_integer("port", 30000, "port")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "serving dtype")
  flags.DEFINE_integer("max_model_len", 2048, "longest prompt + completion, tokens")
  flags.DEFINE_integer("kv_cache_gib", 1, "CPU KV cache, GiB (VLLM_CPU_KVCACHE_SPACE)")
  flags.DEFINE_string("log", "", "the server's log file (default: stderr)")
  flags.DEFINE_string("python", str(DEFAULT_PYTHON), "the python of the vLLM environment")
  flags.DEFINE_bool("allow_no_key", False, "serve without $VLLM_API_KEY (loopback tests)")
  flags.DEFINE_bool("enforce_eager", True, "no compiled graphs (CPU: no compile at start; on "
                    "GPUs --noenforce_eager captures CUDA graphs, faster decode)")
  flags.DEFINE_float("ready_timeout_s", 300.0, "give up if /health does not answer by then")
  flags.DEFINE_integer("lora_rank", 0, "a LoRA run (model.lora.rank): load its versions as "
                       "adapters of this rank at run time (--enable-lora); 0: no adapters")
  from launch import common
  args = common.parse_flags(sys.argv if argv is None else argv)
  f = flags.FLAGS
  key = os.environ.get(KEY_ENV, "")
  if not key and not f.allow_no_key:
    common.fail(f"export {KEY_ENV}=<a secret> first: the server requires it, and workers and "
                "relays present it (or --allow_no_key for an open server on loopback)")
  if f.kv_cache_gib < 1:
    common.fail(f"--kv_cache_gib={f.kv_cache_gib}: at least 1")
  model_dir = Path(f.model)
  from fr_jax.models import registry
  try:
    if model_dir.is_dir():
      if not (model_dir / "config.json").is_file():
        common.fail(f"--model={f.model}: a directory without config.json is not an HF model")
      model_dir = untied(model_dir, f.export_dir)
    else:
      print(f"vllm: writing {f.model} as an HF directory under {f.export_dir}", flush=True)
      model_dir = export_model(f.model, f.export_dir)
  except (registry.ModelNotFound, registry.CheckpointError, ServerError, OSError) as e:
    common.fail(f"--model={f.model}: {e}")
  extra = args[1:]
  try:
    proc = start(model_dir, port=f.port, host=f.host, api_key=key or None, dtype=f.dtype,
                 max_model_len=f.max_model_len, kv_cache_gib=f.kv_cache_gib,
                 log=f.log or None, python=f.python, enforce_eager=f.enforce_eager,
                 extra=extra, lora_rank=f.lora_rank)
  except ServerError as e:
    common.fail(str(e))
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop(proc))
  url = url_of(f.host, f.port)
  try:
    s = wait_ready(proc, url, timeout_s=f.ready_timeout_s, log=f.log or None)
  except ServerError as e:
    stop(proc)
    common.fail(str(e))
  print(f"vllm: serving {model_dir} at {url} (ready in {s:.0f} s)", flush=True)
  return proc.wait()


if __name__ == "__main__":
  sys.exit(main())
