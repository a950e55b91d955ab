"""Contract tests of the SGLang client against a STAND-IN server (tests/sglang_standin.py):
real SGLang needs CUDA and cannot run here. The stand-in speaks the documented native API
subset and answers with the embedded engine."""

import threading
import time

import numpy as np
import pytest

from fr_jax.models import registry
from fr_jax.models.hf_io import save_hf
from fr_jax.rollout.embedded import EmbeddedEngine
from fr_jax.rollout.engine import Request
from fr_jax.rollout.sglang import SGLangEngine, SGLangError
from tests.sglang_standin import StandInSGLang
from tests.test_engine import teacher_forced


@pytest.fixture()
def served():
  model = registry.load("tiny-llama", seed=31)
  server = StandInSGLang(model, num_slots=4, max_len=256)
  client = SGLangEngine(server.url)
  yield model, server, client
  client.close()
  server.close()


def reqs(n, seed=0, max_new=12):
  rng = np.random.default_rng(seed)
  return [Request(f"q{i}", rng.integers(0, 256, int(rng.integers(2, 20))).tolist(), max_new,
                  temperature=1.0, top_p=0.95, seed=100 + i, stop_token_ids=(7,))
          for i in range(n)]


def test_generate_matches_the_engine_and_sends_the_documented_payload(served):
  model, server, client = served
  assert client.health()
  rs = reqs(6)
  got = client.generate(rs)
  want = EmbeddedEngine(model.config, model.params, num_slots=4, max_len=256).generate(rs)
  for g, w in zip(got, want):
    assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
    np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-6)
    assert g.versions == [0] * len(g.token_ids)
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
  (c,) = client.generate(reqs(1, seed=3, max_new=10))
  assert c.versions == [5] * len(c.token_ids)
  r = reqs(1, seed=3, max_new=10)[0]
  # (top_p < 1: compare on tokens inside the nucleus, where the log-prob is renormalised)
  full = teacher_forced(new.params, new.config, r.prompt_ids, c.token_ids, 1.0)
  assert np.all(np.asarray(c.logprobs) >= full - 1e-4)


def test_aborted_requests_keep_partial_tokens_and_resume(served, tmp_path):
  model, server, client = served
  server.step_delay = 0.01
  new = registry.load("tiny-llama", seed=33)
  save_hf(tmp_path / "v1", new.params, new.config)
  r = Request("long", [1, 2, 3], max_new_tokens=120, temperature=1.0, seed=4)
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
  gens = [b for p, b in server.log if p == "/generate"]
  assert len(gens) == 2 and gens[1]["input_ids"] == [1, 2, 3] + c.token_ids[:k]
  assert gens[1]["sampling_params"]["max_new_tokens"] == 120 - k


def test_errors_are_clear(served):
  model, server, client = served
  bad = SGLangEngine("http://127.0.0.1:9")  # nothing listens on the discard port
  with pytest.raises(SGLangError, match="/generate: cannot reach"):
    bad.generate(reqs(1))
  assert not bad.health()
  with pytest.raises(SGLangError, match="HTTP 400"):
    client._call("/generate", {"input_ids": [1], "sampling_params": {"bogus": 1},
                               "return_logprob": True})
  with pytest.raises(SGLangError, match="unexpected answer shape"):
    SGLangEngine.parse({"meta_info": {}})
  bad.close()
