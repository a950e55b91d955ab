"""A vLLM backend: the engine protocol over a vLLM server's token-in, token-out API.

The server (`launch/vllm_server.py` starts one with every flag below; vLLM 0.32):

* `--logprobs-mode processed_logprobs`: each sampled token's log-prob is taken from the
  distribution that sampled it (after temperature and top-p), which is what the objective's
  behaviour log-prob must be; greedy requests report log_softmax(logits), as the protocol
  says. The default (`raw_logprobs`) reports log_softmax(logits) whatever the temperature.
  The server does not say which mode it runs, so the first `generate` measures it: one
  prompt, one token, at T = 1 and T = 0.5, with the top 2 log-probs; after temperature the
  gap between them doubles, before it does not. A server that reports raw log-probs (or
  logits) is refused (`Reason.MISCONFIGURED`), naming the flag.
* `--enable-scale-out`: `POST /inference/v1/generate` takes `token_ids` and per-request
  sampling params (`seed`, `stop_token_ids`, `max_tokens`, `logprobs: 0`) and answers with
  the sampled `token_ids`, each one's log-prob and `weight_versions`, spans of output tokens
  that one weight version sampled. Nothing is re-tokenised. `ignore_eos` is set: a request
  stops at its own `stop_token_ids` (and `stop_strings`), as on the embedded engine, not at
  the model's EOS unless the request lists it.
* `VLLM_SERVER_DEV_MODE=1`: the RL routes. A weight update (`update_weights`) is
  `/pause?mode=keep` (requests in flight stay, frozen), `/collective_rpc` `reload_weights`
  from the HF directory (in place, layer by layer), `/reset_prefix_cache?
  reset_running_requests=true` (the frozen requests are preempted, so their caches are
  computed again with the new weights, and no new request reuses an old prefix),
  `/update_weight_version` and `/resume`. Tokens sampled afterwards carry the new version in
  their answer's `weight_versions`, so a trajectory that spans an update records both.
  `pause_mode="abort"` instead ends the requests in flight, which come back with their
  partial tokens (finish reason abort) and are resumed from prompt + partial tokens with the
  remaining budget, as the SGLang engine does.
* `--api-key`: every route above needs it (`VLLM_API_KEY` in the worker's environment).
* LoRA (`launch.vllm_server --lora_rank=R`: `--enable-lora --max-lora-rank R` and
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING`): a LoRA run's versions are PEFT adapter directories (a
  relay writes them from the learner's unmerged shards, `hf_shards.write_peft`), loaded with
  `/v1/load_lora_adapter` as `fr-jax-v<version>` beside the base weights the server started
  with, no pause and no reload. Each generate request names the newest adapter (`model`); a
  request keeps its adapter to its end, so its tokens carry that adapter's version (vLLM
  labels them "default", the base's). The last `ADAPTERS_KEPT` stay loaded for requests in
  flight. Measured here (vLLM 0.32 CPU, tiny-chat-hd64, rank 8 on q, v and up): log-probs
  within 7e-5 of the learner's on the merged weights.

Streaming. A request with `on_token` (the gateway's, so that an agent sees its reply as it
is sampled) is sent with `"stream": true`: vLLM answers with server-sent events, each chunk
the tokens sampled since the last with their log-probs, and the last chunk with the finish
reason and the `weight_versions` spans of the whole output. Each chunk's tokens go to
`on_token` as they come; when it returns False the request is aborted on the server by its id
and the stream read to its end. The completion is what the unstreamed answer would have been
(the test compares them). A worker's requests have no `on_token` and are not streamed.

vLLM 0.32 on CPU stops its whole server when `reload_weights` fails (a path that is not a
model directory, measured): the engine checks that the directory holds config.json and
safetensors before asking, and a relay writes only whole versions. Shapes are the relay's
check (`transport/relay.py`), before any load.

A tied LM head (SmolLM2, the tiny models) must be untied on disk: vLLM on CPU packs each
linear layer's weights into a kernel copy at load, and an in-place reload repacks only the
layers that receive weights. A head tied to the embeddings receives none, so after a reload
it kept the old weights: tokens were sampled from the new embeddings and the old head
(measured: log-probs off by up to 33 nats from either version's). `prepare_weights`
(`hf_io.untie_head`) writes the head as its own tensor, a copy of the embeddings, and the
engine refuses a tied directory with that reason. The weight relay prepares every version
it writes (`launch.weight_relay --engine=vllm`); `launch.vllm_server` starts the server from
an untied copy.

Routing replay (mixture-of-experts models) is refused: vLLM returns routed experts only with
its V2 model runner (`--enable-return-routed-experts`), which the CPU build does not use, so
there is no server here to read them from. `Reason.NO_ROUTING` says so.

HTTP and its failures: `fr_jax.rollout.http_engine` (shared with SGLang), raised as
`VLLMError`.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from fr_jax.models.hf_io import untie_head
from fr_jax.rollout.engine import FINISH, Completion, Request, hand_over
from fr_jax.rollout.http_engine import EngineError, Reason, ServerEngine

__all__ = ["VLLMEngine", "VLLMError", "Reason", "SERVER_FLAGS", "SERVER_ENV"]

# What the fleet needs of a vLLM server (launch/vllm_server.py passes all of them, and a
# --max-num-batched-tokens of at least --max-model-len). Chunked prefill off: vLLM 0.32 on CPU
# crashes its engine when it chunks the prefill of a seeded request ("CPU Generator does not
# use offset", measured), and every request here is seeded.
SERVER_FLAGS = ("--logprobs-mode", "processed_logprobs", "--enable-scale-out",
                "--no-enable-chunked-prefill")
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # the pause / reload / version routes
GENERATE = "/inference/v1/generate"
# vLLM 0.32 names a /inference/v1/generate request "generate-tokens-<request_id>" inside the
# engine; abort finds it by that name.
ID_PREFIX = "generate-tokens-"
PAUSE_MODES = ("keep", "abort")


class VLLMError(EngineError):
  """A failed call to a vLLM server (`reason`: which kind)."""


class VLLMEngine(ServerEngine):
  error = VLLMError
  errors = (VLLMError,)  # what a worker rides out (a server down, restarting, refusing)
  api_key_env = "VLLM_API_KEY"
  # What a weight relay does to each version directory before this engine loads it: the LM
  # head untied (module docstring).
  prepare_weights = staticmethod(untie_head)
  reports_routing = False  # no routing replay (module docstring)
  # A LoRA run's versions load as adapters (`/v1/load_lora_adapter`; module docstring): a
  # relay writes each as a PEFT directory.
  loads_adapters = True

  def __init__(self, base_url: str, *, pause_mode: str = "keep", **kw):
    """`pause_mode`: what a weight update does with requests in flight (module docstring).
    `kw`: `ServerEngine`'s (timeout, connect_timeout, max_concurrency, api_key, max_resumes,
    version, retries, backoff, model_config: accepted, routing replay is refused)."""
    if pause_mode not in PAUSE_MODES:
      raise ValueError(f"pause_mode={pause_mode!r}: choose one of {PAUSE_MODES}")
    super().__init__(base_url, **kw)
    self.pause_mode = pause_mode
    self._checked = False  # the server reports processed log-probs (measured once)

  # --- generation ---
  @staticmethod
  def payload(r: Request, prompt_ids, max_new: int, top_logprobs: int = 0,
              adapter: str | None = None) -> dict:
    """The /inference/v1/generate body (`adapter`: the LoRA adapter to sample with)."""
    sp = {"max_tokens": max_new, "temperature": r.temperature, "top_p": r.top_p,
          "seed": r.seed, "logprobs": top_logprobs, "ignore_eos": True,
          "skip_special_tokens": False}
    if r.stop_token_ids:
      sp["stop_token_ids"] = list(r.stop_token_ids)
    if r.stop_strings:
      sp |= {"stop": list(r.stop_strings), "include_stop_str_in_output": True}
    body = {"request_id": r.request_id, "token_ids": list(prompt_ids), "sampling_params": sp}
    if adapter is not None:
      body["model"] = adapter
    return body

  @staticmethod
  def parse(answer: dict) -> tuple[list[int], list[float], str, list[int | None]]:
    """(token ids, log-probs, finish reason, weight version of each token) from one answer;
    a span labelled "default" (the weights the server started with) gives None."""
    try:
      (choice,) = answer["choices"]
      ids = [int(t) for t in choice["token_ids"]]
      content = (choice.get("logprobs") or {}).get("content") or []
      lps = [float(e["logprob"]) for e in content]
      got = [int(e["token_id"]) for e in content]
      reason = choice.get("finish_reason") or "stop"
      spans = choice.get("weight_versions") or []
    except (KeyError, TypeError, ValueError) as e:
      raise VLLMError(f"{GENERATE}: unexpected answer shape ({type(e).__name__}: {e}): "
                      f"{str(answer)[:300]}", Reason.BAD_ANSWER) from None
    if got != ids:
      raise VLLMError(f"{GENERATE}: the log-probs are of tokens {got[:8]}..., the answer's "
                      f"token_ids are {ids[:8]}... (was the request sent with logprobs=0?)",
                      Reason.BAD_ANSWER)
    if reason not in FINISH:
      raise VLLMError(f"{GENERATE}: unknown finish_reason {reason!r}", Reason.BAD_ANSWER)
    versions: list[int | None] = [None] * len(ids)
    covered = 0
    try:
      for s in spans:
        v = None if s["version"] in (None, "", "default") else int(s["version"])
        start, end = int(s["start"]), int(s["end"])
        if start != covered or not start <= end <= len(ids):
          raise ValueError(f"span [{start}, {end}) after {covered} of {len(ids)} tokens")
        versions[start:end] = [v] * (end - start)
        covered = end
    except (KeyError, TypeError, ValueError) as e:
      raise VLLMError(f"{GENERATE}: weight_versions {spans!r} do not cover the {len(ids)} "
                      f"tokens in order ({e}; this client sets versions with "
                      "/update_weight_version str(version))", Reason.BAD_ANSWER) from None
    if ids and covered != len(ids):
      raise VLLMError(f"{GENERATE}: weight_versions {spans!r} cover {covered} of {len(ids)} "
                      "tokens", Reason.BAD_ANSWER)
    return ids, lps, reason, versions

  def check_server(self) -> None:
    """Refuses a server whose log-probs are not those of the distribution that sampled
    (module docstring: the gap between the top two log-probs doubles at T = 0.5)."""
    with self._lock:  # not across a weight update: both answers from the same weights
      if not self._checked:
        self._check_logprobs()
        self._checked = True

  def _check_logprobs(self) -> None:
    gaps = {}
    for prompt in ([0], [1, 2], [3, 4, 5]):
      for t in (1.0, 0.5):
        r = Request("fr-jax-logprobs-check", prompt, max_new_tokens=1, temperature=t)
        answer = self.http.call(GENERATE, self.payload(r, prompt, 1, top_logprobs=2))
        try:
          # the sampled token first, then the top 2 (the sampled one may be among them)
          top = answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
          a, b = sorted({int(e["token_id"]): float(e["logprob"]) for e in top}.values())[-1:-3:-1]
          gaps[t] = (a - b, a, b)
        except (KeyError, TypeError, ValueError, IndexError) as e:
          raise VLLMError(f"{GENERATE}: no top-2 log-probs in the answer to the log-prob check "
                          f"({e}): {str(answer)[:300]}", Reason.BAD_ANSWER) from None
      if gaps[1.0][0] > 1e-3:  # two tokens far enough apart to tell the modes apart
        break
    (g1, a1, b1), (g2, a2, b2) = gaps[1.0], gaps[0.5]
    normalised = max(a1, a2) <= 1e-6 and math.log(math.exp(a2) + math.exp(b2)) <= 1e-6
    if not (normalised and abs(g2 - 2 * g1) <= 1e-3 * max(1.0, g1)):
      raise VLLMError(
          f"{self.base_url} does not report the log-probs of the distribution that sampled: "
          f"the top two log-probs are {a1:.4f}, {b1:.4f} at T=1 and {a2:.4f}, {b2:.4f} at "
          "T=0.5 (after temperature their gap doubles). Start it with --logprobs-mode "
          "processed_logprobs (launch/vllm_server.py does): the objective needs each token's "
          "behaviour log-prob", Reason.MISCONFIGURED)

  def _one(self, r: Request, should_abort) -> Completion:
    r.check()
    if r.routed_experts_start is not None:
      raise VLLMError(
          "routing replay (Request.routed_experts_start) through vLLM is not supported: vLLM "
          "returns routed experts only from its V2 model runner (--enable-return-routed-"
          "experts, GPU builds), and this client has no server to read them from; use the "
          "SGLang engine or the embedded engine, or turn routing replay off",
          Reason.NO_ROUTING)
    t0 = time.perf_counter()
    ids, lps, versions, ttft = [], [], [], 0.0
    reason = "abort"
    for _ in range(self.max_resumes + 1):
      # A piece runs whole on the adapter it names, so its tokens carry that adapter's
      # version (vLLM labels them with the base's, "default").
      adapter, adapter_version = self.adapter, self.version
      payload = self.payload(r, r.prompt_ids + ids, r.max_new_tokens - len(ids),
                             adapter=adapter)
      if r.on_token is None:
        new_ids, new_lps, reason, new_versions = self.parse(self.http.call(GENERATE, payload))
        wanted = True
      else:
        (new_ids, new_lps, reason, new_versions), wanted = self._streamed(r, payload)
      if new_ids and not ids:
        ttft = time.perf_counter() - t0
      ids += new_ids
      lps += new_lps
      versions += [adapter_version if adapter is not None or v is None else v
                   for v in new_versions]
      if (reason != "abort" or len(ids) >= r.max_new_tokens or not wanted
          or (should_abort is not None and should_abort())):
        break
    if reason == "abort" and len(ids) >= r.max_new_tokens:
      reason = "length"
    return Completion(r.request_id, ids, lps, reason, versions, len(r.prompt_ids), ttft)

  def _streamed(self, r: Request, payload: dict):
    """One generate call, streamed: each chunk's tokens go to `r.on_token` as they come;
    once it asks to stop, the request is aborted on the server and the stream read to its
    end. (`parse`'s answer for the whole, whether `on_token` still wanted tokens.) The
    server sends the weight-version spans of the whole output with the last chunk."""
    ids, content, reason, spans, wanted = [], [], None, [], True
    for event in self.http.events(GENERATE, {**payload, "stream": True}):
      if not event.get("choices"):
        continue  # a usage chunk
      try:
        (choice,) = event["choices"]
        new = [int(t) for t in choice["token_ids"]]
        new_content = (choice.get("logprobs") or {}).get("content") or []
        new_lps = [float(e["logprob"]) for e in new_content]
      except (KeyError, TypeError, ValueError) as e:
        raise VLLMError(f"{GENERATE}: unexpected chunk shape ({type(e).__name__}: {e}): "
                        f"{str(event)[:300]}", Reason.BAD_ANSWER) from None
      ids += new
      content += new_content
      reason = choice.get("finish_reason") or reason
      spans = choice.get("weight_versions") or spans
      if wanted and not hand_over(r, new, new_lps):
        wanted = False
        with contextlib.suppress(VLLMError):
          self.http.call("/inference/v1/abort_requests",
                         {"request_ids": [ID_PREFIX + r.request_id]})
    whole = {"choices": [{"token_ids": ids, "logprobs": {"content": content},
                          "finish_reason": reason, "weight_versions": spans}]}
    return self.parse(whole), wanted

  def generate(self, requests: Sequence[Request],
               should_abort: Callable[[], bool] | None = None) -> list[Completion]:
    self.check_server()
    futures = [self._pool.submit(self._one, r, should_abort) for r in requests]
    if should_abort is not None:
      while not all(f.done() for f in futures):
        if should_abort():
          with contextlib.suppress(VLLMError):
            self.http.call("/inference/v1/abort_requests",
                           {"request_ids": [ID_PREFIX + r.request_id for r in requests]})
          break
        time.sleep(0.05)
    return [f.result() for f in futures]

  # --- weights ---
  def update_weights(self, model_path, version: int) -> None:
    """Loads an HF safetensors directory in place and labels later tokens `version`
    (module docstring: pause, reload, reset the caches, version, resume); a PEFT adapter
    directory (adapter_config.json) loads as an adapter instead (`load_adapter`)."""
    path = Path(model_path)
    if (path / "adapter_config.json").is_file():
      self.load_adapter(path, version)
      return
    if not ((path / "config.json").is_file() and any(path.glob("*.safetensors"))):
      # vLLM 0.32 stops its server when a reload fails: never ask it with a bad path
      raise VLLMError(f"update_weights: {path} is not an HF model directory (config.json and "
                      "*.safetensors) on this host; the server reads it from its own disk",
                      Reason.REFUSED)
    if json.loads((path / "config.json").read_text()).get("tie_word_embeddings", False):
      raise VLLMError(
          f"update_weights: {path} ties the LM head to the embeddings, and vLLM 0.32 on CPU "
          "keeps a tied head's old weights through an in-place reload (module docstring). "
          "Load an untied copy (`fr_jax.models.hf_io.untie_head`; launch.weight_relay "
          "--engine=vllm writes its versions untied, launch.vllm_server starts from one)",
          Reason.REFUSED)
    with self._lock:
      self.http.call("/pause", params={"mode": self.pause_mode})
      try:
        self.http.call("/collective_rpc", {"method": "reload_weights",
                                           "kwargs": {"weights_path": str(path)}})
        res = self.http.call("/reset_prefix_cache", params={"reset_running_requests": "true"})
        if not res.get("success", False):
          raise VLLMError(f"/reset_prefix_cache refused after loading {path}: {res}",
                          Reason.REFUSED)
        self.http.call("/update_weight_version", {"new_version": str(int(version))})
        self.version = int(version)
      finally:
        self.http.call("/resume")

  def load_adapter(self, path, version: int) -> None:
    """Loads the PEFT adapter directory `path` (on the server's disk) as adapter
    `fr-jax-v<version>`, and labels the server with `version` (`served_version`); requests
    sent from now on sample with it, their tokens labelled `version`. Requests in flight keep
    the adapter they started with; adapters older than the newest ADAPTERS_KEPT are unloaded.
    No pause: the base weights do not change."""
    name = self.adapter_name(version)
    how = ("start it with launch.vllm_server --lora_rank=R (--enable-lora, and "
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING for the route)")
    with self._lock:
      try:
        self.http.call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)},
                       text=True)
      except VLLMError as e:
        if e.reason is Reason.HTTP_STATUS and "HTTP 404" in str(e):
          raise VLLMError(f"{self.base_url} does not load LoRA adapters at run time "
                          f"(/v1/load_lora_adapter is not served): {how}",
                          Reason.MISCONFIGURED) from None
        if "already" not in str(e):  # the same version again (a relay's retry)
          raise
      # vLLM 0.32 registers an adapter even on a server without LoRA, which then refuses
      # every request naming it: one token tells.
      try:
        self.http.call(GENERATE, self.payload(Request("fr-jax-adapter-check", [0], 1), [0], 1,
                                              adapter=name))
      except VLLMError as e:
        raise VLLMError(f"{self.base_url} loaded adapter {name} but cannot sample with it "
                        f"({e}): {how}", Reason.MISCONFIGURED) from None
      # the server's label too: what `served_version` reads (a relay's restart check)
      self.http.call("/update_weight_version", {"new_version": str(int(version))})
      self._adapter_loaded(name, version, lambda old: self.http.call(
          "/v1/unload_lora_adapter", {"lora_name": old}, text=True))

  # --- weights over NCCL (GPU nodes; docs/rollout.md "vLLM on GPU nodes") ---
  @staticmethod
  def nccl_init_info(unique_id: bytes, world_size: int) -> dict:
    """`/init_weight_transfer_engine`'s init_info for a torch-free sender (this relay, on
    JAX): the 128-byte ncclUniqueId the sender minted, standard base64 (not URL-safe), the
    sender at rank 0 and the server's workers after it."""
    if len(unique_id) != 128:
      raise ValueError(f"an ncclUniqueId is 128 bytes, got {len(unique_id)}")
    if world_size < 2:
      raise ValueError(f"world_size={world_size}: the sender and at least one worker")
    return {"nccl_unique_id_b64": base64.b64encode(unique_id).decode(), "rank_offset": 1,
            "world_size": world_size, "packed": False}

  @staticmethod
  def nccl_update_info(tensors) -> dict:
    """`/update_weights`'s update_info: HF names, torch dtype names and shapes, in the order
    the sender broadcasts them (`tensors`: (name, dtype name, shape) each)."""
    names, dtypes, shapes = [], [], []
    for name, dtype, shape in tensors:
      names.append(str(name))
      dtypes.append({"bf16": "bfloat16", "f32": "float32", "f16": "float16"}.get(dtype, dtype))
      shapes.append([int(d) for d in shape])
    return {"names": names, "dtype_names": dtypes, "shapes": shapes}

  def init_nccl(self, unique_id: bytes, world_size: int, join: Callable[[], None]) -> None:
    """Opens the NCCL group with the server's workers: `/init_weight_transfer_engine` and the
    sender's `join` (ncclCommInitRank at rank 0, then the one-element all_reduce vLLM's
    workers issue right after theirs) run at the same time; neither returns alone."""
    self._concurrently(lambda: self.http.call(
        "/init_weight_transfer_engine",
        {"init_info": self.nccl_init_info(unique_id, world_size)}), join)

  def update_weights_nccl(self, tensors, send: Callable[[], None], version: int) -> None:
    """One version over NCCL: pause (keep), `/start_weight_update`, `/update_weights` with
    the tensors' names, dtypes and shapes while `send` broadcasts them from rank 0 in that
    order, `/finish_weight_update` with the version, the caches reset as for a reload,
    resume. The server's workers load each tensor as it arrives (`load_weights`)."""
    info = self.nccl_update_info(tensors)
    with self._lock:
      self.http.call("/pause", params={"mode": self.pause_mode})
      try:
        self.http.call("/start_weight_update")
        self._concurrently(
            lambda: self.http.call("/update_weights", {"update_info": info}), send)
        self.http.call("/finish_weight_update", {"weight_version": str(int(version))})
        res = self.http.call("/reset_prefix_cache", params={"reset_running_requests": "true"})
        if not res.get("success", False):
          raise VLLMError(f"/reset_prefix_cache refused after version {version}: {res}",
                          Reason.REFUSED)
        self.version = int(version)
      finally:
        self.http.call("/resume")

  @staticmethod
  def _concurrently(call: Callable[[], object], peer: Callable[[], None]) -> None:
    """`call` (an HTTP request that returns only when the collective is done) and `peer`
    (this side of the collective) at once; the first failure is raised."""
    with cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-nccl") as pool:
      f = pool.submit(call)
      try:
        peer()
      finally:
        f.result()

  def served_version(self) -> int | None:
    """The weight version the server says it holds (`/weight_info`); None for "default" (no
    update has named one since it started: a restarted server)."""
    v = self.http.call("/weight_info", method="GET").get("weight_version")
    try:
      return int(v)
    except (TypeError, ValueError):
      return None

