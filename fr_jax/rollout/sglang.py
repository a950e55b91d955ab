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

LoRA (a run with `model.lora.rank` R; the server launched with `--enable-lora --max-lora-rank R
--lora-target-modules <the run's modules>` and `--max-loaded-loras` above ADAPTERS_KEPT, with
one data-parallel replica per server: SGLang 0.5.23 loads adapters at run time only so): a
version written as a PEFT directory loads with `/load_lora_adapter` as `fr-jax-v<version>`,
beside the base weights, with no pause; `/update_weight_version` (not aborting anything)
labels the server with it for `served_version`. Each /generate names the newest adapter
(`lora_path`, which SGLang reads as an adapter's name); a piece keeps its adapter to its end,
so its tokens carry that adapter's version, not the server's label (`ServerEngine`'s LoRA).
Older adapters than the newest ADAPTERS_KEPT are unloaded (`/unload_lora_adapter`).

Behind sglang-router (a fleet), generation goes through the router, but weight updates do
not: the router does not forward `/update_weights_from_disk`, so a weight relay beside each
server (`launch/weight_relay.py`) calls `update_weights` on that server alone, and each answer's
`weight_version` says which server's weights produced its tokens.

HTTP (`fr_jax.rollout.http_engine`, shared with the vLLM engine): one pooled session, a
timeout on every call; a connection that cannot be made or drops before an answer is retried
(generation included: the client keeps the one answer it reads), a read timeout and an HTTP
status are not. One limit: a resend keeps the `rid` (`/abort_request` finds requests by it),
and SGLang 0.5.23 refuses a rid it still holds with HTTP 400 ("Duplicate request ID"), which
fails the call (`HTTP_STATUS`).

Streaming. A request with `on_token` (the gateway's) and no routing replay is sent with
`"stream": true`: SGLang answers with server-sent events, by default the whole answer so far
after each token (only the new part with `--incremental-streaming-output`); meta_info's
`completion_tokens`, the count so far, tells which entries are new either way. Each new token
goes to `on_token` as it comes; when it returns False the request is aborted by its rid and
the stream read to its end.

Routing replay (R3, mixture-of-experts models). A request with `routed_experts_start = s` is
sent with `return_routed_experts: true` and `routed_experts_start_len: s`. SGLang 0.5.23 answers
with `meta_info.routed_experts`: base64 of a little-endian int32 array [seqlen - 1 - s, layers,
k] for positions s .. seqlen - 2 (seqlen = prompt + output tokens), with a row for every layer
of the model (`num_hidden_layers`), dense layers included: their rows are never written, so
they read as zeros. The client keeps the rows of `model_config.moe_layers`, in the config's
`routing_dtype`. SGLang returns routing only when launched with
`--enable-return-routed-experts`; without the flag it silently leaves the field out, so the
client refuses (`Reason.NO_ROUTING`) when `/server_info` reports the flag off, and when an
answer that must carry the field does not. A resumed request asks from the first position that
has no routing yet, so every position keeps the routing of the pass that computed it (the
tokens of each policy version keep their own experts) and the completion covers
s .. prompt + tokens - 2 exactly once. sglang-router 0.3.2 drops `return_routed_experts` from
the requests it forwards, so routing replay must talk to a server, not the router.

Every failure raises `SGLangError` (an `http_engine.EngineError`), which names the route and
what came back and carries a `Reason`: `UNREACHABLE`, `TIMEOUT`, `HTTP_STATUS`, `BAD_ANSWER`,
`REFUSED` or `NO_ROUTING`.

SGLang needs CUDA and cannot run here. The client is tested against answers written in the
shape SGLang 0.5.23 builds (served by a local stand-in for the far side), against a stand-in
server that speaks this API subset (`tests/sglang_standin.py`, backed by the embedded engine),
and behind the real sglang-router (`tests/test_weight_relay.py`).
"""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from fr_jax.models.config import ModelConfig
from fr_jax.rollout.engine import FINISH, Completion, Request, hand_over
from fr_jax.rollout.http_engine import EngineError, Reason, ServerEngine

__all__ = ["R3_FLAG", "Reason", "SGLangEngine", "SGLangError"]

# The server flag without which SGLang 0.5.23 returns no routed experts (it then leaves
# meta_info.routed_experts out without an error).
R3_FLAG = "--enable-return-routed-experts"


class SGLangError(EngineError):
  """A failed call to an SGLang server or router (`reason`: which kind)."""


class SGLangEngine(ServerEngine):
  error = SGLangError
  errors = (SGLangError,)  # what a worker rides out (a server down, restarting, refusing)
  api_key_env = "SGLANG_API_KEY"
  prepare_weights = None  # SGLang loads a relay's version directory as it is written
  reports_routing = True  # routing replay (R3), with the server's flag on
  loads_adapters = True  # a LoRA run's versions load as adapters (module docstring)

  def __init__(self, base_url: str, *, model_config: ModelConfig | None = None, **kw):
    """`model_config`: the served model's, needed for routing replay only (which of SGLang's
    per-layer rows are the sparse layers', k, and the compact dtype). `kw`: `ServerEngine`'s
    (timeout, connect_timeout, max_concurrency, api_key, max_resumes, version, retries,
    backoff)."""
    super().__init__(base_url, model_config=model_config, **kw)
    self._routing_checked = False  # /server_info said the R3 flag is on, or did not say

  # --- HTTP ---
  def _call(self, path: str, payload: dict | None = None, method: str = "POST"):
    return self.http.call(path, payload, method)

  # --- generation ---
  @staticmethod
  def payload(r: Request, prompt_ids, max_new: int, routed_start: int | None = None,
              adapter: str | None = None) -> dict:
    """The /generate body; `routed_start` (not None) asks for the routed experts of positions
    routed_start .. (SGLang requires 0 <= routed_start <= len(prompt_ids)); `adapter`: the
    LoRA adapter to sample with."""
    sp = {"max_new_tokens": max_new, "temperature": r.temperature, "top_p": r.top_p,
          "skip_special_tokens": False, "no_stop_trim": True, "sampling_seed": r.seed}
    if r.stop_token_ids:
      sp["stop_token_ids"] = list(r.stop_token_ids)
    if r.stop_strings:
      sp["stop"] = list(r.stop_strings)
    body = {"input_ids": list(prompt_ids), "sampling_params": sp, "return_logprob": True,
            "logprob_start_len": -1, "rid": r.request_id}
    if routed_start is not None:
      body |= {"return_routed_experts": True, "routed_experts_start_len": routed_start}
    if adapter is not None:
      body["lora_path"] = adapter
    return body

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
    if reason not in FINISH:
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

  def parse_routing(self, answer: dict, n: int) -> np.ndarray:
    """The routed experts of one /generate answer that must cover `n` positions: int
    [n, sparse layers, k] in `model_config.routing_dtype`. SGLang sends a row per layer
    (`num_hidden_layers`); a dense layer's row is unused (zeros), and only the rows of
    `model_config.moe_layers` are kept."""
    cfg = self._routing_config()
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    field = meta.get("routed_experts") if isinstance(meta, dict) else None
    if field is None:
      raise SGLangError(
          f"/generate: the answer has no meta_info.routed_experts, but the request asked for "
          f"them (return_routed_experts): launch the SGLang server with {R3_FLAG} (without it "
          "SGLang leaves the field out silently), and send /generate to the server, not "
          "through a gateway that drops the request's return_routed_experts (sglang-router "
          "0.3.2 does)", Reason.NO_ROUTING)
    try:
      raw = base64.b64decode(field, validate=True)
    except (TypeError, ValueError) as e:  # binascii.Error is a ValueError
      raise SGLangError(f"/generate: meta_info.routed_experts is not base64 ({e}): "
                        f"{str(field)[:100]!r}", Reason.BAD_ANSWER) from None
    layers, k = cfg.num_layers, cfg.num_experts_per_tok
    if len(raw) != n * layers * k * 4:
      raise SGLangError(
          f"/generate: meta_info.routed_experts holds {len(raw)} bytes; expected int32 "
          f"[{n} positions, {layers} layers, k={k}] = {n * layers * k * 4} bytes (is the "
          "server serving this model_config's model?)", Reason.BAD_ANSWER)
    ids = np.frombuffer(raw, "<i4").reshape(n, layers, k)[:, list(cfg.moe_layers)]
    if ids.size and (ids.min() < 0 or ids.max() >= cfg.num_experts):
      raise SGLangError(f"/generate: meta_info.routed_experts has expert ids in "
                        f"[{ids.min()}, {ids.max()}] on the sparse layers; the model has "
                        f"{cfg.num_experts} experts", Reason.BAD_ANSWER)
    return ids.astype(cfg.routing_dtype)

  def _routing_config(self) -> ModelConfig:
    cfg = self.model_config
    if cfg is None or not cfg.is_moe:
      raise ValueError(
          "routing replay (Request.routed_experts_start) needs SGLangEngine(model_config=...) "
          "of a mixture-of-experts model: SGLang returns a row per layer, and the client keeps "
          f"the sparse layers' rows (ModelConfig.moe_layers); got model_config="
          f"{None if cfg is None else cfg.family}")
    return cfg

  def check_routing_support(self) -> None:
    """Refuses routing replay up front when the server reports the R3 flag off. /server_info
    lists every server argument in SGLang 0.5.23; where it is missing or says nothing (a
    gateway), every answer is checked instead (`parse_routing`)."""
    self._routing_config()
    if self._routing_checked:
      return
    try:
      info = self._call("/server_info", method="GET")
    except SGLangError as e:
      if e.reason is not Reason.HTTP_STATUS:
        raise
      info = {}  # no such route here (a gateway): the answers will tell
    if isinstance(info, dict) and info.get("enable_return_routed_experts") is False:
      raise SGLangError(f"/server_info: {self.base_url} runs with enable_return_routed_experts="
                        f"false, so it returns no routed experts: relaunch it with {R3_FLAG}, "
                        "or turn routing replay off", Reason.NO_ROUTING)
    self._routing_checked = True

  def _one(self, r: Request, should_abort) -> Completion:
    r.check()
    t0 = time.perf_counter()
    ids, lps, versions, ttft = [], [], [], 0.0
    reason = "abort"
    # Routing replay: the routing of positions [start, known) is in `routed`, piece by piece.
    start = known = r.routed_experts_start
    routed = []
    for _ in range(self.max_resumes + 1):
      prompt = r.prompt_ids + ids
      adapter, adapter_version = self.adapter, self.version
      payload = self.payload(r, prompt, r.max_new_tokens - len(ids), known, adapter)
      if r.on_token is not None and start is None:
        answer, wanted = self._streamed(r, payload)
      else:
        answer = self._call("/generate", payload)
      new_ids, new_lps, reason, wv = self.parse(answer)
      ran = new_ids or reason != "abort" or "routed_experts" in answer["meta_info"]
      if start is not None and ran:
        # SGLang reports positions [known, seqlen - 1): the inputs of this piece from the first
        # one without routing (the previous piece's last token, fed only now). A request
        # aborted before it ran (in the queue, mid chunked prefill) has no tokens and no field.
        n = max(0, len(prompt) + len(new_ids) - 1 - known)
        routed.append(self.parse_routing(answer, n))
        known += n
      if new_ids and not ids:
        ttft = time.perf_counter() - t0
      ids += new_ids
      lps += new_lps
      if r.on_token is None or start is not None:
        wanted = hand_over(r, new_ids, new_lps)
      if adapter is not None or wv is None:
        wv = adapter_version
      versions += [wv] * len(new_ids)
      if (reason != "abort" or len(ids) >= r.max_new_tokens or not wanted
          or (should_abort is not None and should_abort())):
        break
    if reason == "abort" and len(ids) >= r.max_new_tokens:
      reason = "length"
    c = Completion(r.request_id, ids, lps, reason, versions, len(r.prompt_ids), ttft)
    if start is not None:
      cfg = self._routing_config()
      c.routed_experts = (np.concatenate(routed) if routed else
                          np.zeros((0, *cfg.routing_shape), cfg.routing_dtype))
      # Positions start .. prompt + tokens - 2, each once; the one exception is a completion
      # without tokens whose every piece was aborted before it ran (nothing to train on).
      assert not ids or known == len(r.prompt_ids) + len(ids) - 1, (known, len(ids))
    return c

  def _streamed(self, r: Request, payload: dict) -> tuple[dict, bool]:
    """One /generate call, streamed: each new token goes to `r.on_token` as it comes; once
    it asks to stop, the request is aborted (`/abort_request`) and the stream read to its
    end. (the last answer, with every token's log-prob; whether `on_token` still wanted
    them.) SGLang 0.5.23 streams the whole answer so far by default and only the new part
    with --incremental-streaming-output; `completion_tokens` (the count so far, either way)
    says which of the entries are new."""
    entries, last, wanted = [], None, True
    for event in self.http.events("/generate", {**payload, "stream": True}):
      try:
        meta = event["meta_info"]
        got = meta["output_token_logprobs"]
        total = int(meta.get("completion_tokens", len(got)))
        new = got[len(got) - (total - len(entries)):] if total > len(entries) else []
        new_ids, new_lps = [int(e[1]) for e in new], [float(e[0]) for e in new]
      except (KeyError, TypeError, IndexError, ValueError) as e:
        raise SGLangError(f"/generate: unexpected streamed answer ({e}): {str(event)[:300]}",
                          Reason.BAD_ANSWER) from None
      entries += new
      last = event
      if wanted and not hand_over(r, new_ids, new_lps):
        wanted = False
        with contextlib.suppress(SGLangError):
          self._call("/abort_request", {"rid": r.request_id})
    if last is None:
      raise SGLangError("/generate: the stream ended without an answer", Reason.BAD_ANSWER)
    return {**last, "meta_info": {**last["meta_info"], "output_token_logprobs": entries}}, wanted

  def generate(self, requests: Sequence[Request],
               should_abort: Callable[[], bool] | None = None) -> list[Completion]:
    if any(r.routed_experts_start is not None for r in requests):
      self.check_routing_support()
    futures = [self._pool.submit(self._one, r, should_abort) for r in requests]
    if should_abort is not None:
      while not all(f.done() for f in futures):
        if should_abort():
          for r in requests:
            with contextlib.suppress(SGLangError):
              self._call("/abort_request", {"rid": r.request_id})
          break
        time.sleep(0.05)
    return [f.result() for f in futures]

  # --- weights ---
  def update_weights(self, model_path, version: int) -> None:
    """Points the fleet at a new HF safetensors directory: pause (in-flight requests return
    partial and are resumed by `generate`), load with `weight_version`, continue. A PEFT
    adapter directory (adapter_config.json) loads as an adapter instead (`load_adapter`)."""
    if (Path(model_path) / "adapter_config.json").is_file():
      self.load_adapter(model_path, version)
      return
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

  def load_adapter(self, path, version: int) -> None:
    """Loads the PEFT adapter directory `path` (on the server's disk) as adapter
    `fr-jax-v<version>` and labels the server `version`; requests sent from now on sample with
    it (module docstring). No pause: the base weights do not change, and requests in flight
    keep the adapter they started with."""
    name = self.adapter_name(version)
    with self._lock:
      try:
        res = self._call("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
      except SGLangError as e:
        if e.reason is not Reason.HTTP_STATUS:
          raise
        res = {"success": False, "error_message": str(e)}
      msg = str(res.get("error_message") or res)
      if not res.get("success", False) and "already loaded" not in msg:  # a relay's retry
        if "not enabled" in msg or "HTTP 404" in msg:
          raise SGLangError(
              f"{self.base_url} does not load LoRA adapters ({msg[:300]}): launch it with "
              "--enable-lora --max-lora-rank R --lora-target-modules <the run's modules> "
              f"and --max-loaded-loras above {self.ADAPTERS_KEPT}", Reason.MISCONFIGURED)
        raise SGLangError(f"/load_lora_adapter refused {path}: {msg[:500]}", Reason.REFUSED)
      self._call("/update_weight_version", {"new_version": str(int(version)),
                                            "abort_all_requests": False})
      self._adapter_loaded(name, version, lambda old: self._call(
          "/unload_lora_adapter", {"lora_name": old}))

  def served_version(self) -> int | None:
    """The weight version the server says it holds (`/model_info`'s weight_version); None
    for "default" (no load has named one since it started: a restarted server) or a name
    that is not a number."""
    v = self._call("/model_info", method="GET").get("weight_version")
    try:
      return int(v)
    except (TypeError, ValueError):
      return None

