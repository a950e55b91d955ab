r"""A weight relay beside one SGLang or vLLM server: the learner's weights to that server,
without a shared filesystem (design: `fr_jax/transport/relay.py`, docs/rollout.md).

  python -m launch.weight_relay --config=experiments/configs/qwen25_math_1p5b.py \
      --learner=learner-host:50051 \
      --server=http://127.0.0.1:30000 --dir=/local/nvme/weights
  # serving its versions to other relays (the learner names each relay's source)
  python -m launch.weight_relay --config=... --learner=learner-host:50051 \
      --server=http://127.0.0.1:30000 --dir=/dev/shm/weights --serve_address=0.0.0.0:50061
  # beside a vLLM server (launch/vllm_server.py); the key is $VLLM_API_KEY
  python -m launch.weight_relay --config=... --learner=learner-host:50051 --engine=vllm \
      --server=http://127.0.0.1:30000 --dir=/local/nvme/weights
  # workers generate through sglang-router in front of every server
  python -m sglang_router.launch_router --worker-urls http://gpu1:30000 http://gpu2:30000 \
      --host 127.0.0.1 --port 30000

From a learner that serves shards (launch.learner's default) it asks for each new version's
manifest and writes the pieces straight into the version's safetensors file, from a peer
relay the learner names and from every learner process in parallel, in the servers' dtype and
as deltas against the version it holds (fr_jax/transport/shards.py). With --serve_address
it serves what it holds to other relays, so the learner sends each version about twice
whatever the fleet's size. From an older learner it fetches whole weights over gRPC
(`GetWeights`, every tensor checked against its CRC-32, a damaged or cut stream fetched
again). Either way it writes HF safetensors under --dir atomically
(`vNNNNNNNN`, the last --keep kept), and has the server load the path with the version (the
engine's `update_weights`: SGLang's `/update_weights_from_disk`; vLLM's pause, in-place
`reload_weights`, cache reset, `/update_weight_version`, resume); then the version counts as
delivered. One line per version on
stdout (`relay: v12 fetched 270 MB in 3.1 s (87 MB/s), written in 0.9 s, loaded by
http://127.0.0.1:30000 in 0.4 s`). --config names the learner's run config: the relay builds
the model's HF config and tokenizer files from it without loading weights. It stops when the
learner says the run is over, on SIGTERM or Ctrl-C (a fetch in flight is cancelled; a write
or a load in progress finishes, so the server is never left paused), or after
--max_versions (--once: one), and prints one JSON line with what it delivered.
"""

import os
import signal
import threading

from absl import flags, logging

from launch import common

flags.DEFINE_string("learner", "127.0.0.1:50051", "learner gRPC address host:port")
flags.DEFINE_enum("engine", "sglang", ["sglang", "vllm"], "the server's kind (rollout.engine)")
flags.DEFINE_string("server", "http://127.0.0.1:30000", "this relay's server (not a router: "
                    "each server gets its own relay)")
flags.DEFINE_string("dir", "", "local directory for the HF safetensors versions")
flags.DEFINE_string("auth_token", "", "shared token (default: $FR_JAX_TOKEN)")
flags.DEFINE_string("tls_ca", "", "PEM CA certificate: connect with TLS")
flags.DEFINE_string("tls_cert", "", "PEM client certificate (mutual TLS)")
flags.DEFINE_string("tls_key", "", "PEM client key (mutual TLS)")
flags.DEFINE_string("api_key", "", "the server's API key, if it has one (default: "
                    "$SGLANG_API_KEY or $VLLM_API_KEY, by --engine)")
flags.DEFINE_float("poll_s", 1.0, "seconds between polls of the learner")
flags.DEFINE_integer("keep", 2, "versions kept on disk (at least 1: the loaded one)")
flags.DEFINE_integer("max_versions", 0, "exit after delivering this many versions (0: run "
                     "until the learner shuts down)")
flags.DEFINE_bool("once", False, "deliver the learner's current version and exit "
                  "(--max_versions=1)")
flags.DEFINE_float("fetch_timeout_s", 3600.0, "give up one fetch after this long")
flags.DEFINE_string("relay_id", "", "name in the learner's worker stats (default "
                    "relay@<--server>)")
flags.DEFINE_string("serve_address", "", "serve the versions this relay holds to other relays "
                    "here (host:port; port 0 picks one; empty: do not serve); beyond loopback "
                    "it needs the fleet's token or --serve_tls_cert/--serve_tls_key")
flags.DEFINE_string("advertise", "", "the address other relays reach --serve_address at "
                    "(default: its host, or this machine's name for 0.0.0.0, and the bound "
                    "port)")
flags.DEFINE_string("serve_tls_cert", "", "PEM certificate for --serve_address (TLS fleets)")
flags.DEFINE_string("serve_tls_key", "", "PEM key for --serve_address")
flags.DEFINE_integer("streams", 1, "shards: parallel streams from each source (more use more "
                     "of this host's cores)")
flags.DEFINE_enum("fetch", "auto", ["auto", "shards", "whole"], "shards from every learner "
                  "process (auto: if the learner serves them), or whole weights from process 0")
FLAGS = flags.FLAGS


def check_flags():
  """Every flag problem as one line, before anything connects."""
  if not FLAGS.dir:
    common.fail("--dir is required: a local directory for the weights versions")
  try:
    os.makedirs(FLAGS.dir, exist_ok=True)
  except OSError as e:
    common.fail(f"--dir {FLAGS.dir}: cannot create it ({e.strerror or e})")
  if not os.access(FLAGS.dir, os.W_OK | os.X_OK):
    common.fail(f"--dir {FLAGS.dir}: not writable by this user")
  host, _, port = FLAGS.learner.rpartition(":")
  if not host or not port.isdigit():
    common.fail(f"--learner={FLAGS.learner!r}: give host:port, e.g. 127.0.0.1:50051")
  if not FLAGS.server.startswith(("http://", "https://")):
    common.fail(f"--server={FLAGS.server!r}: give the server's URL, e.g. "
                "http://127.0.0.1:30000")
  if FLAGS.poll_s <= 0:
    common.fail(f"--poll_s={FLAGS.poll_s:g}: must be positive")
  if FLAGS.keep < 1:
    common.fail(f"--keep={FLAGS.keep}: keep at least 1 version (the one the server loaded)")
  if FLAGS.max_versions < 0:
    common.fail(f"--max_versions={FLAGS.max_versions}: 0 (no limit) or more")
  if FLAGS.streams < 1:
    common.fail(f"--streams={FLAGS.streams}: at least 1")
  if FLAGS.fetch_timeout_s <= 0:
    common.fail(f"--fetch_timeout_s={FLAGS.fetch_timeout_s:g}: must be positive")
  common.check_client_tls(FLAGS)


def main(argv):
  if len(argv) > 1:
    common.fail(f"unexpected arguments {argv[1:]}")
  check_flags()
  c = common.load_config()
  from fr_jax.models import registry
  from fr_jax.rollout.http_engine import EngineError
  from fr_jax.transport import relay
  from fr_jax.transport.client import WeightsClient
  try:
    cfg, tokenizer_files = relay.model_spec(c.model.name, param_dtype=c.model.param_dtype,
                                            compute_dtype=c.model.compute_dtype)
  except (registry.ModelNotFound, registry.CheckpointError) as e:
    common.fail(f"model {c.model.name!r}: {e}")
  client_token = common.secret(FLAGS.auth_token, "FR_JAX_TOKEN")
  client = WeightsClient(FLAGS.learner, worker_id=FLAGS.relay_id or f"relay@{FLAGS.server}",
                         token=client_token,
                         tls_ca=FLAGS.tls_ca, tls_cert=FLAGS.tls_cert,
                         tls_key=FLAGS.tls_key)
  from fr_jax.system import server_engine
  Engine = server_engine(FLAGS.engine)  # noqa: N806 (a class)
  key = common.secret(FLAGS.api_key, Engine.api_key_env)
  server = Engine(FLAGS.server, api_key=key or None, max_concurrency=1)
  use_shards = {"auto": None, "shards": True, "whole": False}[FLAGS.fetch]
  r = relay.Relay(client, server.update_weights, FLAGS.dir, cfg, tokenizer_files,
                  use_shards=use_shards, streams=FLAGS.streams,
                  server=FLAGS.server, keep=FLAGS.keep, poll_s=FLAGS.poll_s,
                  load_errors=(EngineError,), fetch_timeout_s=FLAGS.fetch_timeout_s,
                  # retried: no answer (a load of the same path and version is idempotent)
                  unreachable=Engine.rides_out,
                  served=server.served_version,
                  say=lambda line: print(line, flush=True), prepare=Engine.prepare_weights,
                  adapters=getattr(Engine, "loads_adapters", False))
  peers = None
  if FLAGS.serve_address:
    from fr_jax.transport import server as srv
    try:
      peers, port = srv.serve_shards(r, FLAGS.serve_address, token=client_token,
                                     tls_cert=FLAGS.serve_tls_cert, tls_key=FLAGS.serve_tls_key)
    except srv.BindError as e:
      common.fail(str(e))
    r.serve_address = FLAGS.advertise or common.reachable_at(FLAGS.serve_address, port)
    print(f"relay: serving its versions to peers at {r.serve_address}", flush=True)
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  out = {}

  def loop():
    try:
      out["stopped"] = r.run(stop, max_versions=1 if FLAGS.once else FLAGS.max_versions)
    except BaseException as e:  # re-raised on the main thread
      out["error"] = e
    finally:
      stop.set()

  t = threading.Thread(target=loop, name="relay")
  t.start()
  stop.wait()
  client.close()  # cancels a fetch in flight; a write or load in progress finishes
  t.join()
  if peers is not None:
    srv.stop(peers, grace=1.0)
  server.close()
  if isinstance(out.get("error"), relay.RelayError):
    common.fail(str(out["error"]))
  if "error" in out:
    raise out["error"]
  logging.info("relay stopped: %s", out["stopped"])
  common.print_json(r.summary(out["stopped"]))


if __name__ == "__main__":
  common.run(main)
