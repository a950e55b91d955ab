"""A STAND-IN for an SGLang server, for tests only. It is not SGLang.

Real SGLang needs CUDA and cannot run on this machine. This small HTTP server speaks the
subset of SGLang's native API that fr_jax's client uses (/generate, /update_weights_from_disk,
/pause_generation, /continue_generation, /abort_request, /health), with the documented field
names, and answers with fr_jax's embedded engine. It rejects fields it does not know, so a
client that drifts from the documented API fails here.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from fr_jax.models import registry
from fr_jax.rollout.embedded import EmbeddedEngine
from fr_jax.rollout.engine import Request

GENERATE_KEYS = {"input_ids", "sampling_params", "return_logprob", "logprob_start_len", "rid"}
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "skip_special_tokens",
                 "no_stop_trim", "sampling_seed", "stop_token_ids", "stop"}


class _Pending:
  def __init__(self, req: Request):
    self.req, self.done, self.result = req, threading.Event(), None


class StandInSGLang:
  def __init__(self, model: registry.LoadedModel, *, num_slots: int = 4, max_len: int = 256,
               step_delay: float = 0.0):
    self.engine = EmbeddedEngine(model.config, model.params, tokenizer=model.tokenizer,
                                 num_slots=num_slots, max_len=max_len)
    self.model_config = model.config
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
    self.http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
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
        batch, self.queue = self.queue, []
        self.running = batch
        self.abort_running = False
      outs = self.engine.generate([p.req for p in batch], should_abort=self._tick)
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
  def generate(self, body: dict) -> dict:
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
    p = _Pending(req)
    with self.cond:
      self.queue.append(p)
      self.cond.notify_all()
    p.done.wait()
    c, version = p.result
    return {"text": None, "output_ids": c.token_ids, "meta_info": {
        "id": req.request_id, "finish_reason": {"type": c.finish_reason},
        "prompt_tokens": len(req.prompt_ids), "completion_tokens": len(c.token_ids),
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(c.logprobs, c.token_ids)],
        "weight_version": str(c.versions[-1] if c.versions else version)}}

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
    m = registry.load(f"hf:{body['model_path']}")
    if m.config.replace(param_dtype="float32") != self.model_config.replace(
        param_dtype="float32"):
      return {"success": False, "message": "architecture differs from the served model"}
    self.engine.update_weights(m.params, int(body.get("weight_version", 0)))
    return {"success": True, "message": f"loaded {body['model_path']}"}

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
              "/abort_request": server.abort_request}

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

      def do_GET(self):
        if self.path == "/health":
          self._send(200, {})
        else:
          self._send(404, {"error": f"no route {self.path}"})

      def do_POST(self):
        fn = routes.get(self.path)
        if fn is None:
          return self._send(404, {"error": f"no route {self.path}"})
        try:
          body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
          server.log.append((self.path, body))
          self._send(200, fn(body))
        except (ValueError, KeyError, TypeError) as e:
          self._send(400, {"error": f"{type(e).__name__}: {e}"})

    return Handler
