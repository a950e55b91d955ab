"""An SGLang backend: the engine protocol over SGLang's native HTTP API (a server, or the
gateway in front of a fleet).

* `/generate` with `input_ids`, `sampling_params` and `return_logprob`; the answer's
  `meta_info.output_token_logprobs` ([logprob, token_id, text] entries) gives the sampled ids
  and their behaviour log-probs, `meta_info.finish_reason.type` the finish reason and
  `meta_info.weight_version` the policy version that produced them.
* Weight updates: `/pause_generation` (mode "abort": in-flight requests return with their
  partial tokens), `/update_weights_from_disk` with the learner's HF safetensors export and a
  `weight_version`, then `/continue_generation`. Requests aborted by the pause are resumed
  from prompt + partial tokens with the remaining budget, so every token carries the version
  that really sampled it.

Behind sglang-router (a fleet), generation goes through the router, but weight updates do
not: the router does not forward `/update_weights_from_disk`, so a weight relay beside each
server (`launch/weight_relay.py`) calls `update_weights` on that server alone, and each answer's
`weight_version` says which server's weights produced its tokens.

HTTP: one pooled `requests.Session` shared by the generate threads (its `HTTPAdapter` keeps
up to `max_concurrency` + 2 connections and is thread-safe; SGLang sets no cookies). Every call
has a timeout: `connect_timeout` to connect, `timeout` for the answer. Which failures are
retried (urllib3's `Retry`: up to `retries` more attempts, after 0, 2b, 4b, ... seconds for
`backoff` b) depends on the kind of failure, the same for every route:

* The connection cannot be made (refused, unreachable, connect timeout): nothing was sent.
  Retried.
* The connection drops before any answer (reset, closed without a reply, broken pipe):
  retried, /generate included. The request may or may not have reached the server. The
  control routes are idempotent (pause, continue, abort by rid, loading the same path and
  version twice). /generate is not, but a resend cannot corrupt a trajectory: the client keeps
  the one answer it reads, whose tokens come with their own log-probs and `weight_version`. At
  worst the server also runs the dropped copy until it notices that the client has gone
  (SGLang checks every 4 s, then aborts it). The common case, a pooled keep-alive connection
  that the server closed while idle, never reached the server at all. One limit: the resend
  keeps the `rid` (`/abort_request` finds requests by it), and SGLang 0.5.23 refuses a rid it
  still holds with HTTP 400 ("Duplicate request ID"), which fails the call (`HTTP_STATUS`).
* No answer within `timeout` once sent: not retried. The server has the request and is still
  working on it; a resend would start a second copy of a long generation.
* An HTTP error status: not retried; it is the server's answer.

Every failure raises `SGLangError`, which names the route and what came back and carries a
`Reason`: `UNREACHABLE`, `TIMEOUT`, `HTTP_STATUS`, `BAD_ANSWER` or `REFUSED`.

SGLang needs CUDA and cannot run here. The client is tested against answers written in the
shape SGLang 0.5.23 builds (served by a local stand-in for the far side), against a stand-in
server that speaks this API subset (`tests/sglang_standin.py`, backed by the embedded engine),
and behind the real sglang-router (`tests/test_weight_relay.py`).
"""

from __future__ import annotations

import concurrent.futures as cf
import enum
import json
import threading
import time
from collections.abc import Callable, Sequence

import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import MaxRetryError, ReadTimeoutError
from urllib3.util.retry import Retry

from fr_jax.rollout.engine import Completion, Request


class Reason(enum.Enum):
  """Why a call to the server failed."""
  UNREACHABLE = enum.auto()  # no connection, or it dropped before an answer, on every attempt
  TIMEOUT = enum.auto()      # sent, but no answer within `timeout`
  HTTP_STATUS = enum.auto()  # the server answered with an HTTP error status
  BAD_ANSWER = enum.auto()   # the answer is not JSON, or not the shape this client reads
  REFUSED = enum.auto()      # the server answered but did not do it (success false)


class SGLangError(RuntimeError):
  """A failed call to the server, naming the endpoint and what came back; `reason` says
  which kind of failure it was."""

  def __init__(self, message: str, reason: Reason):
    super().__init__(message)
    self.reason = reason


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


class SGLangEngine:
  def __init__(self, base_url: str, *, timeout: float = 600.0, connect_timeout: float = 10.0,
               max_concurrency: int = 64, api_key: str | None = None,
               max_resumes: int = 8, version: int = 0, retries: int = 4,
               backoff: float = 1.0):
    if not (timeout > 0 and connect_timeout > 0):
      raise ValueError(f"timeout={timeout}, connect_timeout={connect_timeout}: both must be "
                       "positive seconds")
    if retries < 0 or backoff < 0:
      raise ValueError(f"retries={retries}, backoff={backoff}: neither can be negative "
                       "(retries=0 turns retrying off)")
    self.base_url = base_url.rstrip("/")
    self.timeout = timeout
    self.connect_timeout = min(connect_timeout, timeout)
    self.api_key = api_key
    self.max_resumes = max_resumes
    self.version = version
    self.retries = retries
    self._pool = cf.ThreadPoolExecutor(max_workers=max_concurrency,
                                       thread_name_prefix="sglang")
    self._lock = threading.Lock()
    # Connection errors and drops before an answer, on every method (POST included);
    # read timeouts and HTTP statuses are final (module docstring).
    retry = _Retry(total=retries, connect=retries, read=retries, other=0,
                   allowed_methods=None, backoff_factor=backoff, raise_on_status=False,
                   respect_retry_after_header=False)
    # + 2: the caller's /abort_request calls and a weight update, beside the generate threads
    adapter = HTTPAdapter(pool_connections=1, pool_maxsize=max_concurrency + 2,
                          max_retries=retry)
    self._http = requests.Session()
    self._http.mount("http://", adapter)
    self._http.mount("https://", adapter)
    self._http.headers["Content-Type"] = "application/json"
    if api_key:
      self._http.headers["Authorization"] = f"Bearer {api_key}"

  # --- HTTP ---
  def _call(self, path: str, payload: dict | None = None, method: str = "POST"):
    data = None if payload is None else json.dumps(payload).encode()
    try:
      r = self._http.request(method, self.base_url + path, data=data,
                             timeout=(self.connect_timeout, self.timeout))
      body = r.content
    except requests.RequestException as e:
      cause = _cause(e)
      if isinstance(e, requests.ReadTimeout) or isinstance(cause, ReadTimeoutError):
        raise SGLangError(f"{path}: no answer from {self.base_url} within {self.timeout} s "
                          "(not retried: the server has the request)", Reason.TIMEOUT) from e
      exhausted = any(isinstance(a, MaxRetryError) for a in e.args)
      tries = f" in {self.retries + 1} attempts" if exhausted else ""
      raise SGLangError(f"{path}: cannot reach {self.base_url}{tries} "
                        f"({type(cause).__name__}: {cause})", Reason.UNREACHABLE) from e
    if r.status_code >= 400:
      raise SGLangError(f"{path}: HTTP {r.status_code}: "
                        f"{body[:500].decode(errors='replace')}", Reason.HTTP_STATUS)
    try:
      return json.loads(body) if body else {}
    except ValueError as e:
      raise SGLangError(f"{path}: the answer is not JSON: {body[:200]!r}",
                        Reason.BAD_ANSWER) from e

  def health(self) -> bool:
    try:
      self._call("/health", method="GET")
      return True
    except SGLangError:
      return False

  # --- generation ---
  @staticmethod
  def payload(r: Request, prompt_ids, max_new: int) -> dict:
    sp = {"max_new_tokens": max_new, "temperature": r.temperature, "top_p": r.top_p,
          "skip_special_tokens": False, "no_stop_trim": True, "sampling_seed": r.seed}
    if r.stop_token_ids:
      sp["stop_token_ids"] = list(r.stop_token_ids)
    if r.stop_strings:
      sp["stop"] = list(r.stop_strings)
    return {"input_ids": list(prompt_ids), "sampling_params": sp, "return_logprob": True,
            "logprob_start_len": -1, "rid": r.request_id}

  @staticmethod
  def parse(answer: dict) -> tuple[list[int], list[float], str, int | None]:
    """(token ids, log-probs, finish reason, weight version) from one /generate answer.
    Other fields (text, output_ids, input_token_logprobs, token counts, timings) are
    ignored; a missing, empty or "default" weight_version gives None."""
    try:
      meta = answer["meta_info"]
      entries = meta["output_token_logprobs"]
      ids = [int(e[1]) for e in entries]
      lps = [float(e[0]) for e in entries]
      fr = meta.get("finish_reason") or {}
      reason = fr.get("type", "stop") if isinstance(fr, dict) else str(fr)
    except (KeyError, TypeError, IndexError, ValueError) as e:
      raise SGLangError(f"/generate: unexpected answer shape ({e}): {str(answer)[:300]}",
                        Reason.BAD_ANSWER) from None
    if reason not in ("stop", "length", "abort"):
      raise SGLangError(f"/generate: unknown finish_reason {fr!r}", Reason.BAD_ANSWER)
    wv = meta.get("weight_version")
    if wv in (None, "", "default"):
      return ids, lps, reason, None
    try:
      return ids, lps, reason, int(wv)
    except (TypeError, ValueError):
      raise SGLangError(f"/generate: weight_version {wv!r} is not an integer (this client "
                        "loads weights with weight_version=str(version))",
                        Reason.BAD_ANSWER) from None

  def _one(self, r: Request, should_abort) -> Completion:
    r.check()
    t0 = time.perf_counter()
    ids, lps, versions, ttft = [], [], [], 0.0
    reason = "abort"
    for _ in range(self.max_resumes + 1):
      answer = self._call("/generate", self.payload(r, r.prompt_ids + ids,
                                                    r.max_new_tokens - len(ids)))
      new_ids, new_lps, reason, wv = self.parse(answer)
      if new_ids and not ids:
        ttft = time.perf_counter() - t0
      ids += new_ids
      lps += new_lps
      versions += [self.version if wv is None else wv] * len(new_ids)
      if reason != "abort" or len(ids) >= r.max_new_tokens:
        break
      if should_abort is not None and should_abort():
        break
    if reason == "abort" and len(ids) >= r.max_new_tokens:
      reason = "length"
    return Completion(r.request_id, ids, lps, reason, versions, len(r.prompt_ids), ttft)

  def generate(self, requests: Sequence[Request],
               should_abort: Callable[[], bool] | None = None) -> list[Completion]:
    futures = [self._pool.submit(self._one, r, should_abort) for r in requests]
    if should_abort is not None:
      while not all(f.done() for f in futures):
        if should_abort():
          for r in requests:
            try:
              self._call("/abort_request", {"rid": r.request_id})
            except SGLangError:
              pass
          break
        time.sleep(0.05)
    return [f.result() for f in futures]

  # --- weights ---
  def update_weights(self, model_path, version: int) -> None:
    """Points the fleet at a new HF safetensors directory: pause (in-flight requests return
    partial and are resumed by `generate`), load with `weight_version`, continue."""
    with self._lock:
      self._call("/pause_generation", {"mode": "abort"})
      try:
        res = self._call("/update_weights_from_disk",
                         {"model_path": str(model_path), "weight_version": str(version),
                          "flush_cache": True})
        if not res.get("success", False):
          raise SGLangError(f"/update_weights_from_disk refused {model_path}: "
                            f"{res.get('message', res)}", Reason.REFUSED)
        self.version = int(version)
      finally:
        self._call("/continue_generation", {})

  def close(self):
    self._pool.shutdown(wait=False, cancel_futures=True)
    self._http.close()
