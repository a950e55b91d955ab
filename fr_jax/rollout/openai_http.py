"""The gateway's HTTP side: OpenAI-compatible routes over `fr_jax.rollout.gateway.Gateway`.

Routes (every one but /health needs `Authorization: Bearer KEY`):
* `POST /v1/chat/completions`, `POST /v1/completions`: as OpenAI's, `stream` included. The
  episode id comes from the `X-Episode-Id` header or an `episode_id` field (a new one when
  neither is given); the response carries it (`episode_id`, and the `X-Episode-Id` header),
  with the segment and the policy version that sampled the reply.
* `POST /v1/episodes/{id}/reward` with `{"reward": R}` (and optionally `"prompt_id"`): ends
  the episode; its records go to the learner. `GET /v1/episodes/{id}`: its state.
* `GET /v1/models`, `GET /metrics` (the gateway's counters), `GET /health`.

Streaming (`"stream": true`) sends server-sent events in OpenAI's chunk format once the turn
is sampled: the embedded engine hands a completion over whole, so the chunks come together
at its end (role, content, tool calls, finish reason, usage if `stream_options` asks).

Hostile clients: bodies over `max_body_bytes` are refused (413) before they are read, a
connection idle for `timeout_s` is closed, at most `max_connections` requests run at once
(503 past that), a wrong key gets 401 in constant time, and errors are OpenAI-shaped JSON with
a named `code`.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from fr_jax.rollout.gateway import GatewayError

log = logging.getLogger("fr_jax.gateway")
_REWARD = re.compile(r"^/v1/episodes/([^/]+)/reward$")
_EPISODE = re.compile(r"^/v1/episodes/([^/]+)$")


class GatewayServer(ThreadingHTTPServer):
  daemon_threads = True
  allow_reuse_address = True

  def __init__(self, address: tuple[str, int], gateway, api_key: str, *,
               max_body_bytes: int = 4 << 20, max_connections: int = 64,
               timeout_s: float = 60.0, tls_cert: str = "", tls_key: str = ""):
    if not api_key:
      raise ValueError("the gateway needs an API key")
    super().__init__(address, _Handler)
    self.gateway, self.key = gateway, api_key.encode()
    self.max_body_bytes, self.timeout_s = max_body_bytes, timeout_s
    self.slots = threading.BoundedSemaphore(max_connections)
    if tls_cert:
      ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
      ctx.load_cert_chain(tls_cert, tls_key or None)
      self.socket = ctx.wrap_socket(self.socket, server_side=True)

  @property
  def port(self) -> int:
    return self.server_address[1]

  def serve_in_thread(self) -> threading.Thread:
    t = threading.Thread(target=self.serve_forever, daemon=True, name="gateway-http")
    t.start()
    return t


class _Handler(BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  server: GatewayServer

  def setup(self):
    super().setup()
    self.connection.settimeout(self.server.timeout_s)

  def log_message(self, fmt, *args):  # quiet: the gateway's own log says what matters
    log.debug("%s " + fmt, self.address_string(), *args)

  def _send(self, status: int, obj: dict, headers: dict | None = None) -> None:
    data = json.dumps(obj).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    for k, v in (headers or {}).items():
      self.send_header(k, v)
    self.end_headers()
    self.wfile.write(data)

  def _error(self, status: int, code: str, message: str) -> None:
    kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    self._send(status, {"error": {"message": message, "type": kind, "code": code,
                                  "param": None}})

  def _authorized(self) -> bool:
    got = self.headers.get("Authorization", "")
    token = got[7:].strip().encode() if got.startswith("Bearer ") else b""
    return hmac.compare_digest(token, self.server.key)

  def _body(self) -> dict | None:
    try:
      n = int(self.headers.get("Content-Length", ""))
    except ValueError:
      self._error(411, "length_required", "a body needs Content-Length")
      return None
    if n < 0 or n > self.server.max_body_bytes:
      self.close_connection = True
      self._error(413, "body_too_large",
                  f"body of {n} bytes (at most {self.server.max_body_bytes})")
      return None
    try:
      body = json.loads(self.rfile.read(n) or b"{}")
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
      self._error(400, "invalid_json", f"body is not valid JSON ({type(e).__name__})")
      return None
    if not isinstance(body, dict):
      self._error(400, "invalid_json", "body must be a JSON object")
      return None
    return body

  def _route(self, method: str) -> None:
    path = self.path.split("?", 1)[0]
    if method == "GET" and path == "/health":
      self._send(200, {"status": "ok"})
      return
    if not self._authorized():
      self.close_connection = True
      self._error(401, "invalid_api_key", "missing or wrong API key (Authorization: Bearer)")
      return
    if not self.server.slots.acquire(blocking=False):
      self._error(503, "overloaded", "too many requests in progress; try again")
      return
    try:
      self._dispatch(method, path)
    except GatewayError as e:
      self._error(e.status, e.code, str(e))
    except (ConnectionError, TimeoutError):
      self.close_connection = True
    except Exception as e:  # noqa: BLE001 (a bug must not kill the server; it is logged)
      log.exception("gateway: %s %s failed", method, path)
      self._error(500, "internal_error", f"{type(e).__name__}: {e}")
    finally:
      self.server.slots.release()

  def _dispatch(self, method: str, path: str) -> None:
    g = self.server.gateway
    if method == "GET":
      if path == "/v1/models":
        self._send(200, {"object": "list", "data": [
            {"id": g.cfg.model_name, "object": "model", "owned_by": "fr_jax"}]})
      elif path == "/metrics":
        self._send(200, g.metrics())
      elif m := _EPISODE.match(path):
        self._send(200, g.episode(m.group(1)))
      else:
        self._error(404, "not_found", f"no route GET {path}")
      return
    body = self._body()
    if body is None:
      return
    if m := _REWARD.match(path):
      self._send(200, g.reward(m.group(1), body))
      return
    if path not in ("/v1/chat/completions", "/v1/completions"):
      self._error(404, "not_found", f"no route POST {path}")
      return
    episode = self.headers.get("X-Episode-Id")
    chat = path == "/v1/chat/completions"
    out = g.chat(body, episode) if chat else g.complete(body, episode)
    headers = {"X-Episode-Id": out["episode_id"]}
    if body.get("stream"):
      usage = isinstance(body.get("stream_options"), dict) and body["stream_options"].get(
          "include_usage")
      self._stream(out, chat, bool(usage), headers)
    else:
      self._send(200, out, headers)

  def _stream(self, out: dict, chat: bool, usage: bool, headers: dict) -> None:
    """The response as server-sent events in OpenAI's chunk format."""
    self.send_response(200)
    self.send_header("Content-Type", "text/event-stream")
    self.send_header("Cache-Control", "no-cache")
    self.send_header("Connection", "close")
    for k, v in headers.items():
      self.send_header(k, v)
    self.end_headers()
    self.close_connection = True
    base = {k: out[k] for k in ("id", "created", "model", "episode_id", "segment",
                                "policy_version")}
    base["object"] = "chat.completion.chunk" if chat else "text_completion"
    choice = out["choices"][0]
    if chat:
      msg = choice["message"]
      deltas = [{"role": "assistant", "content": ""}]
      if msg.get("content"):
        deltas.append({"content": msg["content"]})
      if msg.get("tool_calls"):
        deltas.append({"tool_calls": [{"index": i, **c}
                                      for i, c in enumerate(msg["tool_calls"])]})
      chunks = [{"index": 0, "delta": d, "finish_reason": None, "logprobs": None}
                for d in deltas]
      chunks.append({"index": 0, "delta": {}, "finish_reason": choice["finish_reason"],
                     "logprobs": choice.get("logprobs")})
    else:
      chunks = [{"index": 0, "text": choice["text"], "finish_reason": None, "logprobs": None},
                {"index": 0, "text": "", "finish_reason": choice["finish_reason"],
                 "logprobs": choice.get("logprobs")}]
    events = [{**base, "choices": [c]} for c in chunks]
    if usage:
      events.append({**base, "choices": [], "usage": out["usage"]})
    for e in events:
      self.wfile.write(b"data: " + json.dumps(e).encode() + b"\n\n")
    self.wfile.write(b"data: [DONE]\n\n")
    self.wfile.flush()

  def do_GET(self):  # noqa: N802 (http.server's name)
    self._route("GET")

  def do_POST(self):  # noqa: N802
    self._route("POST")
