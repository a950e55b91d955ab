"""Contract tests of the SGLang client. Real SGLang needs CUDA and cannot run here, so the far
side of the network boundary is played by STAND-INS, named as such:

* `FarSide`, a tiny local HTTP server that replays /generate answers written in the shape
  SGLang 0.5.23 returns (tests/fixtures/sglang_generate_answers.json, which names its source),
  and can drop a connection on purpose. The parsed tokens, log-probs, finish reasons and
  versions are checked against the fixture's literal values, not against our engine.
* `StandInSGLang` (tests/sglang_standin.py), the API subset backed by the embedded engine.
  Its log-probs are checked two-sided against teacher-forced scoring of prompt + completion
  by a plain forward pass (`decoder.forward`, as tests/test_engine.py does).

Routing replay (R3): recorded answers in SGLang 0.5.23's routed-experts format
(tests/fixtures/sglang_routed_experts_answers.json) are decoded and checked against arrays
written out here; the stand-in's made-up routing is checked against this file's own copy of
its formula (`made_up_routing`), across an abort and resume.
"""

import base64
import json
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from fr_jax.models import registry
from fr_jax.models.config import ModelConfig
from fr_jax.models.hf_io import save_hf
from fr_jax.rollout.engine import Request
from fr_jax.rollout.sglang import Reason, SGLangEngine, SGLangError
from tests.helpers import teacher_forced
from tests.sglang_standin import StandInSGLang

ANSWERS = json.loads((Path(__file__).parent / "fixtures/sglang_generate_answers.json")
                     .read_text())
R3 = json.loads((Path(__file__).parent / "fixtures/sglang_routed_experts_answers.json")
                .read_text())
# The fixture's model: 3 layers, layer 0 dense, k = 2 of 8 experts (moe_layers = (1, 2)).
MOE = ModelConfig(family="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=96,
                  num_layers=3, num_heads=4, num_kv_heads=1, head_dim=32, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=(0,))


class FarSide:
  """A STAND-IN for the far side of the network boundary (not SGLang): answers /generate
  with `answers` in order, and does `faults[i]` to the i-th request instead when it is set:
  "close" (read the request, close the connection without a reply), "reset" (read it, reset
  the TCP connection) or "hang" (read it, answer nothing for `hang_s`). HTTP/1.1, so the
  client's connections are kept alive between calls."""

  def __init__(self, answers=(), faults=(), hang_s=2.0):
    self.answers, self.faults, self.hang_s = list(answers), list(faults), hang_s
    self.calls: list[tuple[str, dict, int]] = []  # (path, body, client port) per request
    far = self

    class Handler(BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"

      def log_message(self, *args):
        pass

      def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        i = len(far.calls)
        far.calls.append((self.path, body, self.client_address[1]))
        fault = far.faults[i] if i < len(far.faults) else None
        if fault == "hang":
          time.sleep(far.hang_s)
        if fault in ("close", "hang"):
          self.close_connection = True
          return
        if fault == "reset":  # SO_LINGER 0: close() sends RST, not FIN
          self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
          self.connection.close()
          self.close_connection = True
          return
        if self.path != "/generate":
          return self._send(404, b'{"error": "no route"}')
        if body.get("input_ids") == [0]:
          return self._send(400, b'{"error": "bad input"}')
        self._send(200, json.dumps(far.answers.pop(0)).encode())

      def _send(self, code, data):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
    threading.Thread(target=self.http.serve_forever, daemon=True).start()

  def close(self):
    self.http.shutdown()
    self.http.server_close()


def req(rid, prompt, max_new, **kw):
  return Request(rid, prompt, max_new, temperature=1.0, top_p=1.0, seed=5, **kw)


# --- recorded answers: parsing, exactly ---
def test_parses_sglang_answers_exactly():
  parse = SGLangEngine.parse
  assert parse(ANSWERS["length_no_weight_version"]) == (
      [220, 717, 353, 220], [-0.8359375, -1.5, -0.0029296875, -0.125], "length", None)
  assert parse(ANSWERS["stop_token_version_7"]) == ([28, 2], [-0.0625, -0.40625], "stop", 7)
  assert parse(ANSWERS["stop_string_default_version"]) == (
      [564, 271], [-1.25, -0.6875], "stop", None)
  assert parse(ANSWERS["abort_partial_version_3"]) == ([370, 65], [-2.0, -0.5], "abort", 3)


def test_generate_over_http_reads_recorded_answers_and_resumes_an_abort():
  far = FarSide([ANSWERS["length_no_weight_version"], ANSWERS["stop_token_version_7"],
                 ANSWERS["abort_partial_version_3"], ANSWERS["resumed_length_version_4"]])
  client = SGLangEngine(far.url, version=2, max_concurrency=1)
  try:
    a, = client.generate([req("q-length", [1, 4438, 374, 220, 16], 4)])
    assert (a.token_ids, a.logprobs, a.finish_reason) == (
        [220, 717, 353, 220], [-0.8359375, -1.5, -0.0029296875, -0.125], "length")
    assert a.versions == [2, 2, 2, 2]  # no weight_version: the client's own version
    b, = client.generate([req("q-stop", [9906, 11, 12], 8, stop_token_ids=(2,))])
    assert (b.token_ids, b.logprobs, b.finish_reason, b.versions) == (
        [28, 2], [-0.0625, -0.40625], "stop", [7, 7])
    c, = client.generate([req("q-resume", [9, 10, 11], 5)])
    assert c.token_ids == [370, 65, 66, 67, 68] and c.finish_reason == "length"
    assert c.logprobs == [-2.0, -0.5, -0.25, -1.0, -0.375]
    assert c.versions == [3, 3, 4, 4, 4]
    bodies = [body for _, body, _ in far.calls]
    assert bodies[1]["sampling_params"]["stop_token_ids"] == [2]
    assert bodies[1]["return_logprob"] is True and bodies[1]["rid"] == "q-stop"
    assert bodies[3]["input_ids"] == [9, 10, 11, 370, 65]  # the resume: prompt + partial
    assert bodies[3]["sampling_params"]["max_new_tokens"] == 3
    assert len({port for _, _, port in far.calls}) == 1  # one pooled keep-alive connection
  finally:
    client.close()
    far.close()


# --- connection faults and named failures ---
@pytest.mark.parametrize("fault", ["close", "reset"])
def test_a_dropped_connection_is_retried_once_and_the_call_succeeds(fault):
  far = FarSide([ANSWERS["stop_token_version_7"]], faults=[fault])
  client = SGLangEngine(far.url, backoff=0.01)
  try:
    c, = client.generate([req("q-stop", [9906, 11, 12], 8)])
    assert c.token_ids == [28, 2] and c.versions == [7, 7]
    assert [p for p, _, _ in far.calls] == ["/generate", "/generate"]
    assert far.calls[0][1] == far.calls[1][1]  # the same request, resent
  finally:
    client.close()
    far.close()


def test_a_server_that_keeps_dropping_fails_as_unreachable_after_the_retries():
  far = FarSide(faults=["reset"] * 10)
  client = SGLangEngine(far.url, retries=2, backoff=0.01)
  try:
    with pytest.raises(SGLangError, match=r"/generate: cannot reach .* in 3 attempts") as e:
      client.generate([req("q", [1, 2], 4)])
    assert e.value.reason is Reason.UNREACHABLE
    assert len(far.calls) == 3
  finally:
    client.close()
    far.close()


def test_a_server_that_is_down_fails_as_unreachable_after_the_retries():
  with socket.socket() as s:  # a port nothing listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  client = SGLangEngine(f"http://127.0.0.1:{port}", retries=2, backoff=0.05)
  t0 = time.monotonic()
  with pytest.raises(SGLangError, match=r"/generate: cannot reach .* in 3 attempts") as e:
    client.generate([req("q", [1, 2], 4)])
  assert e.value.reason is Reason.UNREACHABLE
  assert time.monotonic() - t0 >= 0.1  # backoff 0, then 2 x 0.05 s: it did retry
  assert not client.health()
  client.close()


def test_a_timeout_after_sending_is_not_retried():
  far = FarSide(faults=["hang"], hang_s=1.5)
  client = SGLangEngine(far.url, timeout=0.5, backoff=0.01)
  try:
    with pytest.raises(SGLangError, match="no answer .* within 0.5 s") as e:
      client.generate([req("q", [1, 2], 4)])
    assert e.value.reason is Reason.TIMEOUT
    assert len(far.calls) == 1
  finally:
    client.close()
    far.close()


def test_http_errors_and_bad_answers_are_named_and_not_retried():
  far = FarSide([{"meta_info": {"finish_reason": {"type": "length"}}},
                 ANSWERS["stop_token_version_7"] | {"meta_info": {
                     **ANSWERS["stop_token_version_7"]["meta_info"], "weight_version": "v7"}}])
  client = SGLangEngine(far.url, backoff=0.01)
  try:
    with pytest.raises(SGLangError, match="/generate: HTTP 400: .*bad input") as e:
      client.generate([req("q", [0], 4)])
    assert e.value.reason is Reason.HTTP_STATUS and len(far.calls) == 1
    with pytest.raises(SGLangError, match="unexpected answer shape") as e:
      client.generate([req("q", [1], 4)])
    assert e.value.reason is Reason.BAD_ANSWER
    with pytest.raises(SGLangError, match="weight_version 'v7' is not an integer") as e:
      client.generate([req("q", [1], 4)])
    assert e.value.reason is Reason.BAD_ANSWER
    with pytest.raises(SGLangError, match="unknown finish_reason") as e:
      SGLangEngine.parse({"meta_info": {"output_token_logprobs": [],
                                        "finish_reason": {"type": "error"}}})
    assert e.value.reason is Reason.BAD_ANSWER
  finally:
    client.close()
    far.close()


def recorded_stream(body: bytes) -> ThreadingHTTPServer:
  """A server that answers every POST with `body` as an event stream (HTTP/1.0: the body
  ends when the connection closes)."""

  class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
      pass

    def do_POST(self):
      self.rfile.read(int(self.headers["Content-Length"]))
      self.send_response(200)
      self.send_header("Content-Type", "text/event-stream")
      self.end_headers()
      self.wfile.write(body)

  http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  threading.Thread(target=http.serve_forever, daemon=True).start()
  return http


@pytest.mark.parametrize("body,reason,match", [
    (b'data: {"n": 1}\n\ndata: {"n": 2}\n\n', Reason.UNREACHABLE, "ended without"),
    (b'data: {"n": 1}\n\ndata: {"error": {"message": "boom"}}\n\n', Reason.HTTP_STATUS,
     "ended in an error: .*boom"),
    (b'data: {"n": 1}\n\ndata: {oops\n\n', Reason.BAD_ANSWER, "not JSON"),
])
def test_a_broken_event_stream_is_named(body, reason, match):
  """HTTPClient.events (the servers' streamed answers): the events before the break are
  handed over; a stream cut before [DONE], an error event and an event that is not JSON fail
  with their reasons."""
  from fr_jax.rollout.http_engine import HTTPClient
  http = recorded_stream(body)
  client = HTTPClient(f"http://127.0.0.1:{http.server_address[1]}", SGLangError, retries=0)
  got = []
  try:
    with pytest.raises(SGLangError, match=match) as e:
      for event in client.events("/generate", {}):
        got.append(event)
    assert e.value.reason is reason and got[0] == {"n": 1}
  finally:
    client.close()
    http.shutdown()
    http.server_close()


# --- the stand-in server: log-probs against an independent forward ---
@pytest.fixture()
def served():
  model = registry.load("tiny-llama", seed=31)
  server = StandInSGLang(model, num_slots=4, max_len=256)
  client = SGLangEngine(server.url)
  yield model, server, client
  client.close()
  server.close()


def reqs(n, seed=0, max_new=12, top_p=1.0):
  rng = np.random.default_rng(seed)
  return [Request(f"q{i}", rng.integers(0, 256, int(rng.integers(2, 20))).tolist(), max_new,
                  temperature=1.0, top_p=top_p, seed=100 + i, stop_token_ids=(7,))
          for i in range(n)]


def test_logprobs_match_teacher_forced_scoring_both_ways(served):
  model, server, client = served
  assert client.health()
  rs = reqs(6)
  got = client.generate(rs)
  for r, c in zip(rs, got):
    assert len(c.token_ids) > 0 and c.versions == [0] * len(c.token_ids)
    assert c.finish_reason == ("stop" if c.token_ids[-1] == 7 else "length")
    full = teacher_forced(model.params, model.config, r.prompt_ids, c.token_ids, 1.0)
    np.testing.assert_allclose(c.logprobs, full, atol=1e-4, rtol=0)
  path, body = next(x for x in server.log if x[0] == "/generate")
  assert body["return_logprob"] is True and isinstance(body["input_ids"], list)
  assert body["sampling_params"]["stop_token_ids"] == [7]
  assert {"max_new_tokens", "temperature", "top_p"} <= set(body["sampling_params"])


def test_update_weights_from_disk_with_weight_version(served, tmp_path):
  model, server, client = served
  new = registry.load("tiny-llama", seed=32)
  save_hf(tmp_path / "v5", new.params, new.config)
  client.update_weights(tmp_path / "v5", 5)
  assert [p for p, _ in server.log[-3:]] == ["/pause_generation", "/update_weights_from_disk",
                                            "/continue_generation"]
  assert server.log[-2][1]["weight_version"] == "5"
  r = reqs(1, seed=3, max_new=10)[0]
  (c,) = client.generate([r])
  assert c.versions == [5] * len(c.token_ids)
  full = teacher_forced(new.params, new.config, r.prompt_ids, c.token_ids, 1.0)
  np.testing.assert_allclose(c.logprobs, full, atol=1e-4, rtol=0)
  old = teacher_forced(model.params, model.config, r.prompt_ids, c.token_ids, 1.0)
  assert np.abs(np.asarray(old) - full).max() > 1e-2  # the two models are told apart


def lora_versions(model, tmp_path, seeds):
  """{version: (its PEFT directory, the merged params it samples as)}, random adapters with
  B != 0 on the attention's q and v and the MLP's up projection."""
  import jax

  from fr_jax.models import hf_io, lora
  cfg = model.config.replace(lora_rank=4, lora_alpha=8.0, lora_targets=("wq", "wv", "w_up"))
  out = {}
  for v, seed in seeds:
    p = jax.tree.map(np.asarray, lora.init_adapters(model.params, cfg, jax.random.key(seed)))
    rng = np.random.default_rng(seed)
    p["layers"] = {k: (0.5 * rng.standard_normal(a.shape)).astype(a.dtype)
                   if k.endswith("_lora_b") else a for k, a in p["layers"].items()}
    out[v] = (hf_io.save_peft(tmp_path / f"v{v}", p, cfg), lora.merged(p, cfg))
  return out


def test_lora_versions_load_as_adapters_and_sample_as_the_merged_model(tmp_path):
  """A LoRA run on SGLang: each version, a PEFT directory, loads with /load_lora_adapter (no
  pause), the server is labelled with /update_weight_version, and later requests name the
  adapter (`lora_path`); their tokens carry its version and their log-probs are the merged
  model's (base + scale B A, `lora.merged`) by an independent forward. A retried load is
  accepted, the newest ADAPTERS_KEPT stay loaded, and a server without --enable-lora is
  refused by name."""
  model = registry.load("tiny-llama", seed=31)
  versions = lora_versions(model, tmp_path, [(5, 1), (6, 2), (7, 3), (8, 4)])
  plain = StandInSGLang(model)
  client = SGLangEngine(plain.url)
  try:
    with pytest.raises(SGLangError, match="--enable-lora") as e:
      client.update_weights(versions[5][0], 5)
    assert e.value.reason is Reason.MISCONFIGURED
  finally:
    client.close()
    plain.close()
  server = StandInSGLang(model, enable_lora=True)
  client = SGLangEngine(server.url)
  try:
    got = {}
    for v, (d, merged) in versions.items():
      client.update_weights(d, v)
      assert client.served_version() == v
      rs = reqs(3, seed=v)
      for r, c in zip(rs, client.generate(rs)):
        assert c.versions == [v] * len(c.token_ids) and c.token_ids
        want = teacher_forced(merged, model.config, r.prompt_ids, c.token_ids, 1.0)
        np.testing.assert_allclose(c.logprobs, want, atol=1e-4, rtol=0)
        got[v, r.request_id] = c.token_ids
    assert any(got[5, f"q{i}"] != got[6, f"q{i}"] for i in range(3))
    paths = [p for p, _ in server.log]
    assert "/pause_generation" not in paths and "/update_weights_from_disk" not in paths
    assert {b.get("lora_path") for p, b in server.log if p == "/generate"} == {
        f"fr-jax-v{v}" for v in versions}
    assert sorted(server.adapters) == ["fr-jax-v6", "fr-jax-v7", "fr-jax-v8"]
    client.update_weights(versions[8][0], 8)  # a relay's retry: already loaded, accepted
    assert client.adapter == "fr-jax-v8" and client.version == 8
  finally:
    client.close()
    server.close()


def test_a_worker_beside_a_relay_samples_with_the_adapter_the_relay_loaded(tmp_path):
  """A LoRA fleet: the relay's client loads each version as an adapter; a worker's client to
  the same server (its own instance, told only the learner's version by heartbeat, with no
  HF directory) names the adapter the server holds, and labels its tokens with it. Before,
  it named none and sampled the base model."""
  from fr_jax import system
  from fr_jax.rollout.follower import WeightFollower
  from tests import helpers
  model = registry.load("tiny-llama", seed=31)
  versions = lora_versions(model, tmp_path, [(5, 1), (6, 2)])
  server = StandInSGLang(model, enable_lora=True)
  relay = SGLangEngine(server.url)
  # the worker's engine as launch.worker builds it, from a LoRA run config
  c = helpers.cfg(**{"rollout.engine": "sglang", "rollout.server_url": server.url,
                     "model.lora.rank": 4, "model.lora.alpha": 8.0,
                     "model.lora.targets": "wq,wv,w_up"})
  worker = system.build_engine(c, model)
  follower = WeightFollower(None, worker, "hf", "worker-0")
  try:
    for v, (d, merged) in versions.items():
      relay.update_weights(d, v)
      assert follower.follow({"version": v, "hf_dir": ""})
      assert not follower.follow({"version": v, "hf_dir": ""})  # nothing new
      rs = reqs(3, seed=v)
      for r, c in zip(rs, worker.generate(rs)):
        assert c.versions == [v] * len(c.token_ids)
        want = teacher_forced(merged, model.config, r.prompt_ids, c.token_ids, 1.0)
        np.testing.assert_allclose(c.logprobs, want, atol=1e-4, rtol=0)
    # the learner ahead of the relay: the worker keeps the adapter the server has
    assert not follower.follow({"version": 7, "hf_dir": ""}) and worker.version == 6
  finally:
    relay.close()
    worker.close()
    server.close()


def generate_across_an_update(server, client, tmp_path, **request):
  """A 120-token request on the stand-in with new weights loaded after 20 decode steps (the
  pause aborts it; the client resumes it): (completion, k = tokens sampled before)."""
  server.step_delay = 0.01
  new = registry.load("tiny-llama", seed=33)
  save_hf(tmp_path / "v1", new.params, new.config)
  r = Request("long", [1, 2, 3], max_new_tokens=120, temperature=1.0, seed=4, **request)
  out = []
  t = threading.Thread(target=lambda: out.append(client.generate([r])[0]))
  t.start()
  while server.steps < 20:
    time.sleep(0.01)
  client.update_weights(tmp_path / "v1", 1)
  t.join(60)
  (c,) = out
  assert len(c.token_ids) == 120 and c.finish_reason == "length"
  k = c.versions.index(1)
  assert 0 < k < 120 and c.versions == [0] * k + [1] * (120 - k)
  return c, k


def test_aborted_requests_keep_partial_tokens_and_resume(served, tmp_path):
  model, server, client = served
  c, k = generate_across_an_update(server, client, tmp_path)
  gens = [b for p, b in server.log if p == "/generate"]
  assert len(gens) == 2 and gens[1]["input_ids"] == [1, 2, 3] + c.token_ids[:k]
  assert gens[1]["sampling_params"]["max_new_tokens"] == 120 - k


def test_a_streamed_request_equals_the_unstreamed_and_stops_when_told(served):
  """A request with `on_token` is streamed (SGLang 0.5.23's default stream: the answer so far
  after each token, against the stand-in): the callback hears every token in order, the
  completion equals the unstreamed one for the same seed, and a callback that returns False
  has the request aborted (`/abort_request` with its rid): it ends `abort`, short of its limit,
  and the callback heard no more."""
  model, server, client = served
  server.step_delay = 0.01
  req = lambda rid, **k: Request(rid, [5, 6, 7], 24, temperature=1.0, seed=11, **k)  # noqa: E731
  (whole,) = client.generate([req("whole")])
  heard = []
  (streamed,) = client.generate([req("streamed", on_token=lambda t, lp: heard.append((t, lp)))])
  assert streamed.token_ids == whole.token_ids and streamed.logprobs == whole.logprobs
  assert streamed.versions == whole.versions and heard == list(zip(whole.token_ids,
                                                                   whole.logprobs))
  assert [b.get("stream") for p, b in server.log if p == "/generate"][-2:] == [None, True]
  told = []
  (c,) = client.generate([Request("stop", [5, 6], 200, temperature=1.0, seed=3,
                                  on_token=lambda t, lp: told.append(t) or len(told) < 3)])
  assert c.finish_reason == "abort" and 3 <= len(c.token_ids) < 200 and len(told) == 3
  assert ("/abort_request", {"rid": "stop"}) in server.log


def test_an_incremental_stream_is_read_as_such():
  """SGLang with --incremental-streaming-output sends only the new entries, with the count
  so far in completion_tokens: the tokens come out once each, in order (a recorded stream)."""
  chunks = [{"meta_info": {"output_token_logprobs": [[-0.5, 28, None]], "completion_tokens": 1,
                           "finish_reason": None, "weight_version": "7"}},
            {"meta_info": {"output_token_logprobs": [[-0.25, 29, None], [-0.125, 30, None]],
                           "completion_tokens": 3, "finish_reason": None,
                           "weight_version": "7"}},
            {"meta_info": {"output_token_logprobs": [[-1.0, 2, None]], "completion_tokens": 4,
                           "finish_reason": {"type": "stop"}, "weight_version": "7"}}]

  http = recorded_stream(b"".join(b"data: " + json.dumps(c).encode() + b"\n\n"
                                  for c in chunks) + b"data: [DONE]\n\n")
  client = SGLangEngine(f"http://127.0.0.1:{http.server_address[1]}", retries=0)
  heard = []
  try:
    (c,) = client.generate([req("q", [1, 2], 8, on_token=lambda t, lp: heard.append(t))])
  finally:
    client.close()
    http.shutdown()
    http.server_close()
  assert c.token_ids == heard == [28, 29, 30, 2] and c.logprobs == [-0.5, -0.25, -0.125, -1.0]
  assert c.finish_reason == "stop" and c.versions == [7] * 4


def test_stand_in_rejects_unknown_fields_with_http_400(served):
  model, server, client = served
  with pytest.raises(SGLangError, match="HTTP 400") as e:
    client._call("/generate", {"input_ids": [1], "sampling_params": {"bogus": 1},
                               "return_logprob": True})
  assert e.value.reason is Reason.HTTP_STATUS


# --- routing replay (R3) ---
def b64_int32(rows):
  return base64.b64encode(np.asarray(rows, "<i4").tobytes()).decode()


def with_routing(answer, field):
  return answer | {"meta_info": {**answer["meta_info"], "routed_experts": field}}


# The fixture's sparse-layer rows ([positions, layers 1 and 2, k]), written out by hand.
LENGTH_START_0 = [[[3, 5], [7, 1]], [[2, 6], [4, 0]], [[5, 3], [1, 7]], [[6, 2], [0, 4]]]
ABORT_PARTIAL = [[[1, 2], [3, 4]], [[5, 6], [7, 0]], [[2, 1], [4, 3]]]  # positions 1, 2, 3
RESUMED = [[[7, 6], [5, 4]], [[3, 2], [1, 0]], [[6, 7], [0, 1]]]  # positions 4, 5, 6


def test_parses_routed_experts_value_by_value():
  client = SGLangEngine("http://127.0.0.1:9", model_config=MOE)
  try:
    got = client.parse_routing(R3["routed_length_start_0"], 4)
    assert got.dtype == np.int8 and got.shape == (4, 2, 2)  # 8 experts: int8
    np.testing.assert_array_equal(got, LENGTH_START_0)
    np.testing.assert_array_equal(client.parse_routing(R3["routed_abort_partial_version_3"], 3),
                                  ABORT_PARTIAL)
    empty = client.parse_routing(R3["routed_stop_empty_piece"], 0)  # "" = no positions
    assert empty.shape == (0, 2, 2) and empty.dtype == np.int8
  finally:
    client.close()
  # 300 experts: int16; every layer sparse, so every row is kept.
  wide = MOE.replace(num_experts=300, mlp_only_layers=(), num_layers=2)
  client = SGLangEngine("http://127.0.0.1:9", model_config=wide)
  try:
    answer = {"meta_info": {"routed_experts": b64_int32([[[299, 7], [128, 0]]])}}
    got = client.parse_routing(answer, 1)
    assert got.dtype == np.int16
    np.testing.assert_array_equal(got, [[[299, 7], [128, 0]]])
  finally:
    client.close()


def test_routing_over_http_honours_the_start_and_resumes_exactly():
  far = FarSide([R3["routed_length_start_0"], R3["routed_abort_partial_version_3"],
                 R3["routed_abort_in_queue_version_4"], R3["routed_resumed_length_version_4"],
                 R3["routed_stop_empty_piece"]])
  client = SGLangEngine(far.url, version=2, max_concurrency=1, model_config=MOE)
  try:
    a, = client.generate([req("q-r3", [1, 4438, 374], 2, routed_experts_start=0)])
    assert a.token_ids == [220, 717] and a.versions == [2, 2]
    assert a.routed_experts.dtype == np.int8
    np.testing.assert_array_equal(a.routed_experts, LENGTH_START_0)  # positions 0 .. 3
    # Aborted after 2 tokens (version 3), aborted again in the queue, then finished under
    # version 4: positions 1 .. 6 once; position 4 (token 65, the first piece's last) was
    # first fed by the resumed request, so its row comes from there.
    b, = client.generate([req("q-r3-resume", [9, 10, 11], 5, routed_experts_start=1)])
    assert b.token_ids == [370, 65, 66, 67, 68] and b.versions == [3, 3, 4, 4, 4]
    assert b.finish_reason == "length"
    assert b.routed_experts.shape == (3 + 5 - 1 - 1, 2, 2)
    np.testing.assert_array_equal(b.routed_experts, ABORT_PARTIAL + RESUMED)
    # Starting at the prompt's end with one token: no position to report.
    c, = client.generate([req("q-r3-empty", [5, 6], 4, routed_experts_start=2)])
    assert c.token_ids == [2] and c.routed_experts.shape == (0, 2, 2)
    bodies = [body for _, body, _ in far.calls]
    assert [b["routed_experts_start_len"] for b in bodies] == [0, 1, 4, 4, 2]
    assert all(b["return_routed_experts"] is True for b in bodies)
    assert [b["input_ids"] for b in bodies[1:4]] == [[9, 10, 11], [9, 10, 11, 370, 65],
                                                     [9, 10, 11, 370, 65]]
  finally:
    client.close()
    far.close()


def test_no_routing_fields_without_routing_replay():
  body = SGLangEngine.payload(req("q", [1, 2], 4), [1, 2], 4)
  assert "return_routed_experts" not in body and "routed_experts_start_len" not in body


def test_a_server_without_routing_is_refused_naming_the_flag():
  # The answer has no routed_experts (a server without the flag): refused, never trained on.
  far = FarSide([ANSWERS["length_no_weight_version"]])
  client = SGLangEngine(far.url, model_config=MOE)
  try:
    with pytest.raises(SGLangError, match="no meta_info.routed_experts.*"
                       "--enable-return-routed-experts") as e:
      client.generate([req("q-length", [1, 4438, 374, 220, 16], 4, routed_experts_start=0)])
    assert e.value.reason is Reason.NO_ROUTING
  finally:
    client.close()
    far.close()
  # Without the model's config the client cannot tell the sparse layers' rows: refused.
  client = SGLangEngine("http://127.0.0.1:9")
  try:
    with pytest.raises(ValueError, match="model_config"):
      client.generate([req("q", [1, 2], 4, routed_experts_start=0)])
  finally:
    client.close()


@pytest.mark.parametrize("field,match", [
    ("@@not base64@@", "not base64"),
    (b64_int32([[[0, 0], [3, 5], [7, 1]]] * 3), "holds 72 bytes; expected int32 .4 positions"),
    (b64_int32([[[0, 0], [3, 5], [7, 8]]] * 4), r"expert ids in \[3, 8\].*8 experts"),
    (b64_int32([[[0, 0], [3, -1], [7, 1]]] * 4), r"expert ids in \[-1, 7\]"),
    ([[[0, 0], [3, 5], [7, 1]]] * 4, "not base64"),  # a list, not SGLang's encoding
])
def test_a_malformed_routed_experts_field_is_a_bad_answer(field, match):
  far = FarSide([with_routing(R3["routed_length_start_0"], field)])
  client = SGLangEngine(far.url, model_config=MOE)
  try:
    with pytest.raises(SGLangError, match=match) as e:
      client.generate([req("q-r3", [1, 4438, 374], 2, routed_experts_start=0)])
    assert e.value.reason is Reason.BAD_ANSWER
  finally:
    client.close()
    far.close()


@pytest.fixture()
def served_r3():
  model = registry.load("tiny-llama", seed=31)
  server = StandInSGLang(model, num_slots=4, max_len=256, enable_return_routed_experts=True,
                         routing_config=MOE)
  client = SGLangEngine(server.url, model_config=MOE)
  yield model, server, client
  client.close()
  server.close()


def made_up_routing(seq, positions, version):
  """This test's own copy of the stand-in's made-up routing (tests/sglang_standin.py), on the
  sparse layers 1 and 2 only: experts (b + j) % 8, b = (31 token + 7 i + 13 layer +
  101 version) % 8."""
  return [[[(31 * seq[i] + 7 * i + 13 * layer + 101 * version + j) % 8 for j in range(2)]
           for layer in (1, 2)] for i in positions]


def test_stand_in_refuses_routing_up_front_when_the_flag_is_off(served_r3):
  model, server, client = served_r3
  server.enable_return_routed_experts = False
  with pytest.raises(SGLangError, match="/server_info: .* enable_return_routed_experts=false.*"
                     "--enable-return-routed-experts") as e:
    client.generate([req("q", [1, 2, 3], 4, routed_experts_start=0)])
  assert e.value.reason is Reason.NO_ROUTING
  assert not [p for p, _ in server.log if p == "/generate"]  # refused before generating


def test_stand_in_routing_across_a_weight_update_keeps_each_pieces_experts(served_r3, tmp_path):
  model, server, client = served_r3
  c, k = generate_across_an_update(server, client, tmp_path, routed_experts_start=1)
  seq = [1, 2, 3] + c.token_ids
  # Positions 1 .. 3 + 120 - 2: those up to the first piece's last token's input under
  # version 0; from that token (fed first by the resumed request) on, version 1.
  cut = 3 + k - 1
  expected = made_up_routing(seq, range(1, cut), 0) + made_up_routing(seq, range(cut, 122), 1)
  assert c.routed_experts.dtype == np.int8 and c.routed_experts.shape == (121, 2, 2)
  np.testing.assert_array_equal(c.routed_experts, expected)
  gens = [b for p, b in server.log if p == "/generate"]
  assert [g["routed_experts_start_len"] for g in gens] == [1, cut]


def test_the_real_sglang_router_drops_routing_and_is_refused(served_r3, tmp_path):
  """sglang-router 0.3.2 re-serialises /generate with its own request type, which has no
  return_routed_experts: routing replay cannot go through it, and the client says so."""
  model, server, _ = served_r3
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  router = subprocess.Popen(
      [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", server.url,
       "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn"],
      stdout=open(tmp_path / "router.log", "w"), stderr=subprocess.STDOUT)
  url = f"http://127.0.0.1:{port}"
  client = SGLangEngine(url, timeout=60, model_config=MOE)

  def ready():
    try:
      with urllib.request.urlopen(url + "/workers", timeout=2) as r:
        return json.loads(r.read())["total"] == 1
    except OSError:
      return False

  try:
    t_end = time.monotonic() + 60
    while not ready():
      assert router.poll() is None and time.monotonic() < t_end, "the router did not start"
      time.sleep(0.1)
    with pytest.raises(SGLangError, match="sglang-router 0.3.2") as e:
      client.generate([req("q", [1, 2, 3], 3, routed_experts_start=0)])
    assert e.value.reason is Reason.NO_ROUTING
    (path, body), = [x for x in server.log if x[0] == "/generate"]
    assert "return_routed_experts" not in body and "routed_experts_start_len" not in body
  finally:
    client.close()
    router.terminate()
    router.wait(30)


def test_a_worker_rides_out_a_server_restart(tiny_model, monkeypatch):
  """The server goes away mid-generation (its answers never come: a timeout) and comes back
  on the same port a second later: the worker, built as launch.worker builds it, backs off,
  keeps heartbeating, starts its episodes again with fresh request ids, and goes on
  producing; its API key reaches the server. A worker used to end at the first SGLangError."""
  from fr_jax import system
  from tests import helpers
  monkeypatch.setenv("SGLANG_API_KEY", "k")
  c = helpers.cfg(**{"rollout.engine": "sglang", "rollout.server_timeout_s": 3.0,
                     "rollout.inflight": 2})
  max_len = c.agent.max_total_tokens + 1
  server = StandInSGLang(tiny_model, num_slots=4, max_len=max_len, api_key="k", step_delay=0.02)
  port = int(server.url.rsplit(":", 1)[1])
  c.rollout.server_url = server.url
  client, stop, errors = helpers.Collect(), threading.Event(), []
  w = system.build_worker(c, client, tiny_model, index=0, num_shards=1)

  def run():
    try:
      w.run(stop)
    except Exception as e:  # noqa: BLE001 -- the failure this test is about
      errors.append(e)

  t = threading.Thread(target=run)
  t.start()
  try:
    helpers.wait_for(lambda: len(client.got) >= 2 or errors, 120, "trajectories before")
    server.close()  # mid-generation: the requests it holds are never answered
    helpers.wait_for(lambda: w.engine_failures or errors, 60, "the worker to notice")
    beats = client.heartbeats
    time.sleep(1.0)
    server = StandInSGLang(tiny_model, num_slots=4, max_len=max_len, api_key="k", port=port)
    n = len(client.got)
    helpers.wait_for(lambda: len(client.got) >= n + 2 or errors or not t.is_alive(), 120,
                     "trajectories after the restart")
  finally:
    stop.set()
    t.join(60)
    server.close()
    w.engine.close()
  assert not errors, errors
  assert sum(w.engine_failures.values()) >= 1 and set(w.engine_failures) <= {
      "TIMEOUT", "UNREACHABLE"}
  assert client.heartbeats > beats  # heartbeats went on through the backoff
  ids = [p.get("rid") for path, p in server.log if path == "/generate"]
  assert ids and len(ids) == len(set(ids))
  assert w.tasks_given_up == 0


def test_a_task_the_server_always_refuses_is_skipped_after_three_attempts(tiny_model):
  """A prompt too long for the server (HTTP 500 every time) is tried 3 times, then skipped;
  the worker goes on to other tasks rather than retrying one forever."""
  from fr_jax import system
  from tests import helpers
  server = StandInSGLang(tiny_model, num_slots=4, max_len=64)  # every prompt is too long
  c = helpers.cfg(**{"rollout.engine": "sglang", "rollout.server_url": server.url,
                     "rollout.inflight": 1})
  client, stop = helpers.Collect(), threading.Event()
  w = system.build_worker(c, client, tiny_model, index=0, num_shards=1)
  w.backoff_min_s = w.backoff_max_s = 0.05
  t = threading.Thread(target=w.run, args=(stop,))
  t.start()
  try:
    helpers.wait_for(lambda: w.tasks_given_up >= 2 or not t.is_alive(), 60, "two tasks skipped")
  finally:
    stop.set()
    t.join(60)
    server.close()
    w.engine.close()
  assert w.tasks_given_up >= 2 and client.got == []
  prompts = [p["input_ids"] for path, p in server.log if path == "/generate"]
  first = prompts[0]
  assert sum(p == first for p in prompts) == 3  # the first task: three attempts, then skipped
  assert w.engine_failures["HTTP_STATUS"] >= 6
