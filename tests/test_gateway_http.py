"""The gateway's HTTP side on starlette/uvicorn (fr_jax/rollout/openai_http.py): tokens stream
as the engine samples them, a client that goes away mid-stream aborts its request in the
engine, and the end of a run with calls in flight answers them, exits 0 and loses nothing
acknowledged."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from fr_jax.learner.admission import AdmissionLog
from fr_jax.rollout.embedded import EmbeddedEngine
from fr_jax.rollout.gateway import Gateway, GatewayConfig
from fr_jax.rollout.gateway_state import Journal
from fr_jax.rollout.gateway_turns import TextStream, reply_text
from fr_jax.rollout.openai_http import GatewayServer
from fr_jax.transport import codec
from tests import XLA_TEST_FLAGS
from tests.helpers import Recorder

KEY = "test-key"


class _Paced(EmbeddedEngine):
  """The embedded engine, `pace_s` slower per sampled token; it notes when each token was
  sampled and every completion it returned."""

  def __init__(self, *a, pace_s: float = 0.0, **k):
    super().__init__(*a, **k)
    self.pace_s, self.sampled_at, self.completions = pace_s, [], []

  def _append(self, s, tok, lp):
    time.sleep(self.pace_s)
    self.sampled_at.append(time.perf_counter())
    super()._append(s, tok, lp)

  def generate(self, requests, should_abort=None, more=None, done=None):
    def noted(c):
      self.completions.append(c)
      if done is not None:
        done(c)

    return super().generate(requests, should_abort, more, noted)


def _gateway(m, pace_s=0.0):
  engine = _Paced(m.config, m.params, tokenizer=m.tokenizer, num_slots=2, max_len=512,
                  pace_s=pace_s)
  gw = Gateway(engine, m.tokenizer, Recorder(), GatewayConfig(max_new_tokens=64,
                                                             max_total_tokens=500),
               follow_weights=False)
  server = GatewayServer(("127.0.0.1", 0), gw, KEY)
  server.serve_in_thread()
  client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY,
                         max_retries=0)
  return engine, gw, server, client


def _long_seed(client, n):
  """A sampling seed whose reply runs to max_tokens=n (no end-of-turn token sampled)."""
  for seed in range(1, 40):
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=n, seed=seed, temperature=1.0,
                                       extra_headers={"X-Episode-Id": f"probe-{seed}"})
    if r.choices[0].finish_reason == "length":
      return seed, r.choices[0].message.content
  raise AssertionError("no seed ran to max_tokens")


def test_stream_sends_text_as_it_is_sampled(tiny_model):
  """The first chunk arrives before the engine samples the last token, the chunks join to
  the reply the same seed gives unstreamed, and the record is the unstreamed one's."""
  engine, gw, server, client = _gateway(tiny_model, pace_s=0.02)
  try:
    seed, whole = _long_seed(client, 40)
    first_at, pieces, last = None, [], None
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=40, seed=seed,
        temperature=1.0, stream=True, extra_headers={"X-Episode-Id": "s"},
        stream_options={"include_usage": True})
    for chunk in stream:
      if chunk.choices and chunk.choices[0].delta.content:
        first_at = first_at or time.perf_counter()
        pieces.append(chunk.choices[0].delta.content)
      if chunk.choices and chunk.choices[0].finish_reason:
        last = chunk
    assert first_at is not None and first_at < engine.sampled_at[-1]
    assert len(pieces) > 5 and "".join(pieces) == whole
    assert last.choices[0].finish_reason == "length" and last.model_extra["segment"] == 0
    probe, streamed = gw.open[f"probe-{seed}"].segments[0], gw.open["s"].segments[0]
    assert streamed.tokens == probe.tokens and streamed.logp == probe.logp
  finally:
    server.shutdown()
    gw.close()


def test_disconnect_aborts_the_request_and_drops_the_turn(tiny_model):
  """A client that stops reading mid-stream: the engine's request ends as `abort` well before
  max_tokens, the episode does not keep the turn, and the gateway counts the call."""
  engine, gw, server, client = _gateway(tiny_model, pace_s=0.05)
  try:
    seed, _ = _long_seed(client, 60)
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=60, seed=seed,
        temperature=1.0, stream=True, extra_headers={"X-Episode-Id": "gone"})
    for chunk in stream:
      if chunk.choices and chunk.choices[0].delta.content:
        break
    stream.close()
    t_end = time.monotonic() + 30
    while gw.metrics().get("calls_cancelled", 0) < 1:
      assert time.monotonic() < t_end, gw.metrics()
      time.sleep(0.02)
    c = engine.completions[-1]
    assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 40, c
    assert "gone" not in gw.open and not gw.busy
  finally:
    server.shutdown()
    gw.close()


def test_text_stream_holds_back_what_may_change(tiny_model):
  """TextStream's pieces join to reply_text's whole text, token by token: a stop string cut
  in the middle of the reply and an incomplete UTF-8 character are never sent early."""
  tok = tiny_model.tokenizer
  ids = tok.encode("ab€cd STOP ef", add_bos=False)
  got = []
  ts = TextStream(tok, tok.stop_ids(), ("STOP",), got.append, lambda: False)
  seen = []
  for t in ids:
    ts.on_token(t, 0.0)
    seen.append("".join(got))
  assert "".join(got) == reply_text(tok, tok.stop_ids(), ids, ("STOP",))[0] == "ab€cd "
  assert all("\ufffd" not in s and "S" not in s for s in seen)
  assert "ab€" not in seen[2] and seen[4] == "ab€"  # € is 3 bytes: sent with its last
  cancelled = TextStream(tok, (), (), got.append, lambda: True)
  assert cancelled.on_token(ids[0], 0.0) is False


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _call(port, path, body, episode=None):
  """(status, JSON body) of one call; (None, reason) when it got no answer."""
  headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
  if episode:
    headers["X-Episode-Id"] = episode
  req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                               headers)
  try:
    with urllib.request.urlopen(req, timeout=120) as r:
      raw = r.read()
      if body.get("stream"):
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: {")]
        err = [e for e in events if "error" in e]
        return (503, err[0]) if err else (200, events)
      return r.status, json.loads(raw)
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())
  except (urllib.error.URLError, ConnectionError) as e:
    return None, type(getattr(e, "reason", e)).__name__


@pytest.mark.parametrize("how", ["max_updates", "sigterm"])
def test_end_of_run_answers_calls_in_flight(tmp_path, how):
  """`launch.gateway` ending (its update budget spent, or SIGTERM) while three agents keep
  calling (each until it is told the gateway is shutting down): every call is answered, 200
  or an OpenAI-shaped 503 `shutting_down` (streamed calls included), the process exits 0, and
  every rewarded record was used by the update, is held by the learner's admission log, or
  is kept in the journal. (Before, calls in flight at the end had their connections reset.)"""
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=XLA_TEST_FLAGS, FR_JAX_GATEWAY_KEY=KEY)
  p = subprocess.Popen(
      [sys.executable, "-m", "launch.gateway", "--config=experiments/configs/tiny_test.py",
       f"--run_dir={tmp_path}", "--config.batch_size=2",
       f"--config.max_updates={1 if how == 'max_updates' else 100}",
       f"--config.gateway.address=127.0.0.1:{port}"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  results, rewarded, stop = [], [], threading.Event()

  def agent(k):
    i = 0
    while not stop.is_set():
      i += 1
      ep = f"a{k}-{i}"
      body = {"messages": [{"role": "user", "content": f"q{i}"}], "seed": i,
              "stream": i % 2 == 0}
      status, out = _call(port, "/v1/chat/completions", body, ep)
      results.append((status, out))
      if status == 200:
        status, out = _call(port, f"/v1/episodes/{ep}/reward", {"reward": float(i % 2)})
        results.append((status, out))
        if status == 200:
          rewarded.extend(out["records"])
      if status is None or status == 503:  # as the answer says: to the next gateway
        return

  try:
    t_end = time.monotonic() + 300
    while True:
      assert p.poll() is None, p.communicate()[1][-3000:]
      assert time.monotonic() < t_end, "launch.gateway did not come up"
      try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
          break
      except OSError:
        time.sleep(0.2)
    agents = [threading.Thread(target=agent, args=(k,)) for k in range(3)]
    for a in agents:
      a.start()
    if how == "sigterm":
      while len(rewarded) < 4:
        assert p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.05)
      p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    stop.set()
    for a in agents:
      a.join(timeout=150)
  finally:
    stop.set()
    if p.poll() is None:
      p.kill()
  assert p.returncode == 0, err[-3000:]
  assert "Fatal Python error" not in err and "terminate called" not in err, err[-3000:]
  assert [out for status, out in results if status is None] == []
  codes = {(s, o["error"]["code"] if s != 200 else "") for s, o in results if s is not None}
  assert codes <= {(200, ""), (503, "shutting_down")}, [o for s, o in results if s != 200]
  assert (200, "") in codes and len(rewarded) >= 2
  # Nothing acknowledged lost: each rewarded record is in the journal (sent again by the next
  # gateway), in the admission log (replayed by the next learner), or was used by an update.
  j = Journal(str(tmp_path / "gateway.db"))
  kept = {t.traj_id for t in j.records()}
  j.close()
  raw, _, _ = AdmissionLog.read(tmp_path / "admission.log")
  logged = {codec.decode_record(r).traj_id for r in raw}
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  used = sum(r["trajectories"] for r in rows if "loss" in r)
  assert len(set(rewarded) - kept - logged) <= used, (len(rewarded), kept, logged, used)
  assert json.loads(out.strip().splitlines()[-1])["gateway"]["records"] == len(rewarded)


def test_concurrent_rewards_each_get_their_own_records(tiny_model):
  """Rewards posted at once from many threads: each is recorded, under record ids of its own
  (two rewards once took the same journal sequence number: `UNIQUE constraint failed:
  records.seq`, answered 503)."""
  rec = Recorder()
  gw = Gateway(EmbeddedEngine(tiny_model.config, tiny_model.params, num_slots=4, max_len=64),
               tiny_model.tokenizer, rec, GatewayConfig(max_new_tokens=1), follow_weights=False)
  try:
    n = 48
    for i in range(n):
      gw.complete({"prompt": [65, 66 + i % 10], "seed": i}, f"e{i}")
    go, out = threading.Barrier(8), {}

    def post(k):
      go.wait()
      for i in range(k, n, 8):
        out[i] = gw.reward(f"e{i}", {"reward": 1.0})["records"]

    threads = [threading.Thread(target=post, args=(k,)) for k in range(8)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    ids = [r for i in range(n) for r in out[i]]
    assert len(out) == n and len(set(ids)) == n
    assert sorted(int(r.rsplit("/", 1)[1]) for r in ids) == list(range(n))
  finally:
    gw.close()


def test_https_with_the_given_certificate(tiny_model, tmp_path):
  """--tls_cert/--tls_key: the gateway serves HTTPS with that certificate (a client that
  trusts its CA gets answers, one that trusts nothing is refused at the handshake), and a
  missing certificate file raises when the server is made, not later in its thread."""
  import ssl

  from tests import tls_certs
  certs = tls_certs.make(tmp_path / "tls")
  gw = Gateway(EmbeddedEngine(tiny_model.config, tiny_model.params, num_slots=2, max_len=64),
               tiny_model.tokenizer, Recorder(), GatewayConfig(max_new_tokens=2),
               follow_weights=False)
  server = GatewayServer(("127.0.0.1", 0), gw, KEY, tls_cert=certs["server_cert"],
                         tls_key=certs["server_key"])
  server.serve_in_thread()
  url = f"https://127.0.0.1:{server.port}"
  try:
    trusting = ssl.create_default_context(cafile=certs["ca"])
    with urllib.request.urlopen(url + "/health", context=trusting, timeout=30) as r:
      assert json.loads(r.read()) == {"status": "ok"}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(
        {"prompt": [65, 66], "seed": 1}).encode(), {"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, context=trusting, timeout=60) as r:
      assert len(json.loads(r.read())["choices"][0]["token_ids"]) <= 2
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
      urllib.request.urlopen(url + "/health", context=ssl.create_default_context(), timeout=30)
  finally:
    server.shutdown()
    gw.close()
  with pytest.raises(FileNotFoundError):
    GatewayServer(("127.0.0.1", 0), gw, KEY, tls_cert=str(tmp_path / "none.pem"),
                  tls_key=str(tmp_path / "none.key"))


def test_a_call_joins_the_running_batch(tiny_model):
  """The gateway's engine thread (`Batcher`) on the embedded engine: a call that arrives
  while a long one decodes joins it at the next step and gets its completion when it ends,
  long before the long one does (before, it waited for the whole batch); a weight swap
  asked meanwhile runs between two decode steps, and the long request's tokens after it
  carry the new version. The short call's tokens are those it samples alone."""
  from fr_jax.rollout.batcher import Batcher
  from fr_jax.rollout.engine import Request
  engine = _Paced(tiny_model.config, tiny_model.params, num_slots=2, max_len=256, pace_s=0.02)
  b = Batcher(engine, max_batch=8)
  long_req = Request("long", [65, 66], max_new_tokens=120, temperature=1.0, seed=1)
  got, at = {}, {}

  def call(r):
    got[r.request_id] = b.generate(r)
    at[r.request_id] = time.perf_counter()

  try:
    t = threading.Thread(target=call, args=(long_req,))
    t.start()
    while len(engine.sampled_at) < 5:
      time.sleep(0.005)
    short = Request("short", [67, 68, 69], max_new_tokens=3, temperature=1.0, seed=2)
    call(short)
    b.call(lambda: engine.update_weights(tiny_model.params, 7))
    t.join(60)
  finally:
    b.close()
  assert got["long"].finish_reason == "length" and at["short"] < at["long"] - 1.0
  v = got["long"].versions
  assert v[0] == 0 and v[-1] == 7 and v == sorted(v)  # swapped between two steps
  (alone,) = EmbeddedEngine(tiny_model.config, tiny_model.params, num_slots=2,
                            max_len=256).generate([short])
  assert got["short"].token_ids == alone.token_ids
