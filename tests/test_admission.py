"""The learner's durable admission state (fr_jax/learner/admission.py) and the transport's
admission rules: log frames, torn-frame recovery, a real ENOSPC (/dev/full), compaction,
per-producer watermarks and their eviction floor, dead letters, replay of records newer than
the restored checkpoint, mutual TLS, and the stream limit."""

import errno
import json
import os
import struct
import threading
import zlib

import pytest

from fr_jax import system
from fr_jax.learner.admission import AdmissionLog, DeadLetters, Producers
from fr_jax.learner.synthetic import synthetic_trajectory
from fr_jax.transport import codec
from fr_jax.transport import server as srv
from fr_jax.transport.client import GrpcClient
from tests import tls_certs
from tests.helpers import cfg, synth, wait_for

STATS = dict(engine_version=0, trajectories=0, tokens=0, uptime_s=0.0, inflight=0)


def frame(raw: bytes) -> bytes:  # the format, written out by hand
  return struct.pack("<II", len(raw), zlib.crc32(raw)) + raw


# --- the log ---
def test_log_frames_are_length_crc_payload(tmp_path):
  log = AdmissionLog(tmp_path / "a.log")
  for i, raw in enumerate([b"alpha", b"b" * 300, b"\x00\x01"]):
    log.append(f"p/{i}", raw)
  log.close()
  data = (tmp_path / "a.log").read_bytes()
  assert data == frame(b"alpha") + frame(b"b" * 300) + frame(b"\x00\x01")
  assert AdmissionLog.read(tmp_path / "a.log") == ([b"alpha", b"b" * 300, b"\x00\x01"], 0,
                                                   len(data))


def test_read_skips_bad_frames_and_finds_the_next_one(tmp_path):
  p = tmp_path / "a.log"
  bad_crc = bytearray(frame(b"broken"))
  bad_crc[-1] ^= 0xFF
  # a whole frame with a wrong byte, garbage where a header should be, a good frame, and a
  # last frame cut short
  p.write_bytes(frame(b"one") + bytes(bad_crc) + b"\xff" * 7 + frame(b"two") +
                frame(b"three")[:-2])
  raws, torn, end = AdmissionLog.read(p)
  assert raws == [b"one", b"two"] and torn == 3
  assert end == len(frame(b"one")) + len(bad_crc) + 7 + len(frame(b"two"))
  zeros = tmp_path / "z.log"  # zeroed blocks (a crash before the data reached the disk)
  zeros.write_bytes(frame(b"one") + bytes(4096))
  assert AdmissionLog.read(zeros)[:2] == ([b"one"], 1)


def test_append_on_a_full_disk_leaves_whole_frames(tmp_path):
  p = tmp_path / "a.log"
  log = AdmissionLog(p)
  log.append("p/0", b"kept")
  full = os.open("/dev/full", os.O_WRONLY)
  os.dup2(full, log._fd)  # the kernel answers the next write with ENOSPC
  os.close(full)
  with pytest.raises(OSError) as e:
    log.append("p/1", b"refused")
  assert e.value.errno == errno.ENOSPC and log.write_failures == 1
  assert p.read_bytes() == frame(b"kept")  # nothing of the refused record
  log.append("p/1", b"later")  # room again: the same record goes in whole
  log.close()
  assert AdmissionLog.read(p)[:2] == ([b"kept", b"later"], 0)


def test_compaction_drops_only_records_settled_at_committed_versions(tmp_path):
  p = tmp_path / "a.log"
  log = AdmissionLog(p)
  for i in range(5):
    log.append(f"p/{i}", f"r{i}".encode())
  log.settle(["p/0", "p/1"], 3)  # used by update 3
  log.settle(["p/2"], 5)  # used by update 5, not yet committed
  log.settle(["p/3"], -1)  # dead-lettered
  assert log.compact(committed=4)
  assert AdmissionLog.read(p)[0] == [b"r2", b"r4"]
  assert not log.compact(committed=4)  # nothing more to drop: no rewrite
  assert log.compact(committed=5)
  log.append("p/5", b"r5")  # appends continue on the rewritten file
  log.close()
  assert AdmissionLog.read(p)[0] == [b"r4", b"r5"]


# --- producer watermarks ---
def test_producer_watermarks_eviction_and_floor():
  prod = Producers(max_producers=2)
  prod.admit("a", 0, version=0, safe_version=0)
  prod.admit("a", 1, version=1, safe_version=0)
  assert prod.is_duplicate("a", 0) and prod.is_duplicate("a", 1)
  assert not prod.is_duplicate("a", 2) and not prod.is_duplicate("b", 0)
  prod.admit("b", 0, version=2, safe_version=0)
  prod.settle("a", 0)
  prod.settle("a", 1)
  # A third producer over the limit: "a" is the least recent, idle and older than the
  # published version 3, so it goes, and the floor becomes the newest version it was heard at.
  prod.admit("c", 0, version=3, safe_version=3)
  assert len(prod) == 2 and prod.floor == 1 and prod.evicted == 1
  assert prod.is_expired("a", 1) and not prod.is_expired("a", 2)  # a record newer than 1
  assert not prod.is_expired("b", 0)  # known producers are judged by their watermark
  # "b" still owes its record 0: it is never evicted while something is unsettled.
  prod.admit("d", 0, version=4, safe_version=5)
  assert "b" in prod.state()["producers"] and len(prod) == 3


def test_silent_producers_are_forgotten_after_their_ttl():
  prod = Producers(ttl_versions=10)
  prod.admit("old", 0, version=0, safe_version=0)
  prod.admit("busy", 0, version=0, safe_version=0)  # owes its record 0
  prod.settle("old", 0)
  prod.admit("new", 0, version=10, safe_version=10)  # 10 versions idle: not yet
  assert len(prod) == 3
  prod.admit("new", 1, version=11, safe_version=11)
  assert sorted(prod.state()["producers"]) == ["busy", "new"] and prod.floor == 0
  assert prod.is_expired("old", 0) and not prod.is_expired("old", 1)


def test_replayable_against_a_checkpointed_table():
  prod = Producers()
  for s in range(4):
    prod.admit("w", s, version=0, safe_version=0)
  prod.settle("w", 0)
  prod.settle("w", 2)  # settled out of order (record 1 was given back after a quarantine)
  saved = json.loads(json.dumps(prod.state()))  # as a checkpoint stores it
  back = Producers()
  back.load(saved)
  assert [back.replayable("w", s, 0) for s in range(6)] == [False, True, False, True, True,
                                                             True]
  assert back.replayable("new", 0, 0)  # a producer first heard after the checkpoint


def test_dead_letters_survive_a_line_cut_short(tmp_path):
  p = tmp_path / "dead.jsonl"
  t = synthetic_trajectory(0)
  t.traj_id = "w/0"
  dl = DeadLetters(str(p))
  dl.add([DeadLetters.row(t, "stale", 3)])
  with open(p, "a") as f:
    f.write('{"traj_id": "w/1", "rea')  # a crash mid-line
  dl = DeadLetters(str(p))
  t.traj_id = "w/2"
  dl.add([DeadLetters.row(t, "nonfinite_update", 4, raw=b"x")])
  assert [(r["traj_id"], r["reason"]) for r in dl.rows()] == [("w/0", "stale"),
                                                              ("w/2", "nonfinite_update")]
  assert dl.ids() == {"w/0", "w/2"} and dl.counts == {"stale": 1, "nonfinite_update": 1}


# --- the service around a tiny learner ---
def test_restart_dead_letters_records_newer_than_the_restored_weights(tmp_path, tiny_model):
  c = cfg(tmp_path, batch_size=1, **{"checkpoint.every": 2})
  learner, service = system.build_service(c, tiny_model, admission_log=True)
  for i in range(3):
    t = synth(i, version=i)
    assert service.offer(t, raw=codec.encode_record(t)) == (True, "")
    service.step(service.next_batch(threading.Event()))  # versions 1, 2 (saved), 3
  newer = synth(3, version=3)  # sampled by version 3, which no checkpoint holds
  assert service.offer(newer, raw=codec.encode_record(newer)) == (True, "")
  service.close()
  learner.close()  # a crash here: update 3 is not in a checkpoint
  learner, service = system.build_service(c, tiny_model, admission_log=True)
  try:
    assert service.version == 2
    assert [service.queue.pop(0).traj_id, service.queue.pop(0)] == ["w/n/2", None]
    rows = DeadLetters(str(tmp_path / "dead_letter.jsonl")).rows()
    assert [(r["traj_id"], r["reason"]) for r in rows] == [("w/n/3", "future_version")]
  finally:
    service.close()
    learner.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
  return tls_certs.make(tmp_path_factory.mktemp("tls"))


def test_mutual_tls_admits_only_certified_clients(tiny_model, certs):
  learner, service = system.build_service(cfg(), tiny_model)
  server, port = srv.serve(service, "0.0.0.0:0", tls_cert=certs["server_cert"],
                           tls_key=certs["server_key"], tls_client_ca=certs["ca"])
  addr = f"127.0.0.1:{port}"
  clients = {
      "certified": GrpcClient(addr, tls_ca=certs["ca"], tls_cert=certs["client_cert"],
                              tls_key=certs["client_key"]),
      "no certificate": GrpcClient(addr, tls_ca=certs["ca"]),
      "foreign CA": GrpcClient(addr, tls_ca=certs["ca"], tls_cert=certs["rogue_cert"],
                               tls_key=certs["rogue_key"]),
  }
  try:
    got = {k: c.heartbeat(dict(STATS)) is not None for k, c in clients.items()}
    assert got == {"certified": True, "no certificate": False, "foreign CA": False}
  finally:
    for c in clients.values():
      c.close()
    srv.stop(server, grace=0)
    service.close()
    learner.close()


def test_credential_errors_name_the_flag(certs):
  with pytest.raises(srv.BindError, match="--tls_cert /no/cert.pem"):
    srv.check_credentials("127.0.0.1:0", tls_cert="/no/cert.pem", tls_key=certs["server_key"])
  with pytest.raises(srv.BindError, match="go together"):
    srv.check_credentials("127.0.0.1:0", tls_cert=certs["server_cert"])
  with pytest.raises(srv.BindError, match="needs --tls_cert"):
    srv.check_credentials("127.0.0.1:0", tls_client_ca=certs["ca"])
  assert srv.check_credentials("0.0.0.0:1", token="t") is None  # token: plaintext allowed


def test_streams_beyond_the_limit_wait_their_turn(tiny_model):
  learner, service = system.build_service(cfg(**{"service.queue_capacity": 64}), tiny_model)
  server, port = srv.serve(service, "127.0.0.1:0", max_streams=2)
  addr = f"127.0.0.1:{port}"
  a, b = (GrpcClient(addr, worker_id=w) for w in ("a", "b"))
  try:
    wait_for(lambda: srv.open_streams(server) == 2, 120, "a and b holding the two streams")
    c = GrpcClient(addr, worker_id="c", backoff_min=0.1, backoff_max=0.2)
    c.push(synth(0, producer="c/n"))
    assert not c.flush(2.0) and c.reconnects >= 1  # refused, retrying
    assert c.heartbeat(dict(STATS)) is not None  # unary calls still answer
    a.close()  # a stream frees up
    assert c.flush(20) and c.acks["admitted"] == 1
    c.close()
  finally:
    b.close()
    srv.stop(server, grace=0)
    service.close()
    learner.close()


def test_log_unavailable_ends_the_stream_and_the_client_resends(tmp_path, tiny_model,
                                                               monkeypatch):
  learner, service = system.build_service(cfg(tmp_path), tiny_model, admission_log=True)
  server, port = srv.serve(service, "127.0.0.1:0")
  client = GrpcClient(f"127.0.0.1:{port}", worker_id="w", backoff_min=0.05)
  real, failures = service.log.append, []

  def flaky(traj_id, raw):  # the disk is full for the first two attempts
    if len(failures) < 2:
      failures.append(traj_id)
      raise OSError(errno.ENOSPC, "No space left on device")
    return real(traj_id, raw)

  monkeypatch.setattr(service.log, "append", flaky)
  try:
    for i in range(3):
      client.push(synth(i))
    assert client.flush(30)
    assert failures == ["w/n/0", "w/n/0"]  # refused twice, then admitted: nothing skipped
    assert client.acks == {"admitted": 3} and client.reconnects >= 2
    assert [service.queue.pop(0).traj_id for _ in range(3)] == ["w/n/0", "w/n/1", "w/n/2"]
  finally:
    client.close()
    srv.stop(server, grace=0)
    service.close()
    learner.close()
