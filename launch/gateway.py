r"""An OpenAI-compatible endpoint for your own agent: its calls become exact trajectories.

  # train in this process: the learner trains on the episodes your agent finishes
  FR_JAX_GATEWAY_KEY=secret python -m launch.gateway \
      --config=experiments/configs/gateway_smollm2.py --run_dir=runs/gateway
  # or feed a learner elsewhere (launch.learner), as a rollout worker does
  python -m launch.gateway --config=... --learner=HOST:PORT --run_dir=runs/gw-1

Point any OpenAI client at http://127.0.0.1:8000/v1 (`gateway.address`) with the key, send
an `X-Episode-Id` header (or an `episode_id` body field) on every call of one episode, and
post its reward:

  curl -H "Authorization: Bearer $FR_JAX_GATEWAY_KEY" -d '{"reward": 1.0}' \
      http://127.0.0.1:8000/v1/episodes/EPISODE/reward

`experiments/agents/openai_tool_agent.py` is a complete agent. The engine is the embedded
one, an SGLang server or router (`--config.rollout.engine=sglang`) or a vLLM server
(`--config.rollout.engine=vllm`, launch/vllm_server.py). Open episodes and
rewarded records not yet acknowledged by the learner live in run_dir/gateway.db: a gateway
restarted on the same run_dir resumes them. How calls become records (segments, drift) is in
`fr_jax/rollout/gateway.py` and docs/rollout.md.

An API key is required (`--api_key`, or $FR_JAX_GATEWAY_KEY). The endpoint binds to loopback
unless `gateway.address` says otherwise; give `--tls_cert`/`--tls_key` to serve HTTPS. The
in-process learner stops after `max_updates` (the last stdout line is its summary); with
`--learner`, the gateway runs until the learner's run is over or SIGTERM. At the end, calls
in flight are answered 503 `shutting_down` (their turns are not kept: send them again to the
next gateway), rewarded records the learner has not acknowledged stay in the journal, and the
process exits 0.
"""

import os
import signal
import sys
import threading
import time

from absl import flags

from launch import common

flags.DEFINE_string("api_key", "", "the key clients send (default: $FR_JAX_GATEWAY_KEY)")
flags.DEFINE_string("learner", "", "a learner's gRPC address (default: train in this process)")
flags.DEFINE_string("auth_token", "", "the learner's shared token (default: $FR_JAX_TOKEN)")
flags.DEFINE_string("tls_ca", "", "PEM CA certificate: connect to the learner with TLS")
flags.DEFINE_string("tls_cert", "", "PEM certificate: serve HTTPS")
flags.DEFINE_string("tls_key", "", "PEM key of --tls_cert")
flags.DEFINE_string("journal", "", "the journal file (default: run_dir/gateway.db)")
flags.DEFINE_string("worker_id", "gateway", "name in the learner's worker stats")
FLAGS = flags.FLAGS
LINGER_S = 1.0  # at the end, how long calls are still answered 503 shutting_down


def _bind(address: str) -> tuple[str, int]:
  host, sep, port = address.rpartition(":")
  if not sep or not port.isdigit():
    common.fail(f"gateway.address={address!r} must be HOST:PORT")
  return host.strip("[]") or "127.0.0.1", int(port)


def main(argv):
  if len(argv) > 1:
    common.fail(f"unexpected arguments {argv[1:]}")
  c = common.load_config()
  key = common.secret(FLAGS.api_key, "FR_JAX_GATEWAY_KEY")
  if not key:
    common.fail("an API key is required: --api_key or $FR_JAX_GATEWAY_KEY")
  if not c.run_dir and not FLAGS.journal:
    common.fail("--run_dir (or --journal) is required: open episodes and unacknowledged "
                "records are kept there")
  if FLAGS.tls_cert and not FLAGS.tls_key:
    common.fail("--tls_cert needs --tls_key")
  if c.rollout.engine != "embedded" and not FLAGS.learner:
    common.fail(f"rollout.engine={c.rollout.engine} trains through a learner elsewhere: give "
                "--learner")
  host, port = _bind(c.gateway.address)
  model = common.load_model(c)
  from fr_jax import system
  from fr_jax.rollout.gateway import Gateway, GatewayConfig
  from fr_jax.rollout.openai_http import GatewayServer
  if c.run_dir:
    os.makedirs(c.run_dir, exist_ok=True)
  journal = FLAGS.journal or os.path.join(c.run_dir, "gateway.db")
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  service = learner = None
  if FLAGS.learner:
    from fr_jax.transport.client import GrpcClient
    box: list = []
    client = GrpcClient(FLAGS.learner, worker_id=FLAGS.worker_id,
                        token=common.secret(FLAGS.auth_token, "FR_JAX_TOKEN"),
                        tls_ca=FLAGS.tls_ca, on_ack=lambda *a: box[0].acknowledged(*a),
                        lora=bool(c.model.lora.rank) and c.rollout.engine == "embedded")
    got = None
    while got is None and not stop.is_set():  # the learner's current weights
      got = client.get_weights(0) if c.rollout.engine == "embedded" else (0, None, "")
      if got is None:
        time.sleep(1.0)
    if stop.is_set():
      return
    version, params, _ = got
    acks = "callback"
  else:
    from fr_jax.transport.client import LocalClient
    system.require_tokenizer(c, model)
    learner, service = system.build_service(c, model, admission_log=True)
    client = LocalClient(service, FLAGS.worker_id, durable=True)
    version, params = service.weights(0)
    acks = "sync"
  engine = system.build_engine(c, model, params=params, version=version)
  gcfg = GatewayConfig(
      model_name=c.model.name, tool_format=c.gateway.tool_format,
      max_total_tokens=c.agent.max_total_tokens, max_new_tokens=c.agent.max_new_tokens,
      max_open_episodes=c.gateway.max_open_episodes,
      episode_timeout_s=c.gateway.episode_timeout_s, max_segments=c.gateway.max_segments,
      weights=engine.weight_format)
  gateway = Gateway(engine, model.tokenizer, client, gcfg, journal=journal, acks=acks,
                    engine_errors=engine.errors,
                    serial_engine=engine.weight_format == "arrays",
                    max_batch=c.gateway.max_batch or c.rollout.num_slots)
  if FLAGS.learner:
    box.append(gateway)
  server = GatewayServer((host, port), gateway, key, max_body_bytes=c.gateway.max_body_bytes,
                         max_connections=c.gateway.max_connections, tls_cert=FLAGS.tls_cert,
                         tls_key=FLAGS.tls_key)
  server.serve_in_thread()
  scheme = "https" if FLAGS.tls_cert else "http"
  print(f"gateway: serving {c.model.name} at {scheme}://{host}:{server.port}/v1 (tool format: "
        f"{gateway.renderer.fmt or 'none'}; journal {journal}; "
        f"{'learner ' + FLAGS.learner if FLAGS.learner else 'training in this process'})",
        file=sys.stderr, flush=True)
  summary = {}
  try:
    if service is not None:
      from launch.progress import Progress
      with Progress(c.max_updates, initial=service.version) as bar:
        summary = service.run(c.max_updates, stop, on_update=lambda m, s: bar.update(m, s))
    else:
      while not stop.wait(1.0):
        hb = client.heartbeat(gateway.stats())
        if hb is not None and hb["shutdown"]:
          break
  finally:
    # A clean end: calls in flight are aborted and answered 503 shutting_down; for LINGER_S
    # more, new calls get the same answer (agents hear why, rather than a reset connection);
    # then the server stops, and the gateway's threads and the engine's after it.
    gateway.begin_close()
    gateway.drain()
    time.sleep(LINGER_S)
    server.shutdown()
    counters = gateway.metrics()
    gateway.close()
    if service is not None:
      service.close()
      learner.close()
    else:
      client.flush(timeout=10)
      client.close()
  common.print_json({"gateway": counters, **{k: summary[k] for k in
                     ("version", "updates") if k in summary}})


if __name__ == "__main__":
  common.run(main)
