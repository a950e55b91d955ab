"""What the engines that run as HTTP servers (SGLang, vLLM) share: one pooled session, a
timeout on every call, one retry policy, and failures with named reasons.

HTTP: one pooled `requests.Session` shared by the generate threads (its `HTTPAdapter` keeps
up to `max_concurrency` + 2 connections and is thread-safe; neither server sets cookies).
Every call has a timeout: `connect_timeout` to connect, `timeout` for the answer. Which
failures are retried (urllib3's `Retry`: up to `retries` more attempts, after 0, 2b, 4b, ...
seconds for `backoff` b) depends on the kind of failure, the same for every route:

* The connection cannot be made (refused, unreachable, connect timeout): nothing was sent.
  Retried.
* The connection drops before any answer (reset, closed without a reply, broken pipe):
  retried, generation included. The request may or may not have reached the server. The
  control routes are idempotent (pause, resume, abort by id, loading the same path and
  version twice). Generation is not, but a resend cannot corrupt a trajectory: the client
  keeps the one answer it reads, whose tokens come with their own log-probs and weight
  version. At worst the server also runs the dropped copy until it notices that the client
  has gone. The common case, a pooled keep-alive connection that the server closed while
  idle, never reached the server at all.
* No answer within `timeout` once sent: not retried. The server has the request and is still
  working on it; a resend would start a second copy of a long generation.
* An HTTP error status: not retried; it is the server's answer.

Every failure raises the engine's `EngineError` subclass, which names the route and what came
back and carries a `Reason`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import json
import threading

import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import MaxRetryError, ReadTimeoutError
from urllib3.util.retry import Retry


class Reason(enum.Enum):
  """Why a call to the server failed."""
  UNREACHABLE = enum.auto()  # no connection, or it dropped before an answer, on every attempt
  TIMEOUT = enum.auto()      # sent, but no answer within `timeout`
  HTTP_STATUS = enum.auto()  # the server answered with an HTTP error status
  BAD_ANSWER = enum.auto()   # the answer is not JSON, or not the shape this client reads
  REFUSED = enum.auto()      # the server answered but did not do it (success false)
  NO_ROUTING = enum.auto()   # routing replay asked for, but the server does not return it
  MISCONFIGURED = enum.auto()  # the server runs with settings this client cannot train from


class EngineError(RuntimeError):
  """A failed call to an engine server, naming the endpoint and what came back; `reason`
  says which kind of failure it was."""

  def __init__(self, message: str, reason: Reason):
    super().__init__(message)
    self.reason = reason


def rides_out(e: BaseException) -> bool:
  """A failure that another try may not meet (no answer at all): a relay retries the load."""
  return isinstance(e, EngineError) and e.reason in (Reason.UNREACHABLE, Reason.TIMEOUT)


class _Retry(Retry):
  """urllib3's Retry, except that a read timeout is final: the request reached the server,
  which is still working on it (see the module docstring)."""

  def increment(self, method=None, url=None, response=None, error=None, _pool=None,
                _stacktrace=None):
    if isinstance(error, ReadTimeoutError):
      raise error
    return super().increment(method, url, response, error, _pool, _stacktrace)


def _cause(e: BaseException) -> BaseException:
  """The failure inside requests' and urllib3's wrappers."""
  while e.args and isinstance(e.args[0], BaseException):
    e = e.args[0]
    if isinstance(e, MaxRetryError) and e.reason is not None:
      e = e.reason
  return e


class HTTPClient:
  """JSON over one pooled session to `base_url`, failures raised as `error`."""

  def __init__(self, base_url: str, error: type[EngineError], *, timeout: float = 600.0,
               connect_timeout: float = 10.0, max_concurrency: int = 64,
               api_key: str | None = None, retries: int = 4, backoff: float = 1.0):
    if not (timeout > 0 and connect_timeout > 0):
      raise ValueError(f"timeout={timeout}, connect_timeout={connect_timeout}: both must be "
                       "positive seconds")
    if retries < 0 or backoff < 0:
      raise ValueError(f"retries={retries}, backoff={backoff}: neither can be negative "
                       "(retries=0 turns retrying off)")
    if not base_url.startswith(("http://", "https://")):
      raise ValueError(f"base_url={base_url!r}: give the server's URL, e.g. "
                       "http://127.0.0.1:30000")
    self.base_url = base_url.rstrip("/")
    self.error = error
    self.timeout = timeout
    self.connect_timeout = min(connect_timeout, timeout)
    self.retries = retries
    # Connection errors and drops before an answer, on every method (POST included);
    # read timeouts and HTTP statuses are final (module docstring).
    retry = _Retry(total=retries, connect=retries, read=retries, other=0,
                   allowed_methods=None, backoff_factor=backoff, raise_on_status=False,
                   respect_retry_after_header=False)
    # + 2: the caller's abort calls and a weight update, beside the generate threads
    adapter = HTTPAdapter(pool_connections=1, pool_maxsize=max_concurrency + 2,
                          max_retries=retry)
    self.session = requests.Session()
    self.session.mount("http://", adapter)
    self.session.mount("https://", adapter)
    self.session.headers["Content-Type"] = "application/json"
    if api_key:
      self.session.headers["Authorization"] = f"Bearer {api_key}"

  def call(self, path: str, payload: dict | None = None, method: str = "POST",
           params: dict | None = None, timeout: float | None = None, text: bool = False):
    """The answer's JSON ({} for an empty body; its text with `text`, for routes that
    answer in words); `error` with its reason otherwise."""
    data = None if payload is None else json.dumps(payload).encode()
    timeout = self.timeout if timeout is None else timeout
    try:
      r = self.session.request(method, self.base_url + path, data=data, params=params,
                               timeout=(self.connect_timeout, timeout))
      body = r.content
    except requests.RequestException as e:
      raise self._failed(path, e, timeout) from e
    if r.status_code >= 400:
      raise self.error(f"{path}: HTTP {r.status_code}: "
                       f"{body[:500].decode(errors='replace')}", Reason.HTTP_STATUS)
    if text:
      return body.decode(errors="replace")
    try:
      return json.loads(body) if body else {}
    except ValueError as e:
      raise self.error(f"{path}: the answer is not JSON: {body[:200]!r}",
                       Reason.BAD_ANSWER) from e

  def _failed(self, path: str, e: requests.RequestException, timeout: float) -> EngineError:
    cause = _cause(e)
    if isinstance(e, requests.ReadTimeout) or isinstance(cause, ReadTimeoutError):
      return self.error(f"{path}: no answer from {self.base_url} within {timeout} s "
                        "(not retried: the server has the request)", Reason.TIMEOUT)
    exhausted = any(isinstance(a, MaxRetryError) for a in e.args)
    tries = f" in {self.retries + 1} attempts" if exhausted else ""
    return self.error(f"{path}: cannot reach {self.base_url}{tries} "
                      f"({type(cause).__name__}: {cause})", Reason.UNREACHABLE)

  def events(self, path: str, payload: dict, timeout: float | None = None):
    """A streamed answer's server-sent events, each one's JSON, until `data: [DONE]`.
    `timeout` bounds each wait for the next bytes. Failures as `call`'s; a stream that breaks
    or ends without [DONE] is UNREACHABLE, an `error` event the server's answer."""
    timeout = self.timeout if timeout is None else timeout
    try:
      r = self.session.post(self.base_url + path, data=json.dumps(payload).encode(),
                            stream=True, timeout=(self.connect_timeout, timeout))
    except requests.RequestException as e:
      raise self._failed(path, e, timeout) from e
    with r:
      if r.status_code >= 400:
        raise self.error(f"{path}: HTTP {r.status_code}: "
                         f"{r.content[:500].decode(errors='replace')}", Reason.HTTP_STATUS)
      try:
        for line in r.iter_lines():
          if not line.startswith(b"data:"):
            continue
          data = line[5:].strip()
          if data == b"[DONE]":
            return
          try:
            event = json.loads(data)
          except ValueError as e:
            raise self.error(f"{path}: a streamed event is not JSON: {data[:200]!r}",
                             Reason.BAD_ANSWER) from e
          if isinstance(event, dict) and "error" in event:
            raise self.error(f"{path}: the stream ended in an error: {str(event)[:500]}",
                             Reason.HTTP_STATUS)
          yield event
      except requests.RequestException as e:
        raise self._failed(path, e, timeout) from e
    raise self.error(f"{path}: the stream from {self.base_url} ended without [DONE]",
                     Reason.UNREACHABLE)

  def healthy(self) -> bool:
    try:
      self.call("/health", method="GET")
      return True
    except EngineError:
      return False

  def close(self):
    self.session.close()


class ServerEngine:
  """What the engines that run as servers share: the `Engine` protocol's attributes, an
  `HTTPClient`, a pool of generate threads and the lock that keeps a weight update whole.
  Subclasses set `error` (their `EngineError`), `errors`, `api_key_env`, `prepare_weights`
  (what a relay does to a version directory first, or None) and `reports_routing`, and
  define `served_version` (the version label the server reports).

  LoRA. An engine with `loads_adapters` loads a LoRA run's versions as adapters (PEFT
  directories) beside the base weights: version v as adapter `adapter_name(v)`, which the
  requests sent after it name (`adapter`). A piece of a request runs whole on the adapter it
  named, so its tokens carry that adapter's version, whatever label the server gives them.
  The newest `ADAPTERS_KEPT` stay loaded (older ones for the requests that may still hold
  them); `_adapter_loaded` keeps that count. A client that does not load the versions itself
  (a worker or gateway beside a relay, which loads them into the server) follows the server:
  with a LoRA model config (`follows_adapters`), `follow_adapter` names the adapter of the
  version the server is labelled with (the label the loading client sets after each load)."""
  weight_format = "hf"  # update_weights takes an HF safetensors directory
  loads_adapters = False
  ADAPTERS_KEPT = 3
  rides_out = staticmethod(rides_out)  # a load that failed without an answer: try again
  error: type[EngineError] = EngineError

  def __init__(self, base_url: str, *, timeout: float = 600.0, connect_timeout: float = 10.0,
               max_concurrency: int = 64, api_key: str | None = None,
               max_resumes: int = 8, version: int = 0, retries: int = 4,
               backoff: float = 1.0, model_config=None):
    self.http = HTTPClient(base_url, self.error, timeout=timeout,
                           connect_timeout=connect_timeout, max_concurrency=max_concurrency,
                           api_key=api_key, retries=retries, backoff=backoff)
    self.base_url, self.timeout = self.http.base_url, timeout
    self.max_resumes, self.version, self.model_config = max_resumes, version, model_config
    self._pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=max_concurrency, thread_name_prefix=type(self).__name__)
    self._lock = threading.Lock()
    self.adapter: str | None = None  # the LoRA adapter requests sample with (None: the base)
    self._adapters: list[str] = []  # loaded by this client, oldest first
    self.follows_adapters = bool(self.loads_adapters and model_config is not None
                                 and model_config.lora_rank)

  @staticmethod
  def adapter_name(version: int) -> str:
    return f"fr-jax-v{int(version)}"

  def _adapter_loaded(self, name: str, version: int, unload) -> None:
    """Adapter `name` (of `version`) is loaded and samples: requests sent from now on name
    it; adapters beyond the newest ADAPTERS_KEPT go (`unload(old_name)`, which may fail:
    the server then keeps one more). Called under `_lock`."""
    self.adapter, self.version = name, int(version)
    if name not in self._adapters:
      self._adapters.append(name)
    while len(self._adapters) > self.ADAPTERS_KEPT:
      old = self._adapters.pop(0)
      with contextlib.suppress(self.error):
        unload(old)

  def follow_adapter(self) -> bool:
    """Names, from now on, the adapter of the version the server is labelled with
    (`served_version`), if that is not the one named already; True if it changed. The
    server's label is what its relay set after loading that version's adapter, so the
    adapter is there (a learner that went back to an older version is followed too)."""
    v = self.served_version()
    if v is None or (self.adapter is not None and v == self.version):
      return False
    with self._lock:
      self.adapter, self.version = self.adapter_name(v), v
    return True

  def health(self) -> bool:
    return self.http.healthy()

  def close(self):
    self._pool.shutdown(wait=False, cancel_futures=True)
    self.http.close()
