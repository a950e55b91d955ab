r"""A rollout worker process: streams trajectories to a learner (`launch/learner.py`).

  python -m launch.worker --config=experiments/configs/tiny_test.py \
      --learner=127.0.0.1:50051 --worker_index=0 --num_workers=2
  # drive an SGLang server or gateway instead of the embedded engine
  python -m launch.worker --config=... --learner=HOST:PORT \
      --config.rollout.engine=sglang --config.rollout.server_url=http://gpu-host:30000

It takes prompt shard `worker_index` of `num_workers`, fetches the learner's current weights,
and runs until the learner says the run is over. While the learner is unreachable (a
restart), it retries with backoff and keeps its finished trajectories. `--ack_ledger=FILE`
appends one line per acknowledged record (`traj_id admitted|reason`), written before the
next ack is read, so an audit survives even SIGKILL (the chaos run uses it).
"""

import os
import signal
import threading
import time

from absl import flags, logging

from launch import common

flags.DEFINE_string("learner", "127.0.0.1:50051", "learner gRPC address host:port")
flags.DEFINE_string("auth_token", "", "shared token (default: $FR_JAX_TOKEN)")
flags.DEFINE_string("tls_ca", "", "PEM CA certificate: connect with TLS")
flags.DEFINE_string("tls_cert", "", "PEM client certificate (mutual TLS)")
flags.DEFINE_string("tls_key", "", "PEM client key (mutual TLS)")
flags.DEFINE_string("ack_ledger", "", "append each acknowledgement to this file")
flags.DEFINE_integer("worker_index", 0, "this worker's prompt shard")
flags.DEFINE_integer("num_workers", 1, "number of prompt shards (workers)")
flags.DEFINE_string("worker_id", "", "name in the learner's stats (default worker-<index>)")
flags.DEFINE_float("connect_timeout_s", 600.0, "give up if the learner never answers")
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    common.fail(f"unexpected arguments {argv[1:]}")
  if not 0 <= FLAGS.worker_index < FLAGS.num_workers:
    common.fail(f"--worker_index={FLAGS.worker_index} must be in [0, --num_workers="
                f"{FLAGS.num_workers})")
  common.check_client_tls(FLAGS)
  c = common.load_config()
  if c.rollout.fixed_lag >= 0:
    common.fail(f"rollout.fixed_lag={c.rollout.fixed_lag} schedules launch.train's in-process "
                "worker; a worker process loads the newest weights (set it to -1)")
  common.require_tool_isolation(c)
  model = common.load_model(c)
  from fr_jax import system
  from fr_jax.transport.client import GrpcClient
  wid = FLAGS.worker_id or f"worker-{FLAGS.worker_index}"
  on_ack = None
  if FLAGS.ack_ledger:
    ledger = os.open(FLAGS.ack_ledger, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def on_ack(traj_id, admitted, reason):
      os.write(ledger, f"{traj_id} {'admitted' if admitted else reason}\n".encode())

  token = common.secret(FLAGS.auth_token, "FR_JAX_TOKEN")
  # a LoRA run's embedded engine fetches the base once, then the adapters only
  lora = bool(c.model.lora.rank) and c.rollout.engine == "embedded"
  client = GrpcClient(FLAGS.learner, worker_id=wid, token=token, tls_ca=FLAGS.tls_ca,
                      tls_cert=FLAGS.tls_cert, tls_key=FLAGS.tls_key, on_ack=on_ack, lora=lora)
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  got, delay, t_end = None, 0.2, time.monotonic() + FLAGS.connect_timeout_s
  while got is None and not stop.is_set():  # the learner's current weights
    got = client.get_weights(0) if c.rollout.engine == "embedded" else (0, None, "")
    if got is None:
      if time.monotonic() > t_end:
        common.fail(f"learner {FLAGS.learner} did not answer within "
                    f"{FLAGS.connect_timeout_s:g}s")
      time.sleep(delay)
      delay = min(delay * 2, 5.0)
  if stop.is_set():
    return
  v, params, _ = got
  w = system.build_worker(c, client, model, index=FLAGS.worker_index,
                          num_shards=FLAGS.num_workers, worker_id=wid, params=params,
                          version=v)
  logging.info("%s: started at version %d", wid, v)
  n = w.run(stop)
  client.flush(timeout=10)
  client.close()
  common.print_json({"worker_id": wid, "trajectories": n, "acks": dict(client.acks),
                     "reconnects": client.reconnects, "tool_isolation": w.loop.tool_isolation})


if __name__ == "__main__":
  common.run(main)
