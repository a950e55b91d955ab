"""Weights at fleet speed (fr_jax/transport/shards.py, fr_jax/models/hf_shards.py): pieces
served by several hosts from their own shards, assembled by relays into one safetensors file
equal to the HF export of the whole model in the serving dtype; deltas bit-exact; relays
feeding relays with the learner's egress bounded; a peer that dies mid-fetch, damaged and
mixed-version streams.

The reference is independent of the pieces: `hf_io.save_hf` of the whole parameters cast to
the serving dtype (and `safetensors.safe_open` reading the relay's file)."""

import json
import threading
from pathlib import Path

import grpc
import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from fr_jax.learner import mesh as meshlib
from fr_jax.models import hf_io, hf_shards, lora, registry
from fr_jax.transport import codec, shard_fetch, shards
from fr_jax.transport import fr_jax_pb2 as pb
from fr_jax.transport import server as srv
from fr_jax.transport.client import WeightsClient

BF16 = np.dtype(ml_dtypes.bfloat16)


def host_of(d):  # two "learner processes" in this one: devices split by id
  return d.id % 2


@pytest.fixture(scope="module")
def model():
  m = registry.load("tiny-qwen3-moe", seed=3)  # stacked layers, experts, a router, biases
  return m.config, jax.tree.map(np.asarray, m.params)


def sharded(params, fsdp=4, data=2):
  mesh = meshlib.make_mesh(data, fsdp)
  return meshlib.put(params, meshlib.params_sharding(params, mesh))


def perturbed(params, seed, frac=0.01):
  """A next version: a few elements moved (as an update at a small learning rate does in
  bf16)."""
  rng = np.random.default_rng(seed)
  def one(a):
    a = a.copy()
    flat = a.reshape(-1)
    idx = rng.choice(flat.size, max(1, int(frac * flat.size)), replace=False)
    flat[idx] += 0.05 * rng.standard_normal(idx.size).astype(a.dtype)
    return a
  return jax.tree.map(one, params)


def reference(tmp_path, params, cfg, name="ref"):
  """{HF name: bf16 array} of the whole model, exported the independent way."""
  p16 = jax.tree.map(lambda a: np.asarray(a).astype(BF16), params)
  d = hf_io.save_hf(tmp_path / name, p16, cfg.replace(param_dtype="bfloat16"))
  out = {}
  for f in d.glob("*.safetensors"):
    with safe_open(str(f), framework="numpy") as h:
      out.update({k: h.get_tensor(k) for k in h.keys()})
  return out


def read_file(path):
  with safe_open(str(path), framework="numpy") as h:
    return {k: h.get_tensor(k) for k in h.keys()}


def assert_bit_equal(got, want):
  assert sorted(got) == sorted(want)
  for k in want:
    assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
    assert got[k].view(np.uint16).tobytes() == want[k].view(np.uint16).tobytes(), k


class Hosts:
  """Two shard hosts ("processes" 0 and 1 by device id), each serving the pieces of its own
  devices over gRPC, fed by `publish(version, params)`."""

  def __init__(self, cfg):
    self.cfg = cfg
    self.hosts = [shards.ShardHost("bfloat16") for _ in range(2)]
    self.servers = [srv.serve_shards(h) for h in self.hosts]
    self.addresses = [f"127.0.0.1:{port}" for _, port in self.servers]
    self.manifest = None

  def publish(self, version, params):
    arrays = sharded(params)
    self.manifest = hf_shards.manifest_of(arrays, self.cfg, "bfloat16", host_of)
    for k, h in enumerate(self.hosts):
      h.put(version, self.manifest,
            hf_shards.local_pieces(arrays, self.cfg, self.manifest, k, host_of))

  @property
  def sent(self):
    return sum(h.sent_bytes for h in self.hosts)

  def close(self):
    for s, _ in self.servers:
      srv.stop(s, grace=0)


def open_stream(client):
  return lambda address, version, pieces, base: client.open_shards(address, version, pieces,
                                                                   base, timeout=60)


def test_pieces_from_two_hosts_make_the_bf16_export_and_deltas_are_bit_exact(tmp_path, model):
  cfg, params = model
  hosts = Hosts(cfg)
  client = WeightsClient("127.0.0.1:1")  # the shard channels only
  try:
    hosts.publish(1, params)
    m = hosts.manifest
    assert {p.host for p in m.pieces} == {0, 1}  # both hosts serve part of the model
    assert m.nbytes == sum(a.size for a in jax.tree.leaves(params)) * 2
    src = [shard_fetch.Source("hosts", hosts=tuple(hosts.addresses))]
    v1 = shard_fetch.VersionFile(tmp_path / "v1.safetensors", m, 1)
    got = shard_fetch.fetch(v1, src, open_stream(client))
    assert got == {"failures": {}, "sources": ["hosts"]}
    assert_bit_equal(read_file(v1.path), reference(tmp_path, params, cfg))
    assert hosts.sent == m.nbytes  # the plain bytes, once
    three = shard_fetch.VersionFile(tmp_path / "v1b.safetensors", m, 1)  # 3 streams per host
    shard_fetch.fetch(three, src, open_stream(client), streams=3)
    assert three.path.read_bytes() == v1.path.read_bytes()
    assert sum(v1.received.values()) == m.nbytes

    # Version 2 as deltas against version 1: a fraction of the bytes, the same result.
    params2 = perturbed(params, 0)
    hosts.publish(2, params2)
    v2 = shard_fetch.VersionFile(tmp_path / "v2.safetensors", m, 2)
    shard_fetch.fetch(v2, src, open_stream(client), base=v1)
    assert_bit_equal(read_file(v2.path), reference(tmp_path, params2, cfg, "ref2"))
    wire = sum(v2.received.values())
    assert sum(h.sent["delta"] for h in hosts.hosts) > 0
    assert wire < 0.5 * m.nbytes, (wire, m.nbytes)
  finally:
    client.close()
    hosts.close()


def test_manifest_runs_and_header_match_a_safetensors_file(model):
  """The file layout from the manifest alone: offsets and runs agree with a file
  safetensors itself reads (above), and every byte of the data lies in exactly one run."""
  cfg, params = model
  m = hf_shards.manifest_of(sharded(params), cfg, "bfloat16", host_of)
  header = len(m.header())
  assert header % 8 == 0
  covered = np.zeros(m.nbytes, np.int8)
  for i in range(len(m.pieces)):
    runs = m.runs(i, header)
    assert sum(n for _, _, n in runs) == m.piece_bytes(i)
    for f, _, n in runs:
      covered[f - header:f - header + n] += 1
  assert (covered == 1).all()
  with pytest.raises(hf_shards.ManifestError, match="add up"):  # a piece short
    hf_shards.Manifest.from_json(hf_shards.Manifest(m.dtype, m.tensors, m.pieces[:-1]).to_json())
  p = m.pieces[0]
  outside = hf_shards.Piece(p.tensor, (p.start[0] + 10**6, *p.start[1:]), p.shape, p.host)
  with pytest.raises(hf_shards.ManifestError, match="outside"):
    hf_shards.Manifest.from_json(hf_shards.Manifest(m.dtype, m.tensors,
                                                    (outside, *m.pieces[1:])).to_json())
  assert hf_shards.Manifest.from_json(m.to_json()) == m


def test_damaged_and_mixed_version_streams_are_refused_then_fetched_whole(tmp_path, model):
  cfg, params = model
  hosts = Hosts(cfg)
  client = WeightsClient("127.0.0.1:1")
  try:
    hosts.publish(1, params)
    m = hosts.manifest
    real = open_stream(client)
    for damage, reason in (("flip", "checksum_mismatch"), ("version", "mixed_versions"),
                           ("cut", "incomplete")):
      def bad(address, version, pieces, base, damage=damage):
        for k, c in enumerate(real(address, version, pieces, base)):
          if k == 1:
            if damage == "cut":
              return
            c = pb.WeightsChunk.FromString(c.SerializeToString())
            if damage == "flip":
              c.data = bytes([c.data[0] ^ 1]) + c.data[1:]
            else:
              c.version += 1
          yield c
      vf = shard_fetch.VersionFile(tmp_path / f"{damage}.safetensors", m, 1)
      with pytest.raises(codec.WeightsError, match="incomplete") as e:
        shard_fetch.fetch(vf, [shard_fetch.Source("hosts", hosts=tuple(hosts.addresses))], bad)
      assert reason in str(e.value)
      assert vf.missing()  # refused pieces are not marked done
      # The next source (the hosts again, undamaged) completes it: only what was missing.
      missing, before = vf.missing(), sum(vf.received.values())
      assert 0 < len(missing) < len(m.pieces)
      shard_fetch.fetch(vf, [shard_fetch.Source("hosts", hosts=tuple(hosts.addresses))], real)
      assert sum(vf.received.values()) - before == sum(m.piece_bytes(i) for i in missing)
      assert_bit_equal(read_file(vf.path), reference(tmp_path, params, cfg))
  finally:
    client.close()
    hosts.close()


def test_relays_feed_relays_and_a_dead_parent_falls_back_to_the_hosts(tmp_path, model):
  """Five relays through the Fanout tree (root 2, fanout 2): the hosts send the version
  twice, whatever the fleet's size; each relay's file equals the export. The parent of two
  relays then dies after its first pieces of version 2: its children fall back to the hosts
  and still end bit-equal."""
  cfg, params = model
  hosts = Hosts(cfg)
  fan = shards.Fanout(root=2, fanout=2)
  client = WeightsClient("127.0.0.1:1")
  relays = []
  try:
    def run_relay(k, version, base, die_after=None):
      name = f"r{k}"
      vf = shard_fetch.VersionFile(tmp_path / f"{name}-v{version}.safetensors", hosts.manifest,
                              version)
      holder = type("Holder", (), {})()
      if die_after is None:
        holder.serve = vf.serve
      else:  # serves `die_after` pieces of each stream, then its server goes away
        def dying(request, context, vf=vf):
          for c in vf.serve(request, context):
            if c.piece >= die_after and c.HasField("crc32"):
              context.abort(grpc.StatusCode.UNAVAILABLE, "killed")
            yield c
        holder.serve = dying
      server, port = srv.serve_shards(holder)
      relays.append(server)
      parent = fan.parent(name, f"127.0.0.1:{port}", version)
      src = ([shard_fetch.Source(f"relay {parent}", parent)] if parent else []) + \
          [shard_fetch.Source("hosts", hosts=tuple(hosts.addresses))]
      out = {}
      t = threading.Thread(target=lambda: out.update(
          shard_fetch.fetch(vf, src, open_stream(client), base=base)))
      t.start()
      return vf, t, parent, out

    hosts.publish(1, params)
    m = hosts.manifest
    started = [run_relay(k, 1, None) for k in range(5)]
    for _, t, _, _ in started:
      t.join(60)
    parents = [p for _, _, p, _ in started]
    assert parents[:2] == ["", ""] and all(parents[2:])  # two from the hosts, three from relays
    want = reference(tmp_path, params, cfg)
    for vf, _, _, out in started:
      assert out["failures"] == {}
      assert_bit_equal(read_file(vf.path), want)
    assert hosts.sent == 2 * m.nbytes  # the learner's egress: twice the model, not five times

    params2 = perturbed(params, 1)
    hosts.publish(2, params2)
    before = hosts.sent
    v1 = [vf for vf, _, _, _ in started]
    first = [run_relay(0, 2, v1[0], die_after=1), run_relay(1, 2, v1[1])]
    children = [run_relay(k, 2, v1[k]) for k in (2, 3)]
    for _, t, _, _ in first + children:
      t.join(60)
    assert children[0][2] == children[1][2]  # both children of relay 0, which died
    want2 = reference(tmp_path, params2, cfg, "ref2")
    for vf, _, _, _ in first + children:
      assert not vf.missing()
      assert_bit_equal(read_file(vf.path), want2)
    for _, _, _, out in children:
      assert out["sources"] == [out["sources"][0], "hosts"] and \
          out["failures"].get("stream_cut", 0) + out["failures"].get("unreachable", 0) >= 1
    assert hosts.sent - before < 4 * m.nbytes * 0.5  # deltas, even with the fallbacks
  finally:
    client.close()
    for s in relays:
      srv.stop(s, grace=0)
    hosts.close()


def test_fanout_skips_relays_not_heard_from():
  fan = shards.Fanout(root=1, fanout=1, alive_s=10.0)
  assert fan.parent("a", "a:1", 5) == ""
  assert fan.parent("b", "b:1", 5) == "a:1"
  assert fan.parent("c", "c:1", 5) == "b:1"  # a has its one child
  assert fan.parent("b", "b:1", 5) == "a:1"  # asked again: the same answer
  fan._seen["c"] = ("c:1", fan._seen["c"][1] - 60)  # c went silent
  assert fan.parent("d", "d:1", 5) == ""  # no live relay with room: the hosts


def shard_learner():
  """Process 0's weight side as launch.learner sets it up: the learner's gRPC service (the
  stand-in `PublishedWeights`) with a bf16 ShardHost. Returns (service, server, port)."""
  from tests.sglang_standin import PublishedWeights
  service = PublishedWeights()
  service.shards = shards.ShardHost("bfloat16")
  return (service, *srv.serve(service))


def publish_shards(service, v, params, cfg, whole=None):
  """Publishes `params` as version v: their shards (one host) and the whole weights
  (`whole`, default the params themselves). Returns the manifest."""
  arrays = sharded(params)
  m = hf_shards.manifest_of(arrays, cfg, "bfloat16")
  service.shards.put(v, m, hf_shards.local_pieces(arrays, cfg, m, 0))
  service.publish(v, params if whole is None else whole)
  return m


def test_a_relay_follows_a_learner_that_serves_shards(tmp_path, model):
  """`Relay.run` against the learner's gRPC service with a ShardHost (process 0's setup in
  launch.learner): each version lands whole in its directory, bit-equal to the bf16 export;
  the second comes as deltas; a relay configured for another model stops with RelayError."""
  from fr_jax.transport import relay as relaylib
  cfg, params = model
  service, server, port = shard_learner()
  loads = []

  def publish(v, p):
    publish_shards(service, v, p, cfg)

  client = WeightsClient(f"127.0.0.1:{port}", worker_id="relay@test")
  r = relaylib.Relay(client, lambda path, v: loads.append((path, v)), tmp_path / "relay", cfg,
                     poll_s=0.05, say=lambda _: None)
  stop = threading.Event()
  try:
    publish(1, params)
    t = threading.Thread(target=lambda: r.run(stop, max_versions=2))
    t.start()
    while not loads:
      t.join(0.05)
    params2 = perturbed(params, 2)
    publish(2, params2)
    t.join(60)
    assert [v for _, v in loads] == [1, 2] and r.use_shards is None  # shards, not whole
    for (path, _), p, name in zip(loads, (params, params2), ("ref1", "ref2")):
      assert_bit_equal(read_file(f"{path}/model.safetensors"),
                       reference(tmp_path, p, cfg, name))
      assert hf_io.load_hf(path)[0].param_dtype == "bfloat16"  # config.json says so
    first, second = r.history
    assert first.wire_bytes == first.bytes and second.wire_bytes < 0.5 * second.bytes
    assert r.failures == {}

    other = relaylib.Relay(client, lambda *a: None, tmp_path / "other",
                           registry.TINY_CONFIGS["tiny-llama"], say=lambda _: None)
    with pytest.raises(relaylib.RelayError, match="give --config"):
      other.deliver(0, threading.Event())
  finally:
    stop.set()
    client.close()
    srv.stop(server, grace=0)


def test_a_torn_or_mixed_fetch_never_reaches_the_server(tmp_path, model):
  """A relay whose sources send a damaged piece or a piece of another version: nothing is
  loaded and no version directory appears (only the learner's undamaged answer, later,
  is delivered)."""
  from fr_jax.transport import relay as relaylib
  from tests.sglang_standin import PublishedWeights
  cfg, params = model
  service = PublishedWeights()
  service.shards = shards.ShardHost("bfloat16")
  arrays = sharded(params)
  m = hf_shards.manifest_of(arrays, cfg, "bfloat16")
  service.shards.put(1, m, hf_shards.local_pieces(arrays, cfg, m, 0))
  service.publish(1, params)
  server, port = srv.serve(service)
  loads = []
  client = WeightsClient(f"127.0.0.1:{port}", worker_id="relay@test")
  r = relaylib.Relay(client, lambda path, v: loads.append(v), tmp_path / "relay", cfg,
                     say=lambda _: None)
  real = r._open_stream
  try:
    for damage in ("flip", "version"):
      def bad(address, version, pieces, base, damage=damage):
        for k, c in enumerate(real(address, version, pieces, base)):
          if k == len(pieces) // 2:
            c = pb.WeightsChunk.FromString(c.SerializeToString())
            if damage == "flip":
              c.data = c.data[:-1] + bytes([c.data[-1] ^ 0x10])
            else:
              c.version = 2
          yield c
      r._open_stream = bad
      assert r.deliver(1, threading.Event()) is None
      assert loads == [] and relaylib.versions_on_disk(tmp_path / "relay") == []
      assert not list((tmp_path / "relay").iterdir())  # no partial directory left either
    assert r.failures["incomplete"] == 2
    assert r.failures["checksum_mismatch"] >= 1 and r.failures["mixed_versions"] >= 1
    r._open_stream = real
    assert r.deliver(1, threading.Event()).version == 1 and loads == [1]
  finally:
    client.close()
    srv.stop(server, grace=0)


def test_a_full_disk_is_a_named_failure_not_a_dead_thread(tmp_path, model, monkeypatch):
  """A write that fails mid-fetch (ENOSPC) is counted as `write_failed`; nothing is marked
  done and no thread dies with the error."""
  cfg, params = model
  hosts = Hosts(cfg)
  client = WeightsClient("127.0.0.1:1")
  try:
    hosts.publish(1, params)
    vf = shard_fetch.VersionFile(tmp_path / "full.safetensors", hosts.manifest, 1)

    def full(*a):
      raise OSError(28, "No space left on device")

    monkeypatch.setattr(shards.os, "pwrite", full)
    with pytest.raises(codec.WeightsError, match="incomplete") as e:
      shard_fetch.fetch(vf, [shard_fetch.Source("hosts", hosts=tuple(hosts.addresses))],
                   open_stream(client))
    assert e.value.failures == {"write_failed": 2}  # one per host stream
    assert len(vf.missing()) == len(hosts.manifest.pieces)
  finally:
    client.close()
    hosts.close()


def lora_model(cfg, params, seed):
  """`cfg` with rank-4 adapters on three attention projections, and params whose adapters
  are random (B too: a trained adapter, not the B = 0 start)."""
  cfg = cfg.replace(lora_rank=4, lora_alpha=8.0, lora_targets=("wq", "wv", "wo"))
  p = jax.tree.map(np.asarray, lora.init_adapters(params, cfg, jax.random.key(seed)))
  rng = np.random.default_rng(seed)
  p["layers"] = {k: (0.2 * rng.standard_normal(a.shape)).astype(a.dtype)
                 if k.endswith("_lora_b") else a for k, a in p["layers"].items()}
  return cfg, p


def test_a_lora_version_moves_only_its_adapters_and_the_server_gets_the_merged_model(
    tmp_path, model):
  """A LoRA learner publishes its base and adapters unmerged (PEFT names): the relay's second
  version comes as the adapters' bytes (the base's pieces are all-zero deltas), and the file
  its server loads is the merged model (`lora.merged`, the learner's own fold, in bf16) with
  no adapter tensors; the fetched file stays under a name no server loads."""
  from fr_jax.transport import relay as relaylib
  base_cfg, base = model
  cfg, params = lora_model(base_cfg, base, 0)
  _, other = lora_model(base_cfg, base, 1)  # version 2: the same base, new adapters
  params2 = {**params, "layers": {k: other["layers"][k] if lora.is_adapter(k) else a
                                  for k, a in params["layers"].items()}}
  service, server, port = shard_learner()
  loads = []

  def publish(v, p):
    return publish_shards(service, v, p, cfg, whole=lora.merged(p, cfg))

  client = WeightsClient(f"127.0.0.1:{port}", worker_id="relay@test")
  r = relaylib.Relay(client, lambda path, v: loads.append((path, v)), tmp_path / "relay",
                     base_cfg, poll_s=0.05, say=lambda _: None)
  stop = threading.Event()
  try:
    m = publish(1, params)
    assert m.lora_scale == 2.0 and len(m.adapters) == 2 * 3 * cfg.num_layers
    assert hf_shards.Manifest.from_json(m.to_json()) == m
    adapter_bytes = sum(np.prod(m.tensors[n]) for n in m.adapters) * 2
    t = threading.Thread(target=lambda: r.run(stop, max_versions=2))
    t.start()
    while not loads:
      t.join(0.05)
    publish(2, params2)
    t.join(60)
    assert [v for _, v in loads] == [1, 2] and r.failures == {}
    for (path, _), p, name in zip(loads, (params, params2), ("ref1", "ref2")):
      # The learner's fold (lora.merged, in JAX) of what crossed the wire: every tensor,
      # adapters included, in bf16.
      wire = jax.tree.map(lambda a: a.astype(BF16).astype(np.float32), p)
      want = reference(tmp_path, lora.merged(wire, cfg), base_cfg, name)
      got = read_file(f"{path}/model.safetensors")
      assert sorted(got) == sorted(want)  # the plain model's tensors: no adapters
      same = 0
      for k in want:  # within one bf16 step (float32 sums in another order), mostly equal
        g, w = got[k].astype(np.float32), want[k].astype(np.float32)
        assert np.all(np.abs(g - w) <= 2.0 ** -7 * np.abs(w) + 1e-6), k
        same += int((g == w).sum())
      assert same >= 0.99 * sum(a.size for a in want.values())
      adapted = "model.layers.0.self_attn.q_proj.weight"
      plain = reference(tmp_path, lora.split(p)[1], base_cfg, name + "_base")
      assert not np.array_equal(got[adapted], plain[adapted])  # the adapters were folded in
      files = sorted(f.name for f in Path(path).iterdir())
      assert [f for f in files if f.endswith(".safetensors")] == ["model.safetensors"]
      assert hf_shards.ADAPTED_FILE in files
    first, second = r.history
    assert first.wire_bytes == first.bytes == m.nbytes
    assert adapter_bytes <= second.wire_bytes <= adapter_bytes + 0.01 * m.nbytes, (
        second.wire_bytes, adapter_bytes, m.nbytes)
  finally:
    stop.set()
    client.close()
    srv.stop(server, grace=0)


def test_a_relay_for_an_engine_that_loads_adapters_writes_peft_directories(tmp_path, model):
  """With `adapters` (vLLM's `loads_adapters`), a LoRA version reaches the server as a PEFT
  adapter directory and nothing else to load: its tensors are `hf_io.save_peft`'s of what
  crossed the wire (bf16), bit for bit, and its config says the same rank, alpha and
  modules."""
  from fr_jax.transport import relay as relaylib
  base_cfg, base = model
  cfg, params = lora_model(base_cfg, base, 0)
  service, server, port = shard_learner()
  loads = []
  client = WeightsClient(f"127.0.0.1:{port}", worker_id="relay@test")
  r = relaylib.Relay(client, lambda path, v: loads.append((path, v)), tmp_path / "relay",
                     base_cfg, poll_s=0.05, say=lambda _: None, adapters=True)
  try:
    publish_shards(service, 1, params, cfg, whole=lora.merged(params, cfg))
    r.run(threading.Event(), max_versions=1)
    (path, v), = loads
    wire = jax.tree.map(lambda a: a.astype(BF16).astype(np.float32), params)
    want_dir = hf_io.save_peft(tmp_path / "peft", wire, cfg)
    got, want = read_file(Path(path) / hf_io.PEFT_WEIGHTS), read_file(want_dir /
                                                                       hf_io.PEFT_WEIGHTS)
    assert v == 1 and sorted(got) == sorted(want) and len(got) == 2 * 3 * cfg.num_layers
    for k in want:
      np.testing.assert_array_equal(got[k].astype(np.float32), want[k], err_msg=k)
    config = lambda d: json.loads((Path(d) / hf_io.PEFT_CONFIG).read_text())  # noqa: E731
    assert config(path) == config(want_dir)
    assert not any(f.name == "model.safetensors" for f in Path(path).iterdir())
  finally:
    client.close()
    srv.stop(server, grace=0)


def test_a_manifest_refuses_adapters_that_do_not_fit_their_weights(model):
  cfg, params = lora_model(*model, 0)
  m = hf_shards.manifest_of(params, cfg, "bfloat16")
  a = hf_io.adapter_name("model.layers.1.self_attn.v_proj.weight", "a")
  bad = dict(m.tensors, **{a: (4, m.tensors[a][1] + 1)})
  pieces = tuple(p if p.tensor != a else hf_shards.Piece(a, (0, 0), bad[a], 0)
                 for p in m.pieces)
  with pytest.raises(hf_shards.ManifestError, match="does not fit a weight"):
    hf_shards.Manifest(m.dtype, bad, pieces, m.lora_scale).check()
  with pytest.raises(hf_shards.ManifestError, match="not positive"):
    hf_shards.Manifest(m.dtype, m.tensors, m.pieces, 0.0).check()
