"""The gateway's HTTP side: OpenAI-compatible routes over `fr_jax.rollout.gateway.Gateway`,
served by starlette on uvicorn (the stack vLLM's and SGLang's OpenAI servers use).

Routes (every one but /health needs `Authorization: Bearer KEY`):
* `POST /v1/chat/completions`, `POST /v1/completions`: as OpenAI's, `stream` included. The
  episode id comes from the `X-Episode-Id` header or an `episode_id` field (a new one when
  neither is given); the response carries it (`episode_id`, and the `X-Episode-Id` header),
  with the segment and the policy version that sampled the reply.
* `POST /v1/episodes/{id}/reward` with `{"reward": R}` (and optionally `"prompt_id"`): ends
  the episode; its records go to the learner. `GET /v1/episodes/{id}`: its state.
* `GET /v1/models`, `GET /metrics` (the gateway's counters), `GET /health`.

Streaming (`"stream": true`): server-sent events in OpenAI's chunk format, the reply's text as
the engine samples it (the embedded engine hands each token over after its decode step, the
vLLM and SGLang clients as their servers' own streams bring it). A chat call that offers
tools streams its reply when it ends, since the text may turn out to be a tool call. The
first event is sent once the call has a first piece of text (so a call refused before that
gets its error as a plain JSON response with its status); the last chunk carries `segment`,
`policy_version` and the finish reason, and `usage` follows if `stream_options.include_usage`
asks. An error after
the stream began is sent as an `error` event, without `[DONE]`. A client that disconnects
mid-stream aborts its request in the engine: the episode drops that turn (it stays as it was
before the call, as for any failed call), and `calls_cancelled` counts it.

Hostile clients: a body over `max_body_bytes` is refused (413; at once when its Content-Length
says so, else once that many bytes have come), a body must arrive within `timeout_s`, an idle
keep-alive connection is closed after `timeout_s`, at most `max_connections` requests run at
once (503 `overloaded` past that), a wrong key gets 401 in constant time, and errors are
OpenAI-shaped JSON with a named `code`. What uvicorn does not give: a time limit on a
request's headers (their size is bounded, 16 KiB by h11's default), so put a proxy with one in
front of a gateway open to untrusted networks.

Shutdown (`shutdown`): the listening socket closes, idle connections are closed, and requests
in flight get up to `grace_s` to finish (call `Gateway.begin_close` first, so that they end
at once with 503 `shutting_down`); the server's thread is then joined.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
import uuid

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fr_jax.rollout.chat_render import GatewayError

log = logging.getLogger("fr_jax.gateway")

_KIND = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}


def _error(status: int, code: str, message: str) -> dict:
  kind = _KIND.get(status, "invalid_request_error" if status < 500 else "server_error")
  return {"error": {"message": message, "type": kind, "code": code, "param": None}}


def error_response(status: int, code: str, message: str, close: bool = False) -> JSONResponse:
  return JSONResponse(_error(status, code, message), status,
                      headers={"Connection": "close"} if close else None)


def _sse(obj) -> bytes:
  return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


class GatewayServer:
  """The routes on uvicorn, on its own thread: `serve_in_thread`, then `shutdown`."""

  def __init__(self, address: tuple[str, int], gateway, api_key: str, *,
               max_body_bytes: int = 4 << 20, max_connections: int = 64,
               timeout_s: float = 60.0, tls_cert: str = "", tls_key: str = "",
               grace_s: float = 30.0):
    if not api_key:
      raise ValueError("the gateway needs an API key")
    self.gateway, self.key = gateway, api_key.encode()
    self.max_body_bytes, self.timeout_s = max_body_bytes, timeout_s
    self.max_connections = max_connections
    self.running = 0  # requests in progress (on the event loop's thread only)
    self.limiter: anyio.CapacityLimiter | None = None  # made on the loop
    app = Starlette(routes=[
        Route("/health", self._health, methods=["GET"]),
        Route("/v1/models", self._guarded(self._models), methods=["GET"]),
        Route("/metrics", self._guarded(self._metrics), methods=["GET"]),
        Route("/v1/episodes/{episode}", self._guarded(self._episode), methods=["GET"]),
        Route("/v1/episodes/{episode}/reward", self._guarded(self._reward), methods=["POST"]),
        Route("/v1/chat/completions", self._guarded(self._chat), methods=["POST"]),
        Route("/v1/completions", self._guarded(self._complete), methods=["POST"]),
    ], exception_handlers={404: self._not_found, 405: self._not_found})
    self.server = uvicorn.Server(uvicorn.Config(
        app, http="h11", loop="asyncio", lifespan="off", log_config=None, access_log=False,
        timeout_keep_alive=max(1, int(timeout_s)), timeout_graceful_shutdown=int(grace_s),
        ssl_certfile=tls_cert or None, ssl_keyfile=tls_key or None))
    self.server.config.load()  # here, so that a bad certificate raises to the caller
    host = address[0]
    self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self.sock.bind(address)
    self.thread: threading.Thread | None = None

  @property
  def port(self) -> int:
    return self.sock.getsockname()[1]

  def serve_in_thread(self, timeout_s: float = 60.0) -> threading.Thread:
    """Starts serving; returns once the socket listens."""
    self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                   name="gateway-http")
    self.thread.start()
    for _ in range(int(timeout_s * 100)):
      if self.server.started or not self.thread.is_alive():
        break
      threading.Event().wait(0.01)
    if not self.server.started:
      raise RuntimeError("the gateway's HTTP server did not start")
    return self.thread

  def shutdown(self) -> None:
    """Stops listening, lets requests in flight finish (up to grace_s), joins the thread."""
    self.server.should_exit = True
    if self.thread is not None:
      self.thread.join()

  # --- plumbing ---
  async def _not_found(self, request: Request, exc) -> Response:
    return error_response(exc.status_code, "not_found",
                          f"no route {request.method} {request.url.path}")

  async def _health(self, request: Request) -> Response:
    return JSONResponse({"status": "ok"})

  def _guarded(self, handler):
    """`handler` behind the key and the request limit, its errors OpenAI-shaped."""

    async def endpoint(request: Request) -> Response:
      got = request.headers.get("authorization", "")
      token = got[7:].strip().encode() if got.startswith("Bearer ") else b""
      if not hmac.compare_digest(token, self.key):
        return error_response(401, "invalid_api_key",
                              "missing or wrong API key (Authorization: Bearer)", close=True)
      if self.running >= self.max_connections:
        return error_response(503, "overloaded", "too many requests in progress; try again")
      self.running += 1
      done = True
      try:
        out = await handler(request)
        if isinstance(out, _Stream):  # the stream releases its place when it ends
          done = False
        return out
      except GatewayError as e:
        return error_response(e.status, e.code, str(e), close=e.status == 413)
      except Exception as e:  # noqa: BLE001 (a bug must not kill the server; it is logged)
        log.exception("gateway: %s %s failed", request.method, request.url.path)
        return error_response(500, "internal_error", f"{type(e).__name__}: {e}")
      finally:
        if done:
          self.running -= 1

    return endpoint

  async def _body(self, request: Request) -> dict:
    n = request.headers.get("content-length")
    if n is not None and (not n.isdigit() or int(n) > self.max_body_bytes):
      raise GatewayError(413, "body_too_large",
                         f"body of {n} bytes (at most {self.max_body_bytes})")
    data = bytearray()
    try:
      with anyio.fail_after(self.timeout_s):
        async for chunk in request.stream():
          data += chunk
          if len(data) > self.max_body_bytes:
            raise GatewayError(413, "body_too_large",
                               f"body of over {self.max_body_bytes} bytes")
    except TimeoutError:
      raise GatewayError(408, "request_timeout",
                         f"the body did not arrive within {self.timeout_s:.0f} s") from None
    try:
      body = json.loads(bytes(data) or b"{}")
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
      raise GatewayError(400, "invalid_json",
                         f"body is not valid JSON ({type(e).__name__})") from None
    if not isinstance(body, dict):
      raise GatewayError(400, "invalid_json", "body must be a JSON object")
    return body

  async def _run(self, fn, *args):
    """A gateway call (it blocks on the engine and the journal) on a worker thread."""
    if self.limiter is None:
      self.limiter = anyio.CapacityLimiter(self.max_connections)
    return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)

  # --- routes ---
  async def _models(self, request: Request) -> Response:
    name = self.gateway.cfg.model_name
    return JSONResponse({"object": "list", "data": [
        {"id": name, "object": "model", "owned_by": "fr_jax"}]})

  async def _metrics(self, request: Request) -> Response:
    return JSONResponse(self.gateway.metrics())

  async def _episode(self, request: Request) -> Response:
    return JSONResponse(self.gateway.episode(request.path_params["episode"]))

  async def _reward(self, request: Request) -> Response:
    body = await self._body(request)
    return JSONResponse(await self._run(self.gateway.reward, request.path_params["episode"],
                                        body))

  async def _chat(self, request: Request) -> Response:
    return await self._completion(request, chat=True)

  async def _complete(self, request: Request) -> Response:
    return await self._completion(request, chat=False)

  async def _completion(self, request: Request, chat: bool) -> Response:
    body = await self._body(request)
    call = self.gateway.chat if chat else self.gateway.complete
    episode = request.headers.get("x-episode-id")
    if not body.get("stream"):
      out = await self._run(call, body, episode)
      return JSONResponse(out, headers={"X-Episode-Id": out["episode_id"]})
    # Streaming: the call runs on a thread; its text comes through a queue, in order (the
    # engine's thread hands each piece to this loop before the call returns).
    if episode is None and body.get("episode_id") is None:
      episode = uuid.uuid4().hex  # named now: the headers go out before the call ends
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()

    def on_text(piece: str) -> None:
      loop.call_soon_threadsafe(q.put_nowait, ("text", piece))

    async def run():
      try:
        q.put_nowait(("done", await self._run(call, body, episode, on_text, cancel)))
      except GatewayError as e:
        q.put_nowait(("error", e))
      except Exception as e:  # noqa: BLE001 (logged; the client gets a 500-shaped error)
        log.exception("gateway: streamed %s failed", request.url.path)
        q.put_nowait(("error", GatewayError(500, "internal_error", f"{type(e).__name__}: {e}")))

    state = {"task": asyncio.ensure_future(run()), "ended": False}
    first = await q.get()
    if first[0] == "error":
      raise first[1]
    usage = isinstance(body.get("stream_options"), dict) and bool(
        body["stream_options"].get("include_usage"))
    episode = str(episode or body.get("episode_id"))

    def on_end():  # however the response ended: a client gone mid-stream aborts its request
      if not state["ended"]:
        cancel.set()
      self.running -= 1

    return _Stream(self._events(first, q, state, chat, usage, episode), on_end,
                   media_type="text/event-stream",
                   headers={"Cache-Control": "no-cache", "X-Episode-Id": episode})

  async def _events(self, first, q: asyncio.Queue, state: dict, chat: bool, usage: bool,
                    episode: str):
    """The stream's events: a role chunk (chat), a chunk per piece of text, then the end."""
    base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": self.gateway.cfg.model_name,
            "episode_id": episode}
    sent = ""
    if chat:
      yield _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                             "content": ""},
                                       "finish_reason": None, "logprobs": None}]})
    event = first
    while event[0] == "text":
      sent += event[1]
      yield _sse({**base, "choices": [_piece(chat, event[1])]})
      event = await q.get()
    state["ended"] = True
    if event[0] == "error":
      e = event[1]
      yield _sse(_error(e.status, e.code, str(e)))
      return
    out = event[1]
    base.update(episode_id=out["episode_id"], segment=out["segment"],
                policy_version=out["policy_version"])
    for c in _ending(out["choices"][0], chat, sent):
      yield _sse({**base, "choices": [c]})
    if usage:
      yield _sse({**base, "choices": [], "usage": out["usage"]})
    yield _sse(b"[DONE]")


class _Stream(StreamingResponse):
  """A streaming response that runs `on_end` when it ends, whether it was sent whole, cut
  by the client, or cancelled before its first byte."""

  def __init__(self, content, on_end, **kw):
    super().__init__(content, **kw)
    self.on_end = on_end

  async def __call__(self, scope, receive, send):
    try:
      await super().__call__(scope, receive, send)
    finally:
      self.on_end()


def _piece(chat: bool, text: str) -> dict:
  if chat:
    return {"index": 0, "delta": {"content": text}, "finish_reason": None, "logprobs": None}
  return {"index": 0, "text": text, "finish_reason": None, "logprobs": None}


def _ending(choice: dict, chat: bool, sent: str) -> list[dict]:
  """The last chunks of a stream that has sent `sent`: the rest of the text, tool calls, and
  the finish reason with the log-probs."""
  text = (choice["message"].get("content") or "") if chat else choice["text"]
  if not text.startswith(sent):  # cannot happen (gateway_turns.TextStream); say so if it does
    log.error("gateway: the streamed text %r is not a prefix of the reply %r", sent, text)
  rest = text[len(sent):] if text.startswith(sent) else ""
  out = [_piece(chat, rest)] if rest else []
  if chat and choice["message"].get("tool_calls"):
    out.append({"index": 0, "delta": {"tool_calls": [
        {"index": i, **c} for i, c in enumerate(choice["message"]["tool_calls"])]},
        "finish_reason": None, "logprobs": None})
  last = ({"index": 0, "delta": {}} if chat else {"index": 0, "text": ""})
  out.append({**last, "finish_reason": choice["finish_reason"],
              "logprobs": choice.get("logprobs")})
  return out
