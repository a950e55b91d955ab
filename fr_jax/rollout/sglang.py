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

SGLang needs CUDA; this client is tested here against a stand-in server that speaks this API
subset (`tests/sglang_standin.py`), backed by the embedded engine, and behind the real
sglang-router (`tests/test_weight_relay.py`).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, Optional, Sequence

from fr_jax.rollout.engine import Completion, Request


class SGLangError(RuntimeError):
  """A failed call to the server, naming the endpoint and what came back."""


class SGLangEngine:
  def __init__(self, base_url: str, *, timeout: float = 600.0, max_concurrency: int = 64,
               api_key: Optional[str] = None, max_resumes: int = 8, version: int = 0):
    self.base_url = base_url.rstrip("/")
    self.timeout = timeout
    self.api_key = api_key
    self.max_resumes = max_resumes
    self.version = version
    self._pool = cf.ThreadPoolExecutor(max_workers=max_concurrency,
                                       thread_name_prefix="sglang")
    self._lock = threading.Lock()

  # --- HTTP ---
  def _call(self, path: str, payload: Optional[dict] = None, method: str = "POST"):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    if self.api_key:
      req.add_header("Authorization", f"Bearer {self.api_key}")
    try:
      with urllib.request.urlopen(req, timeout=self.timeout) as r:
        body = r.read()
    except urllib.error.HTTPError as e:
      raise SGLangError(f"{path}: HTTP {e.code}: {e.read()[:500].decode(errors='replace')}")
    except (urllib.error.URLError, OSError) as e:
      raise SGLangError(f"{path}: cannot reach {self.base_url} ({e})") from e
    try:
      return json.loads(body) if body else {}
    except json.JSONDecodeError:
      raise SGLangError(f"{path}: the answer is not JSON: {body[:200]!r}")

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
  def parse(answer: dict) -> tuple[list[int], list[float], str, Optional[int]]:
    """(token ids, log-probs, finish reason, weight version) from one /generate answer."""
    try:
      meta = answer["meta_info"]
      entries = meta["output_token_logprobs"]
      ids = [int(e[1]) for e in entries]
      lps = [float(e[0]) for e in entries]
      fr = meta.get("finish_reason") or {}
      reason = fr.get("type", "stop") if isinstance(fr, dict) else str(fr)
    except (KeyError, TypeError, IndexError, ValueError) as e:
      raise SGLangError(f"/generate: unexpected answer shape ({e}): {str(answer)[:300]}")
    if reason not in ("stop", "length", "abort"):
      raise SGLangError(f"/generate: unknown finish_reason {fr!r}")
    wv = meta.get("weight_version")
    return ids, lps, reason, (int(wv) if wv not in (None, "", "default") else None)

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
               should_abort: Optional[Callable[[], bool]] = None) -> list[Completion]:
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
                            f"{res.get('message', res)}")
        self.version = int(version)
      finally:
        self._call("/continue_generation", {})

  def close(self):
    self._pool.shutdown(wait=False, cancel_futures=True)
