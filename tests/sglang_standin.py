"""A STAND-IN for an SGLang server, for tests only. It is not SGLang.

Real SGLang needs CUDA and cannot run on this machine. This small HTTP server speaks the
subset of SGLang's native API that fr_jax's client uses (/generate, /update_weights_from_disk,
/pause_generation, /continue_generation, /abort_request, /health), with the documented field
names, and answers with fr_jax's embedded engine. It rejects fields it does not know, so a
client that drifts from the documented API fails here.

sglang-router (a real router, tests/test_weight_relay.py) re-serialises /generate with every
field of SGLang's request type at its default; those are accepted at exactly those defaults
(`ROUTER_DEFAULTS`). Each server counts the /generate calls it answered and records every
weight load (`loads`: version, path, time), so tests can see how a router spread requests and
when each server switched weights.

Streaming: a /generate with `"stream": true` answers with server-sent events as SGLang
0.5.23 writes them by default: the answer so far after each sampled token (finish_reason
null), the whole answer last, then `data: [DONE]`.

Routing replay (R3): with `enable_return_routed_experts=True` (SGLang's
`--enable-return-routed-experts`; off by default, as there) a /generate with
`return_routed_experts` answers with `meta_info.routed_experts` in SGLang 0.5.23's format:
base64 of little-endian int32 [seqlen - 1 - start, layers, k] for positions
start .. seqlen - 2, start = min(routed_experts_start_len, seqlen - 1), a row for every layer of
`routing_config` with the dense layers' rows zero; a request aborted before it ran has no
field. With the flag off the field is left out, silently, as SGLang does; `/server_info`
reports the flag. The served model is dense, so the routing is MADE UP (`standin_routing`): a
fixed function of the token, its position, the layer and the weight version that computed it.

LoRA: with `enable_lora=True` (SGLang's `--enable-lora`, `max_lora_rank`,
`lora_target_modules` as its --max-lora-rank and --lora-target-modules) `/load_lora_adapter`
reads a PEFT adapter directory and keeps the served weights with it folded in
(W + lora_alpha / r x B A, in float32, from the PEFT files themselves); `/unload_lora_adapter`
drops one, `/update_weight_version` sets the label answers carry, and a /generate naming an
adapter (`lora_path`) samples with it. One adapter runs at a time (SGLang's
--max-loras-per-batch 1): the scheduler takes the queued requests of the first one's adapter.
Without the flag a load fails with SGLang 0.5.23's message ("LoRA is not enabled").

`PublishedWeights` stands in for the learner's side of the weight service: what
`fr_jax.transport.server.serve` needs from a LearnerService for GetWeights and Heartbeat,
over parameters published by hand (the weight relay's tests and benchmark).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from fr_jax.models import decoder, hf_io, registry
from fr_jax.models.config import ModelConfig, from_hf_config
from fr_jax.models.hf_io import CheckpointError
from fr_jax.rollout.embedded import EmbeddedEngine
from fr_jax.rollout.engine import Request

GENERATE_KEYS = {"input_ids", "sampling_params", "return_logprob", "logprob_start_len", "rid",
                 "return_routed_experts", "routed_experts_start_len", "lora_path"}
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "skip_special_tokens",
                 "no_stop_trim", "sampling_seed", "stop_token_ids", "stop"}
# Fields of SGLang's GenerateReqInput that sglang-router 0.3.2 always sends, at these values.
ROUTER_DEFAULTS = {"model": None, "return_text_in_logprobs": False,
                   "log_metrics": True, "return_hidden_states": False, "background": False,
                   "no_logs": False, "return_bytes": False, "return_entropy": False}


def standin_routing(cfg: ModelConfig, tokens, positions, version: int) -> np.ndarray:
  """The stand-in's MADE-UP routing, int32 [len(positions), cfg.num_layers, k]: at position i
  a sparse layer `layer` picks experts (b + j) % E for j < k, b = (31 tokens[i] + 7 i +
  13 layer + 101 version) % E; a dense layer's row is zeros (SGLang never writes it)."""
  E, k = cfg.num_experts, cfg.num_experts_per_tok
  out = np.zeros((len(positions), cfg.num_layers, k), np.int32)
  for r, i in enumerate(positions):
    for layer in cfg.moe_layers:
      b = (31 * tokens[i] + 7 * i + 13 * layer + 101 * version) % E
      out[r, layer] = [(b + j) % E for j in range(k)]
  return out


class _Pending:
  def __init__(self, req: Request, adapter: str | None = None):
    self.req, self.done, self.result = req, threading.Event(), None
    self.adapter = adapter  # the LoRA adapter it samples with (None: the base weights)
    self.ran = False  # taken into a batch (not aborted while queued)


class StandInSGLang:
  def __init__(self, model: registry.LoadedModel, *, num_slots: int = 4, max_len: int = 256,
               step_delay: float = 0.0, drop_before_load: bool = False,
               enable_return_routed_experts: bool = False,
               routing_config: ModelConfig | None = None, port: int = 0, api_key: str = "",
               refuse_file: str = "", enable_lora: bool = False, max_lora_rank: int = 16,
               lora_target_modules: tuple = ("q_proj", "k_proj", "v_proj", "o_proj",
                                             "gate_proj", "up_proj", "down_proj")):
    self.engine = EmbeddedEngine(model.config, model.params, tokenizer=model.tokenizer,
                                 num_slots=num_slots, max_len=max_len)
    self.model_config = model.config
    # R3: the server flag, and the MoE shape whose (made-up) routing is reported.
    self.enable_return_routed_experts = enable_return_routed_experts
    self.routing_config = routing_config
    # Free the old weights before reading the new ones (tensor by tensor), as SGLang
    # overwrites its own in place: two copies of a big model need not fit. A failed load then
    # leaves none.
    self.drop_before_load = drop_before_load
    self.loads: list[tuple[int, str, float]] = []  # (version, path, time.time() when loaded)
    self.enable_lora, self.max_lora_rank = enable_lora, max_lora_rank
    self.lora_target_modules = set(lora_target_modules)
    self.base = self.engine.params  # the weights without adapters
    self.adapters: dict[str, dict] = {}  # name -> the served weights with it folded in
    self.labelled = False  # /update_weight_version named a version
    self.applied: str | None = None  # the adapter folded into the engine's weights now
    self.generated = 0  # /generate calls answered
    self.cond = threading.Condition()
    self.queue: list[_Pending] = []
    self.paused = False
    self.abort_running = False
    self.running: list[_Pending] = []
    self.log: list[tuple[str, dict]] = []  # (path, payload) of every call, for tests
    self.stop = False
    self.step_delay = step_delay  # seconds per decode step, to make mid-generation events testable
    self.steps = 0
    handler = self._handler()
    self.api_key = api_key  # as SGLang's --api-key: every route but /health needs the bearer
    self.refuse_file = refuse_file  # while this file exists, every weight load is refused
    self.http = ThreadingHTTPServer(("127.0.0.1", port), handler)
    self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
    self._threads = [threading.Thread(target=self.http.serve_forever, daemon=True),
                     threading.Thread(target=self._schedule, daemon=True)]
    for t in self._threads:
      t.start()

  def close(self):
    with self.cond:
      self.stop = True
      self.cond.notify_all()
    self.http.shutdown()
    self.http.server_close()

  # --- the scheduler: batches queued requests through the engine ---
  def _schedule(self):
    while True:
      with self.cond:
        while not self.stop and (self.paused or not self.queue):
          self.cond.wait()
        if self.stop:
          return
        adapter = self.queue[0].adapter  # one adapter at a time (--max-loras-per-batch 1)
        batch = [p for p in self.queue if p.adapter == adapter]
        self.queue = [p for p in self.queue if p.adapter != adapter]
        if adapter != self.applied:
          self.engine.params = self.base if adapter is None else self.adapters[adapter]
          self.applied = adapter
        self.running = batch
        for p in batch:
          p.ran = True
        self.abort_running = False
      try:
        outs = self.engine.generate([p.req for p in batch], should_abort=self._tick)
      except Exception as e:  # answered as HTTP 500, not a hang until the client's timeout
        outs = [e] * len(batch)
      with self.cond:
        for p, c in zip(batch, outs):
          p.result = (c, self.engine.version)
          p.done.set()
        self.running = []
        self.cond.notify_all()

  def _tick(self) -> bool:
    self.steps += 1
    if self.step_delay:
      time.sleep(self.step_delay)
    return self.abort_running

  # --- endpoints ---
  def generate(self, body: dict, stream=None) -> dict:
    """One /generate answer; with `stream` (a function taking each token's answer so far),
    SGLang 0.5.23's default (cumulative) stream: after each sampled token the answer as it
    stands, output_token_logprobs and completion_tokens included, finish_reason null."""
    for k, v in ROUTER_DEFAULTS.items():
      if k in body and body.pop(k) != v:
        raise ValueError(f"{k}={v!r} is the only value this stand-in supports")
    unknown = set(body) - GENERATE_KEYS
    sp = body.get("sampling_params", {})
    unknown |= {f"sampling_params.{k}" for k in set(sp) - SAMPLING_KEYS}
    if unknown:
      raise ValueError(f"unknown fields {sorted(unknown)}")
    if not body.get("return_logprob"):
      raise ValueError("this stand-in always needs return_logprob=true")
    req = Request(str(body.get("rid", "")), [int(t) for t in body["input_ids"]],
                  max_new_tokens=int(sp.get("max_new_tokens", 128)),
                  temperature=float(sp.get("temperature", 1.0)),
                  top_p=float(sp.get("top_p", 1.0)), seed=int(sp.get("sampling_seed", 0)),
                  stop_token_ids=tuple(sp.get("stop_token_ids", ())),
                  stop_strings=tuple(sp.get("stop", ())))
    req.check(self.model_config.vocab_size)
    if stream is not None:
      so_far = []

      def on_token(t, lp):
        so_far.append([lp, t, None])
        stream({"text": None, "output_ids": [e[1] for e in so_far], "meta_info": {
            "id": req.request_id, "finish_reason": None, "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(so_far), "output_token_logprobs": list(so_far),
            "weight_version": str(self.engine.version)}})

      req.on_token = on_token
    routed_start = None
    if body.get("return_routed_experts"):  # SGLang checks the start, flag or not
      routed_start = int(body.get("routed_experts_start_len", 0))
      if not 0 <= routed_start <= len(req.prompt_ids):
        raise ValueError(f"routed_experts_start_len={routed_start} outside "
                         f"[0, {len(req.prompt_ids)}]")
    adapter = body.get("lora_path")
    if adapter is not None and adapter not in self.adapters:
      raise ValueError(f"The following requested LoRA adapters are not loaded: {adapter}")
    p = _Pending(req, adapter)
    with self.cond:
      self.queue.append(p)
      self.cond.notify_all()
    p.done.wait()
    c, version = p.result
    if isinstance(c, Exception):
      raise RuntimeError(f"the stand-in's engine failed: {type(c).__name__}: {c}") from c
    with self.cond:
      self.generated += 1
    meta = {"id": req.request_id, "finish_reason": {"type": c.finish_reason},
            "prompt_tokens": len(req.prompt_ids), "completion_tokens": len(c.token_ids),
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(c.logprobs, c.token_ids)],
            "weight_version": str(c.versions[-1] if c.versions else version)}
    if routed_start is not None and self.enable_return_routed_experts and p.ran:
      seq = req.prompt_ids + c.token_ids
      first = min(routed_start, len(seq) - 1)
      ids = standin_routing(self.routing_config, seq, range(first, len(seq) - 1),
                            c.versions[0] if c.versions else version)
      meta["routed_experts"] = base64.b64encode(ids.astype("<i4").tobytes()).decode()
    return {"text": None, "output_ids": c.token_ids, "meta_info": meta}

  def server_info(self) -> dict:
    """A few of the server arguments SGLang's /server_info lists (all of them, there)."""
    return {"enable_return_routed_experts": self.enable_return_routed_experts,
            "version": "stand-in", "max_total_num_tokens": self.engine.max_len}

  def pause(self, body: dict) -> dict:
    if body.get("mode", "abort") != "abort":
      raise ValueError(f"this stand-in supports mode 'abort' only, got {body.get('mode')!r}")
    with self.cond:
      self.paused = True
      self.abort_running = True
      while self.running:
        self.cond.wait()
    return {"success": True}

  def resume(self, body: dict) -> dict:
    with self.cond:
      self.paused = False
      self.cond.notify_all()
    return {"success": True}

  def update_weights(self, body: dict) -> dict:
    unknown = set(body) - {"model_path", "weight_version", "flush_cache", "load_format"}
    if unknown:
      raise ValueError(f"unknown fields {sorted(unknown)}")
    path = Path(body["model_path"])
    if self.refuse_file and os.path.exists(self.refuse_file):
      return {"success": False, "message": f"refused: {self.refuse_file} exists (a fault)"}
    try:
      hf = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
      return {"success": False, "message": f"cannot read {path}/config.json: {e}"}
    same = dict(param_dtype=self.model_config.param_dtype,
                compute_dtype=self.model_config.compute_dtype)
    if from_hf_config(hf, **same) != self.model_config.replace(attention="auto"):
      return {"success": False, "message": "architecture differs from the served model"}
    version = int(body.get("weight_version", 0))
    if self.drop_before_load:
      self.engine.params = None
    try:
      params = self._read_in_served_layout(path)
    except (OSError, CheckpointError) as e:
      return {"success": False, "message": f"cannot load {path}: {e}"}
    # the engine's update_weights, minus its re-layout (the tensors came in that layout)
    self.engine.params, self.engine.version = params, version
    self.base, self.applied = params, None
    del params
    with self.cond:
      self.loads.append((version, str(path), time.time()))
    return {"success": True, "message": f"loaded {body['model_path']}"}

  # --- LoRA ---
  def load_lora_adapter(self, body: dict) -> dict:
    unknown = set(body) - {"lora_name", "lora_path", "pinned"}
    if unknown:
      raise ValueError(f"unknown fields {sorted(unknown)}")
    name, path = body["lora_name"], Path(body["lora_path"])
    if not self.enable_lora:
      return {"success": False, "error_message": "LoRA is not enabled. Please set "
              "`--enable-lora` to enable LoRA."}
    with self.cond:
      if name in self.adapters:
        return {"success": False, "error_message": f"Failed to load LoRA adapter {name} "
                "because it is already loaded"}
    try:
      merged = self._fold_adapter(path)
    except (OSError, ValueError, KeyError, CheckpointError) as e:
      return {"success": False, "error_message": f"cannot load {path}: {e}"}
    with self.cond:
      self.adapters[name] = merged
      return {"success": True, "loaded_adapters": {n: "stand-in" for n in self.adapters}}

  def unload_lora_adapter(self, body: dict) -> dict:
    with self.cond:
      if self.adapters.pop(body["lora_name"], None) is None:
        return {"success": False, "error_message": f"LoRA with name {body['lora_name']} "
                "does not exist."}
      return {"success": True, "loaded_adapters": {n: "stand-in" for n in self.adapters}}

  def update_weight_version(self, body: dict) -> dict:
    if body.get("abort_all_requests", True):
      raise ValueError("this stand-in supports abort_all_requests=false only")
    self.engine.version = int(body["new_version"])
    self.labelled = True
    return {"success": True, "new_version": body["new_version"]}

  def _fold_adapter(self, path: Path) -> dict:
    """The base weights with the PEFT adapter at `path` folded in, in the served layout."""
    conf = json.loads((path / hf_io.PEFT_CONFIG).read_text())
    r, alpha = int(conf["r"]), float(conf["lora_alpha"])
    if r > self.max_lora_rank:
      raise ValueError(f"LoRA rank {r} exceeds --max-lora-rank {self.max_lora_rank}")
    extra = set(conf["target_modules"]) - self.lora_target_modules
    if extra:
      raise ValueError(f"target modules {sorted(extra)} are not in --lora-target-modules")
    with safe_open(str(path / hf_io.PEFT_WEIGHTS), framework="numpy") as f:
      factors = {k: f.get_tensor(k).astype(np.float32) for k in f.keys()}
    cfg = self.model_config
    q, kv, ff = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    # where each HF projection sits in the served layout: (matrix, first column, columns),
    # q/k/v and gate/up fused column-wise (`decoder.decode_layout`)
    slot = {"self_attn.q_proj.weight": ("wqkv", 0, q), "self_attn.k_proj.weight": ("wqkv", q, kv),
            "self_attn.v_proj.weight": ("wqkv", q + kv, kv),
            "self_attn.o_proj.weight": ("wo", 0, cfg.hidden_size),
            "mlp.gate_proj.weight": ("w_gate_up", 0, ff),
            "mlp.up_proj.weight": ("w_gate_up", ff, ff),
            "mlp.down_proj.weight": ("w_down", 0, cfg.hidden_size)}
    # (a layout read from disk has them apart: fused here as the engine's own load does)
    layers = [decoder._fuse_projections(lp) for lp in self.base["layer_list"]]
    for name, a in factors.items():
      weight, ab = hf_io.adapted_weight(name)
      if ab != "a":
        continue
      b = factors[hf_io.adapter_name(weight, "b")]
      _, i, rest = weight.removeprefix("model.").split(".", 2)
      k, c0, n = slot[rest]
      delta = (alpha / r) * (b @ a)  # [out, in], HF's layout; ours is [in, out]
      w = np.array(layers[int(i)][k], np.float32)
      w[:, c0:c0 + n] += delta.T
      layers[int(i)][k] = jnp.asarray(w, layers[int(i)][k].dtype)
    return {**self.base, "layer_list": tuple(layers)}

  def _read_in_served_layout(self, path: Path) -> dict:
    """The HF checkpoint at `path` in the engine's decode layout (`decoder.decode_layout`),
    read one tensor at a time, as SGLang loads into its weights in place: the load needs
    the model once plus one tensor, not the two to three copies of `registry.load`."""
    cfg = self.model_config
    dtype = jnp.dtype(cfg.param_dtype)
    files = hf_io._weight_files(path)
    handles = [safe_open(str(f), framework="numpy") for f in files]
    where = {k: h for h in handles for k in h.keys()}

    def take(name, shape, transpose=False):
      if name not in where:
        raise CheckpointError(f"tensor {name!r} is missing")
      a = where[name].get_tensor(name)
      a = a.T if transpose else a
      if a.shape != tuple(shape):
        raise CheckpointError(f"{name!r} has shape {a.shape}, the served model {shape}")
      return jnp.asarray(np.ascontiguousarray(a), dtype)

    shapes = decoder.param_shapes(cfg)
    out = {k: take(hf_name, shapes[k]) for k, hf_name in hf_io._TOP_NAMES.items()
           if k in shapes}
    out["layer_list"] = tuple(
        {k: take(f"model.layers.{i}.{hf_io._LAYER_NAMES[k][0]}", shape[1:],
                 hf_io._LAYER_NAMES[k][1]) for k, shape in shapes["layers"].items()}
        for i in range(cfg.num_layers))
    return out

  def abort_request(self, body: dict) -> dict:
    with self.cond:
      rid = body.get("rid")
      for p in list(self.queue):
        if p.req.request_id == rid:
          self.queue.remove(p)
          from fr_jax.rollout.engine import Completion
          p.result = (Completion(rid, [], [], "abort", [], len(p.req.prompt_ids)),
                      self.engine.version)
          p.done.set()
      if any(p.req.request_id == rid for p in self.running):
        self.abort_running = True
    return {"success": True}

  def _handler(self):
    server = self
    routes = {"/generate": server.generate, "/pause_generation": server.pause,
              "/continue_generation": server.resume,
              "/update_weights_from_disk": server.update_weights,
              "/abort_request": server.abort_request,
              "/load_lora_adapter": server.load_lora_adapter,
              "/unload_lora_adapter": server.unload_lora_adapter,
              "/update_weight_version": server.update_weight_version}

    class Handler(BaseHTTPRequestHandler):
      def log_message(self, *args):
        pass

      def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

      def _stream(self, body):
        """Server-sent events, as SGLang writes them: `data: {answer}` per token, the whole
        answer last, then `data: [DONE]` (HTTP/1.0: the body ends with the connection)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        out = lambda obj: self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")  # noqa: E731
        try:
          out(server.generate(body, stream=out))
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
          out({"error": {"message": f"{type(e).__name__}: {e}"}})
        self.wfile.write(b"data: [DONE]\n\n")

      def _refused(self) -> bool:
        if server.api_key and self.path != "/health" and (
            self.headers.get("Authorization") != f"Bearer {server.api_key}"):
          self._send(401, {"error": "Unauthorized"})
          return True
        return False

      def do_GET(self):
        if self._refused():
          return None
        if self.path == "/health":
          self._send(200, {})
        elif self.path == "/server_info":
          self._send(200, server.server_info())
        elif self.path == "/model_info":  # SGLang: "default" until a load names a version
          v = server.engine.version if server.loads or server.labelled else "default"
          self._send(200, {"weight_version": str(v), "model_path": "stand-in"})
        else:
          self._send(404, {"error": f"no route {self.path}"})

      def do_POST(self):
        if self._refused():
          return None
        fn = routes.get(self.path)
        if fn is None:
          return self._send(404, {"error": f"no route {self.path}"})
        try:
          body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
          server.log.append((self.path, dict(body)))
          if self.path == "/generate" and body.pop("stream", False):
            return self._stream(body)
          out = fn(body)
          self._send(400 if out.get("success") is False and "error_message" in out else 200,
                     out)
        except (ValueError, KeyError, TypeError) as e:
          self._send(400, {"error": f"{type(e).__name__}: {e}"})
        except RuntimeError as e:
          self._send(500, {"error": str(e)})

    return Handler


class PublishedWeights:
  """The learner's side of the weight service and nothing else: what `serve` needs from a
  LearnerService (weights by version, heartbeats with the shutdown flag), over parameters
  published by hand."""

  def __init__(self):
    self._lock = threading.Lock()
    self._published = (-1, None)
    self.shutdown = threading.Event()
    self.hf_dir = ""
    self.workers: dict = {}  # worker id -> its last stats

  def publish(self, version: int, params) -> None:
    with self._lock:
      self._published = (version, params)

  @property
  def version(self) -> int:
    return self._published[0]

  def weights(self, min_version: int = 0):
    with self._lock:
      v, p = self._published
    return (v, p) if v >= min_version else None

  def heartbeat(self, worker_id: str, stats: dict) -> dict:
    self.workers[worker_id] = stats
    return dict(version=self.version, queue_depth=0, queue_capacity=0, inflight_target=0,
                shutdown=self.shutdown.is_set(), hf_dir=self.hf_dir)

  def system_metrics(self) -> dict:
    return {}


def main():
  """The stand-in as a process, for the fleet chaos run (experiments/chaos/fleet.py)."""
  p = argparse.ArgumentParser(description="A STAND-IN SGLang server for tests and the fleet "
                              "chaos run (not SGLang); the API key is $SGLANG_API_KEY")
  p.add_argument("--model", default="tiny-chat")
  p.add_argument("--port", type=int, required=True)
  p.add_argument("--max_len", type=int, default=1024)
  p.add_argument("--num_slots", type=int, default=8)
  p.add_argument("--refuse_file", default="", help="weight loads are refused while it exists")
  a = p.parse_args()
  server = StandInSGLang(registry.load(a.model), num_slots=a.num_slots, max_len=a.max_len,
                         port=a.port, api_key=os.environ.get("SGLANG_API_KEY", ""),
                         refuse_file=a.refuse_file)
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  print(f"stand-in SGLang on {server.url}", flush=True)
  stop.wait()
  server.close()


if __name__ == "__main__":
  main()
