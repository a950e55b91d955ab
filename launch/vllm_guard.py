"""The API key on every route of a vLLM server (`launch/vllm_server.py` loads this with
vLLM's `--middleware launch.vllm_guard.RequireKey`; it runs inside the vLLM server, in
.venv-vllm, so it imports nothing of fr_jax).

vLLM 0.32 checks its key (`--api-key`, $VLLM_API_KEY) only on paths under /v1, /v2,
/inference and /cohere. The routes this project's fleet needs (`VLLM_SERVER_DEV_MODE=1`:
/pause, /resume, /collective_rpc, /reset_prefix_cache, /update_weight_version,
/init_weight_transfer_engine, ...) were open to anyone who could reach the port: a stranger
could pause a server, or have it reload weights from any path (a bad one stops the server).
This middleware refuses (401) every HTTP request without `Authorization: Bearer <key>` except
GET /health (liveness probes), comparing digests in constant time. Without a key in the
environment it lets everything through (`launch.vllm_server --allow_no_key`, loopback tests).
"""

import hashlib
import hmac
import json
import os

OPEN = {("GET", "/health")}
KEY_ENV = "VLLM_API_KEY"


class RequireKey:
  """Pure ASGI middleware: the key on every route but GET /health."""

  def __init__(self, app):
    self.app = app
    key = os.environ.get(KEY_ENV, "")
    self.digest = hashlib.sha256(key.encode()).digest() if key else None

  def _allowed(self, scope) -> bool:
    if self.digest is None or (scope.get("method"), scope.get("path")) in OPEN:
      return True
    for name, value in scope.get("headers") or ():
      if name.lower() == b"authorization":
        scheme, _, token = value.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            hashlib.sha256(token.encode()).digest(), self.digest)
    return False

  async def __call__(self, scope, receive, send):
    if scope["type"] not in ("http", "websocket") or self._allowed(scope):
      await self.app(scope, receive, send)
      return
    if scope["type"] == "websocket":
      await send({"type": "websocket.close", "code": 4401})
      return
    body = json.dumps({"error": "Unauthorized"}).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
