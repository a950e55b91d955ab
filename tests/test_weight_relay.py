"""The weight relay (fr_jax/transport/relay.py, launch/weight_relay.py): checksummed weight
chunks, atomic version directories, retries after damaged or cut streams, and the whole path
with the REAL sglang-router (a subprocess) in front of two STAND-IN SGLang servers
(tests/sglang_standin.py; real SGLang needs CUDA), one relay process beside each, and a
learner-side gRPC weight service (`fr_jax.transport.server.serve`) publishing versions 1
and 2."""

import collections
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import zlib
from concurrent import futures

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fr_jax import durable
from fr_jax.models import decoder, registry
from fr_jax.models.hf_io import load_hf
from fr_jax.rollout.engine import Request
from fr_jax.rollout.sglang import Reason, SGLangEngine, SGLangError
from fr_jax.transport import codec, relay, rpc
from fr_jax.transport import fr_jax_pb2 as pb
from fr_jax.transport import server as srv
from fr_jax.transport.client import WeightsClient
from tests import XLA_TEST_FLAGS
from tests.helpers import wait_for
from tests.sglang_standin import PublishedWeights, StandInSGLang

CONFIG = "--config=experiments/configs/tiny_test.py"  # tiny-chat, float32
ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=XLA_TEST_FLAGS)  # one device per process


def host_params(seed: int):
  """tiny-chat parameters (seed `seed`) as NumPy arrays."""
  return jax.tree.map(np.asarray, registry.load("tiny-chat", seed=seed).params)


def flat_equal(a, b) -> bool:
  fa, fb = codec.flatten(a), codec.flatten(b)
  return fa.keys() == fb.keys() and all(np.array_equal(fa[k], fb[k]) for k in fa)


# --- checksums in the chunk stream ---
def chunks_of(flat, chunk_bytes=64):
  return list(codec.weight_chunks(4, flat, chunk_bytes=chunk_bytes))


FLAT = {"a": np.arange(100, dtype=np.float32).reshape(4, 25), "b": np.arange(7, dtype=np.int32),
        "empty": np.zeros((0, 3), np.float32)}


def test_every_tensor_carries_its_crc32_on_its_last_chunk():
  chunks = chunks_of(FLAT)
  last = {}
  for c in chunks:
    last[c.name] = c
    assert c.HasField("crc32") == (c.offset + len(c.data) == c.total_bytes)
  for name, a in FLAT.items():  # the CRC of the raw little-endian bytes, computed here
    assert last[name].crc32 == zlib.crc32(a.tobytes())
  v, got, _ = codec.assemble_weights(chunks)
  assert v == 4 and all(np.array_equal(got[k], FLAT[k]) for k in FLAT)
  # chunks out of order still verify (over the whole buffer)
  v, got, _ = codec.assemble_weights(chunks[::-1])
  assert all(np.array_equal(got[k], FLAT[k]) for k in FLAT)


def test_one_corrupt_byte_is_a_checksum_mismatch():
  chunks = chunks_of(FLAT)
  bad = pb.WeightsChunk()
  bad.CopyFrom(chunks[2])  # a middle chunk of tensor 'a', without the CRC
  data = bytearray(bad.data)
  data[5] ^= 0x01
  bad.data = bytes(data)
  with pytest.raises(codec.WeightsError, match="tensor 'a'") as e:
    codec.assemble_weights(chunks[:2] + [bad] + chunks[3:])
  assert e.value.reason == "checksum_mismatch"
  # a repeated chunk standing in for a missing one has the right byte count, the wrong bytes
  with pytest.raises(codec.WeightsError) as e:
    codec.assemble_weights(chunks[:2] + [chunks[1]] + chunks[3:])
  assert e.value.reason == "checksum_mismatch"


@pytest.mark.parametrize("damage, reason", [
    (lambda cs: cs[:-1], "incomplete"),
    (lambda cs: [c for c in cs if c.name != "b"], "incomplete"),
    (lambda cs: [], "empty"),
    (lambda cs: [pb.WeightsChunk(**{**_fields(c), "crc32": None}) for c in cs], "no_checksum"),
    (lambda cs: cs[:1] + [pb.WeightsChunk(**{**_fields(cs[1]), "offset": 10_000})] + cs[2:],
     "bad_chunk"),
    (lambda cs: cs[:1] + [pb.WeightsChunk(**{**_fields(cs[1]), "version": 5})] + cs[2:],
     "mixed_versions"),
])
def test_damaged_streams_are_named(damage, reason):
  with pytest.raises(codec.WeightsError) as e:
    codec.assemble_weights(damage(chunks_of(FLAT)))
  assert e.value.reason == reason


def test_hostile_shapes_and_sizes_are_named_before_any_allocation():
  """A shape whose byte count overflows int64 used to raise ValueError (not WeightsError:
  it ended the relay's thread), and the receive buffer was sized from the sender's
  total_bytes before anything was checked against the model: a stream can now be held to
  `max_bytes` (the model's size) before a byte is allocated."""
  first = _fields(chunks_of(FLAT)[0])
  # 2**62 * 8 * 4 bytes wraps to 0 in int64: an "empty" tensor of that shape
  huge = pb.WeightsChunk(**{**first, "shape": [2**62, 8], "total_bytes": 0, "data": b"",
                            "num_tensors": 1, "crc32": 0})
  with pytest.raises(codec.WeightsError) as e:
    codec.assemble_weights([huge])
  assert e.value.reason == "bad_chunk"
  big = pb.WeightsChunk(**{**first, "shape": [2**20, 2**10], "total_bytes": 2**32,
                           "dtype": "float32", "data": b""})
  with pytest.raises(codec.WeightsError) as e:
    codec.assemble_weights([big], max_bytes=10**6)
  assert e.value.reason == "too_big"
  total = sum(a.nbytes for a in FLAT.values())
  with pytest.raises(codec.WeightsError) as e:  # the sum over tensors counts, not each alone
    codec.assemble_weights(chunks_of(FLAT), max_bytes=total - 1)
  assert e.value.reason == "too_big"
  assert codec.assemble_weights(chunks_of(FLAT), max_bytes=total)[0] == 4


def _fields(c):
  d = {f.name: getattr(c, f.name) for f in c.DESCRIPTOR.fields}
  d["crc32"] = c.crc32 if c.HasField("crc32") else None
  return d


# --- atomic versions on disk ---
def test_write_version_is_whole_or_invisible(tmp_path):
  cfg = registry.TINY_CONFIGS["tiny-chat"]
  p1, p2 = host_params(1), host_params(2)
  path = relay.write_version(tmp_path, 1, p1, cfg)
  assert path == tmp_path / "v00000001" and relay.versions_on_disk(tmp_path) == [1]
  assert flat_equal(load_hf(path)[1], p1)

  def dies_midway(path, params, cfg, tokenizer_files=None):
    (path / "model.safetensors").write_bytes(b"\0" * 100)  # half a checkpoint
    raise OSError(28, "No space left on device")

  with pytest.raises(OSError, match="No space"):
    relay.write_version(tmp_path, 2, p2, cfg, save=dies_midway)
  assert sorted(os.listdir(tmp_path)) == ["v00000001"]  # nothing of v2, not even hidden
  # the same number again (a learner restarted from an older checkpoint): replaced whole
  relay.write_version(tmp_path, 1, p2, cfg)
  assert flat_equal(load_hf(tmp_path / "v00000001")[1], p2)
  for v in (2, 3, 4):
    relay.write_version(tmp_path, v, p1, cfg)
  assert durable.prune(tmp_path, 4, keep=2) == [1, 2]
  assert relay.versions_on_disk(tmp_path) == [3, 4]


def test_hf_major_relays_out_in_place():
  """The relay's re-layout keeps every value and the memory it was given, and leaves each
  layer's HF-shaped [out, in] matrix contiguous, so save_hf transposes without copying."""
  rng = np.random.default_rng(0)
  wq = rng.standard_normal((3, 4, 6)).astype(np.float32)
  received = np.frombuffer(bytearray(wq.tobytes()), np.float32).reshape(wq.shape)
  norm = np.ones((3, 4), np.float32)
  got = relay.hf_major({"layers": {"wq": received, "attn_norm": norm}})["layers"]
  assert np.array_equal(got["wq"], wq) and np.shares_memory(got["wq"], received)
  assert all(got["wq"][i].T.flags.c_contiguous for i in range(3))
  assert got["attn_norm"] is norm


def test_a_kill_mid_write_leaves_no_visible_version(tmp_path):
  """SIGKILL while the safetensors file is half written: no vNNNNNNNN appears, and the next
  relay start removes the hidden leftover."""
  code = f"""
import sys, time
from pathlib import Path
from fr_jax import durable
from fr_jax.models import decoder, registry
from fr_jax.transport import relay
def slow(path, params, cfg, tokenizer_files=None):
  (path / "model.safetensors").write_bytes(b"\\0" * 4096)
  print("writing", flush=True)
  time.sleep(60)
relay.write_version({str(tmp_path)!r}, 7, {{}}, registry.TINY_CONFIGS["tiny-chat"], save=slow)
"""
  p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=ENV)
  try:
    assert p.stdout.readline().strip() == "writing"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
  finally:
    p.kill()
  left = os.listdir(tmp_path)
  assert relay.versions_on_disk(tmp_path) == [] and len(left) == 1 and left[0].startswith(".v")
  assert relay.clean_partial(tmp_path) == left and os.listdir(tmp_path) == []


# --- retries ---
class Faulty:
  """A GetWeights proxy in front of a real weight service that damages the fetches it is
  told to: `corrupt` flips a byte in one chunk, `cut` aborts the stream midway, `truncate`
  ends it early."""

  def __init__(self, upstream: str, faults):
    self.channel = grpc.insecure_channel(upstream)
    self.up = rpc.Stub(self.channel)
    self.faults = list(faults)

  def GetWeights(self, request, context):
    fault = self.faults.pop(0) if self.faults else None
    for i, c in enumerate(self.up.GetWeights(request)):
      if i == 3 and fault == "corrupt":
        data = bytearray(c.data)
        data[len(data) // 2] ^= 0x40
        c.data = bytes(data)
      if i == 3 and fault == "cut":
        context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset (injected)")
      if i == 3 and fault == "truncate":
        return
      yield c

  def Heartbeat(self, request, context):
    return self.up.Heartbeat(request)

  def PushTrajectories(self, request_iterator, context):
    context.abort(grpc.StatusCode.UNIMPLEMENTED, "not here")

  def GetManifest(self, request, context):  # this weight service has no shards
    context.abort(grpc.StatusCode.UNIMPLEMENTED, "not here")


def test_damaged_or_cut_fetches_are_retried_until_whole(tmp_path, monkeypatch):
  service = PublishedWeights()
  p1 = host_params(11)
  service.publish(1, p1)
  server, port = srv.serve(service)
  proxy = grpc.server(futures.ThreadPoolExecutor(4))
  faulty = Faulty(f"127.0.0.1:{port}", ["corrupt", "cut", "truncate"])
  rpc.add_to_server(faulty, proxy)
  pport = proxy.add_insecure_port("127.0.0.1:0")
  proxy.start()
  loads = []
  cfg, tok = relay.model_spec("tiny-chat")
  client = WeightsClient(f"127.0.0.1:{pport}", worker_id="relay-test")
  r = relay.Relay(client, lambda path, v: loads.append((path, v)), tmp_path, cfg, tok,
                  backoff_min=0.01, say=lambda line: None)
  try:
    d = r.deliver(0, threading.Event())
    assert d.version == 1 and d.attempts == 4
    assert dict(r.failures) == {"checksum_mismatch": 1, "stream_cut": 1, "incomplete": 1}
    assert loads == [(str(tmp_path / "v00000001"), 1)]
    written_cfg, written = load_hf(tmp_path / "v00000001")
    assert flat_equal(written, p1) and written_cfg == cfg
    assert (tmp_path / "v00000001" / "tokenizer.json").is_file()
    # a write that fails (a full disk) leaves nothing and waits for the next poll; a load
    # the server refuses is tried again
    service.publish(2, host_params(12))
    real_write, refusals = relay.write_version, [OSError(111, "connection refused")]

    def full_disk(*a, **kw):
      relay.write_version = real_write
      raise OSError(28, "No space left on device")

    def flaky_load(path, v):
      if refusals:
        raise refusals.pop()
      loads.append((path, v))

    monkeypatch.setattr(relay, "write_version", full_disk)
    r.load = flaky_load
    assert r.deliver(2, threading.Event()) is None and r.failures["write_failed"] == 1
    assert relay.versions_on_disk(tmp_path) == [1] and r.delivered == 1
    assert r.deliver(2, threading.Event()).version == 2 and r.failures["load_unreachable"] == 1
    assert loads[-1] == (str(tmp_path / "v00000002"), 2) and r.delivered == 2
    # a relay configured for another model stops with a named error, writing nothing
    other = relay.Relay(client, loads.append, tmp_path / "other",
                        registry.TINY_CONFIGS["tiny-qwen2"], say=lambda line: None)
    with pytest.raises(relay.RelayError, match="give --config the learner's run config"):
      other.deliver(0, threading.Event())
    assert relay.versions_on_disk(tmp_path / "other") == []
  finally:
    client.close()
    faulty.channel.close()
    proxy.stop(None)
    srv.stop(server)


def test_bad_flags_fail_with_one_line(tmp_path):
  for args, needle in [([f"--dir={tmp_path}", "--keep=0"], "--keep=0"),
                       ([f"--dir={tmp_path}", "--server=localhost:30000"], "--server"),
                       (["--learner=127.0.0.1:1"], "--dir is required"),
                       ([f"--dir={tmp_path}", "--learner=nohost"], "--learner='nohost'")]:
    out = subprocess.run([sys.executable, "-m", "launch.weight_relay", CONFIG, *args],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 2, out.stderr[-1000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and needle in last, out.stderr[-1000:]


# --- the fleet: router, two servers, two relays ---
def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def router_ready(url) -> bool:
  try:
    with urllib.request.urlopen(url + "/workers", timeout=2) as r:
      return json.loads(r.read())["total"] == 2 and urllib.request.urlopen(
          url + "/readiness", timeout=2).status == 200
  except OSError:
    return False


@functools.partial(jax.jit, static_argnums=1)
def _logp_table(params, cfg, seq_1xL):
  """log-softmax over the vocabulary at every position of one causal forward pass."""
  pos_1xL = jnp.arange(seq_1xL.shape[1])[None]
  h, _ = decoder.forward(params, cfg, seq_1xL, pos_1xL)
  return jax.nn.log_softmax(decoder.logits_from_hidden(params, cfg, h).astype(jnp.float32))


def scored(params, cfg, prompt, tokens, pad_to=64):
  """Teacher-forced log-probs of `tokens` after `prompt` (T = 1), the sequence padded at the
  end to one length so that the forward compiles once (causal: padding changes nothing)."""
  seq = list(prompt) + list(tokens)
  assert len(seq) <= pad_to
  table = np.asarray(_logp_table(params, cfg, jnp.asarray([seq + [0] * (pad_to - len(seq))])))
  p = len(prompt)
  return table[0, np.arange(p - 1, len(seq) - 1), tokens]


def test_a_refused_load_is_not_retried_and_an_unreachable_server_is(tmp_path):
  """A server that answers "no" to a load (success false: another model, a bad path) is not
  asked again: each retry used to pause it in abort mode (8 pause/load/continue cycles in
  6 s). The refusal is counted with its reason and the relay waits for another version; a
  server that cannot be reached is retried until it can."""
  service = PublishedWeights()
  service.publish(1, host_params(11))
  server, port = srv.serve(service)
  standin = StandInSGLang(registry.load("tiny-llama"))  # serves another model: refuses
  client = WeightsClient(f"127.0.0.1:{port}", worker_id="relay-test")
  cfg, tok = relay.model_spec("tiny-chat")
  engine = SGLangEngine(standin.url, retries=0)
  r = relay.Relay(client, engine.update_weights, tmp_path, cfg, tok, backoff_min=0.05,
                  load_errors=(SGLangError,), poll_s=0.1, say=lambda line: None,
                  unreachable=lambda e: e.reason is Reason.UNREACHABLE)
  stop = threading.Event()
  t = threading.Thread(target=r.run, args=(stop,))
  try:
    t.start()
    time.sleep(1.5)
    stop.set()
    t.join(30)
    loads = [p for p, _ in standin.log if p == "/update_weights_from_disk"]
    pauses = [p for p, _ in standin.log if p == "/pause_generation"]
    assert (len(loads), len(pauses)) == (1, 1)
    assert r.failures["load_refused"] == 1 and r.delivered == -1
    assert "architecture differs" in r.refused[1]
    # Unreachable (the server is down): retried until it answers.
    standin.close()
    calls = []

    def down_twice(path, v):
      calls.append(v)
      if len(calls) <= 2:
        raise SGLangError("cannot reach", Reason.UNREACHABLE)

    r.load = down_twice
    r.refused.clear()
    assert r.deliver(1, threading.Event()).version == 1
    assert calls == [1, 1, 1] and r.failures["load_unreachable"] == 2
  finally:
    stop.set()
    client.close()
    engine.close()
    srv.stop(server)


def test_a_restarted_server_gets_the_current_version_again(tmp_path, tiny_model):
  """A server that restarts comes back with the weights it was launched with; the relay
  notices (the server's /model_info weight_version is not what it delivered) and loads the
  current version again. It used to believe the server still held it."""
  service = PublishedWeights()
  service.publish(1, host_params(11))
  server, port = srv.serve(service)
  standin = StandInSGLang(tiny_model)
  sport = int(standin.url.rsplit(":", 1)[1])
  client = WeightsClient(f"127.0.0.1:{port}", worker_id="relay-test")
  cfg, tok = relay.model_spec("tiny-chat")
  engine = SGLangEngine(standin.url, retries=0)
  r = relay.Relay(client, engine.update_weights, tmp_path, cfg, tok, backoff_min=0.05,
                  load_errors=(SGLangError,), poll_s=0.1, say=lambda line: None,
                  unreachable=lambda e: e.reason is Reason.UNREACHABLE,
                  served=engine.served_version)
  stop = threading.Event()
  t = threading.Thread(target=r.run, args=(stop,))
  try:
    t.start()
    wait_for(lambda: r.delivered == 1, 60, "v1 delivered")
    standin.close()
    standin = StandInSGLang(tiny_model, port=sport)  # back with its launch weights
    assert engine.served_version() is None  # "default": no version given at launch
    # The stand-in records a load before it answers; the relay counts it delivered after the
    # answer, so wait for both (CI saw delivered == -1 between the two).
    wait_for(lambda: [v for v, _, _ in standin.loads] == [1] and r.delivered == 1, 60,
             "v1 loaded again and counted delivered")
    assert r.failures["server_reset"] >= 1
  finally:
    stop.set()
    t.join(30)
    client.close()
    engine.close()
    standin.close()
    srv.stop(server)


def test_router_two_servers_two_relays_exact_versions(tmp_path, tiny_model):
  service = PublishedWeights()
  params = {1: host_params(11), 2: host_params(12)}
  service.publish(1, params[1])
  server, port = srv.serve(service)
  standins = [StandInSGLang(tiny_model, num_slots=4, max_len=128) for _ in range(2)]
  rport = free_port()
  router = subprocess.Popen(
      [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls",
       *[s.url for s in standins], "--host", "127.0.0.1", "--port", str(rport),
       "--policy", "round_robin", "--log-level", "warn"],
      stdout=open(tmp_path / "router.log", "w"), stderr=subprocess.STDOUT)
  relays = [subprocess.Popen(
      [sys.executable, "-m", "launch.weight_relay", CONFIG, f"--learner=127.0.0.1:{port}",
       f"--server={s.url}", f"--dir={tmp_path / f'relay{k}'}", "--poll_s=0.2"],
      stdout=subprocess.PIPE, stderr=open(tmp_path / f"relay{k}.log", "w"), text=True, env=ENV)
      for k, s in enumerate(standins)]
  url = f"http://127.0.0.1:{rport}"
  engine = SGLangEngine(url, timeout=120)
  rng = np.random.default_rng(0)
  done: list = []  # (request, completion)

  def batch(n, max_new):
    rs = [Request(f"q{len(done) + i}", rng.integers(0, 259, int(rng.integers(3, 12))).tolist(),
                  max_new, temperature=1.0, top_p=1.0, seed=len(done) + i) for i in range(n)]
    done.extend(zip(rs, engine.generate(rs)))

  try:
    wait_for(lambda: router_ready(url), 60, "the router and its two workers", [router])
    batch(4, 4)  # compiles the stand-ins' engine (shared) while the relays start
    wait_for(lambda: all(s.loads and s.loads[-1][0] == 1 for s in standins), 90,
             "version 1 on both servers", [router, *relays])
    for s in standins:
      s.step_delay = 0.03  # requests span the switch to version 2
    gen = threading.Thread(target=lambda: (batch(8, 48), batch(8, 48)))
    steps0 = [s.steps for s in standins]
    gen.start()
    wait_for(lambda: all(s.steps > s0 + 3 for s, s0 in zip(standins, steps0)), 30,
             "generation under way on both servers")
    service.publish(2, params[2])
    wait_for(lambda: all(s.loads[-1][0] == 2 for s in standins), 60,
             "version 2 on both servers", [router, *relays])
    gen.join(120)
    assert not gen.is_alive()
    batch(4, 8)  # after the switch: version 2 only
    relays[0].send_signal(signal.SIGTERM)  # one relay stops on SIGTERM ...
    service.shutdown.set()  # ... the other when the learner says the run is over
    outs = [p.communicate(timeout=60)[0] for p in relays]
  finally:
    for p in (*relays, router):
      if p.poll() is None:
        p.kill()
    router.wait(30)
    engine.close()
    for s in standins:
      s.close()
    srv.stop(server)

  # relays: clean exits, both versions delivered, lines as documented, whole versions on disk
  for k, (p, out) in enumerate(zip(relays, outs)):
    assert p.returncode == 0, (tmp_path / f"relay{k}.log").read_text()[-2000:]
    lines = out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["stopped"] in ("stopped", "shutdown") and summary["delivered"] == 2
    assert [d["version"] for d in summary["versions"]] == [1, 2]
    assert any(line.startswith("relay: v2 fetched") and f"loaded by {standins[k].url}" in line
               for line in lines)
    assert summary["on_disk"] == [1, 2]
    assert sorted(os.listdir(tmp_path / f"relay{k}")) == ["v00000001", "v00000002"]
  assert json.loads(outs[1].strip().splitlines()[-1])["stopped"] == "shutdown"
  assert {f"relay@{s.url}" for s in standins} <= set(service.workers)

  # the router spread generation over both servers (round robin)
  counts = [s.generated for s in standins]
  assert min(counts) >= 0.3 * sum(counts), counts

  # each server switched 1 -> 2 exactly once, and serves the published arrays of version 2
  for s in standins:
    assert [v for v, _, _ in s.loads] == [1, 2]
    served = s.engine.params
    want = params[2]
    assert np.array_equal(served["embed"], want["embed"])
    assert np.array_equal(served["final_norm"], want["final_norm"])
    for i, layer in enumerate(served["layer_list"]):
      for k, a in layer.items():
        assert np.array_equal(a, want["layers"][k][i]), (i, k)

  # every token's version is the version that produced it: its log-prob, recomputed with the
  # published weights of that version, matches; tokens before the switch are 1, after it 2
  # (with two versions and pauses only for the switch to 2, a request's versions never go
  # down: a request is aborted only by its server's switch, and resumes on 1 or 2)
  cfg = tiny_model.config
  spans = collections.Counter()
  for r, c in done[4:]:
    assert c.token_ids and set(c.versions) <= {1, 2}
    assert c.versions == sorted(c.versions)
    spans[tuple(sorted(set(c.versions)))] += 1
    lp = {v: scored(params[v], cfg, r.prompt_ids, c.token_ids) for v in set(c.versions)}
    want = np.array([lp[v][i] for i, v in enumerate(c.versions)])
    np.testing.assert_allclose(c.logprobs, want, atol=1e-4)
  assert spans[(1, 2)] >= 1, spans  # some requests were paused, resumed, and finished on v2
  assert all(c.versions == [2] * len(c.token_ids) for _, c in done[-4:])
