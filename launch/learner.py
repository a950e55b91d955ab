r"""The learner as its own process: serves gRPC to rollout workers (`launch/worker.py`).

  python -m launch.learner --config=experiments/configs/tiny_test.py --run_dir=/tmp/run \
      --port_file=/tmp/run/port
  # across hosts: bind beyond loopback with a shared token, or mutual TLS
  export FR_JAX_TOKEN=...  # the shared token (a flag would put it on the command line)
  python -m launch.learner --config=... --address=0.0.0.0:50051
  python -m launch.learner --config=... --address=0.0.0.0:50051 --tls_cert=server.pem \
      --tls_key=server.key --tls_client_ca=ca.pem
  # a multi-host learner mesh: one process per host, the same command on each
  python -m launch.learner --config=... --coordinator_address=host0:1234 \
      --num_processes=4 --process_id=$I --address=0.0.0.0:50051
  # on Slurm or TPU VMs JAX finds the coordinator, process count and id itself
  python -m launch.learner --config=... --distributed --address=0.0.0.0:50051 ...

It resumes from the last checkpoint in run_dir, updates until config.max_updates, then tells
workers to stop and prints one JSON line with the run summary (updates,
trajectories_admitted, rejected_by_reason, max_lag, learner_idle_fraction, ...). SIGTERM or
Ctrl-C saves a checkpoint and stops cleanly.

With several processes (`--distributed` or `--coordinator_address`), every process builds the
learner on one global mesh; process 0 serves gRPC, admits records, writes metrics and drives
the run, and the others make each learner call it announces (`fr_jax/learner/multihost.py`,
docs/system.md). Workers connect to process 0 only; weight relays ask process 0 for each
version's manifest and fetch its pieces from every process, each serving its own shards
(--shard_address, fr_jax/transport/shards.py). Every process needs
the same secret, `$FR_JAX_TOKEN` (or `--auth_token`, or `$FR_JAX_LEARNER_SECRET`): process 0
signs each call with it, because the coordinator's port takes writes from anyone. The run directory
(checkpoints) must be one that every process can write: each writes its own shards.
"""

import os
import signal
import threading
import time

from absl import flags

from launch import common

flags.DEFINE_string("address", None, "gRPC bind address (default: config.service.address, "
                    "loopback); non-loopback needs --auth_token or mutual TLS")
flags.DEFINE_string("auth_token", "", "shared token (default: $FR_JAX_TOKEN)")
flags.DEFINE_string("tls_cert", "", "PEM certificate for TLS")
flags.DEFINE_string("tls_key", "", "PEM private key for TLS")
flags.DEFINE_string("tls_client_ca", "", "PEM CA: require client certificates it signed "
                    "(mutual TLS)")
flags.DEFINE_string("port_file", "", "write the bound port here once serving")
flags.DEFINE_float("linger_s", 3.0, "after the last update, keep serving this long so "
                   "workers hear the shutdown")
flags.DEFINE_bool("distributed", False, "join a multi-process learner (jax.distributed); "
                  "without --coordinator_address JAX detects it (Slurm, TPU VMs, ...)")
flags.DEFINE_string("coordinator_address", "", "jax.distributed coordinator host:port "
                    "(implies --distributed)")
flags.DEFINE_string("coordinator_bind_address", "", "where process 0's coordinator listens "
                    "(default: the coordinator address itself, not every interface)")
flags.DEFINE_integer("num_processes", 0, "jax.distributed: processes in the learner "
                     "(0: detected)")
flags.DEFINE_integer("process_id", -1, "jax.distributed: this process's index (-1: detected)")
flags.DEFINE_string("shard_address", "", "a learner process other than 0: where it serves its "
                    "weight shards to relays (default: --address, on this process's host: "
                    "the port the cluster templates open on every learner host); the same "
                    "credentials as --address")
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    common.fail(f"unexpected arguments {argv[1:]}")
  c = common.load_config()
  token = common.secret(FLAGS.auth_token, "FR_JAX_TOKEN")
  if FLAGS.distributed or FLAGS.coordinator_address:
    from fr_jax.learner import multihost
    try:  # the calls process 0 announces are signed with the run's secret
      multihost.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                           secret=os.environ.get(multihost.SECRET_ENV[0]) or token,
                           bind_address=FLAGS.coordinator_bind_address)
    except multihost.NoSecret as e:
      common.fail(str(e))
    import jax
    if jax.process_index() != 0:
      return follow(c)
  from fr_jax.transport import server as srv
  address = FLAGS.address or c.service.address
  tls = dict(tls_cert=FLAGS.tls_cert, tls_key=FLAGS.tls_key, tls_client_ca=FLAGS.tls_client_ca)
  try:  # every flag problem now, before the model loads
    srv.check_credentials(address, token=token, **tls)
  except srv.BindError as e:
    common.fail(str(e))
  from fr_jax import system
  model = common.load_model(c)
  shards = shard_host(c)
  learner, service = system.build_service(c, model, admission_log=True, shards=shards)
  server, port = srv.serve(service, address, token=token,
                           max_streams=c.service.max_streams, **tls)
  if shards is not None and learner.group is not None:  # where the others serve theirs
    shards.hosts = [""] + [learner.group.get_signed(f"shards/{i}").decode()
                           for i in range(1, learner.group.num_processes)]
    print(f"weight shards served by {learner.group.num_processes} processes: "
          f"{shards.hosts[1:]} and this one", flush=True)
  if FLAGS.port_file:
    from fr_jax import durable
    durable.write_file(FLAGS.port_file, str(port))
  print(f"learner serving on {address.rsplit(':', 1)[0]}:{port} at version "
        f"{service.version}", flush=True)
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  try:
    summary = service.run(c.max_updates, stop)
  finally:
    service.shutdown.set()
    time.sleep(FLAGS.linger_s if not stop.is_set() else 0.0)
    service.close()
    srv.stop(server, grace=1.0)
    learner.close()
  common.print_json(summary)


def shard_host(c):
  """This process's weight shard host (None with service.shards=False)."""
  if not c.service.shards:
    return None
  from fr_jax.transport.shards import ShardHost
  return ShardHost(c.service.wire_dtype, root=c.service.fanout, fanout=c.service.fanout)


def follow(c):
  """A process other than 0: the same learner, making the calls process 0 announces, and
  serving its own weight shards."""
  import jax

  from fr_jax.learner import multihost
  from fr_jax.learner.learner import Learner
  from fr_jax.transport import server as srv
  learner = Learner(c, model=common.load_model(c))
  shards = shard_host(c)
  if shards is not None:
    learner.shard_sink = shards
    token = common.secret(FLAGS.auth_token, "FR_JAX_TOKEN")
    bind = FLAGS.shard_address or FLAGS.address or c.service.address
    try:
      _, port = srv.serve_shards(shards, bind, token=token, tls_cert=FLAGS.tls_cert,
                                 tls_key=FLAGS.tls_key, tls_client_ca=FLAGS.tls_client_ca)
    except srv.BindError as e:
      common.fail(str(e))
    learner.group.put_signed(f"shards/{jax.process_index()}",
                             common.reachable_at(bind, port).encode())
  print(f"learner process {jax.process_index()} of {jax.process_count()} following "
        "process 0", flush=True)
  multihost.follow(learner)
  common.print_json({"process": jax.process_index(), "version": learner.version})


if __name__ == "__main__":
  common.run(main)
