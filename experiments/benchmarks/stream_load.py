r"""Many streaming workers against one learner: heartbeat and weight-fetch latency, and the
learner's memory, while every worker holds a trajectory stream.

  python -m experiments.benchmarks.stream_load                 # 256 streams, 60 s
  python -m experiments.benchmarks.stream_load --streams=512 --seconds=120

A real learner process (`launch.learner`, tiny model, updating as records arrive) serves
`--streams` simulated workers: `--procs` client processes, each with streams/procs
`GrpcClient`s that keep a stream open and push a synthetic trajectory every `--interval_s`
(the learner's queue fills, so most streams sit in backpressure, as a big fleet's do). This
process probes the learner meanwhile: a heartbeat every 0.25 s and a full weight fetch every
second, timing each, and samples the learner's RSS. Prints JSON lines: the machine, the
settings, the client processes' counts and the summary (p50/p99/max latency in ms, learner
peak RSS, updates made).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
from absl import app, flags

from experiments.benchmarks.common import emitter, machine

flags.DEFINE_integer("streams", 256, "simulated workers, each holding one stream")
flags.DEFINE_integer("procs", 4, "client processes the streams are spread over")
flags.DEFINE_float("seconds", 60.0, "measured window")
flags.DEFINE_float("interval_s", 2.0, "each worker pushes one trajectory this often")
flags.DEFINE_string("role", "main", "main | clients (internal)")
flags.DEFINE_string("address", "", "clients: the learner")
flags.DEFINE_integer("first", 0, "clients: index of the first stream")
flags.DEFINE_integer("count", 0, "clients: streams in this process")
FLAGS = flags.FLAGS

ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
STATS = dict(engine_version=0, trajectories=0, tokens=0, uptime_s=0.0, inflight=0)


def clients_main():
  """A client process: `count` workers pushing until stdin closes; prints its counts."""
  from fr_jax.learner.synthetic import synthetic_trajectory
  from fr_jax.transport.client import GrpcClient
  stop = threading.Event()
  clients = [GrpcClient(FLAGS.address, worker_id=f"load-{FLAGS.first + k}", outbox_size=2,
                        max_unacked=2, backoff_min=0.5)
             for k in range(FLAGS.count)]

  def work(k, c):
    rng = np.random.default_rng(k)
    i = 0
    time.sleep(rng.uniform(0, FLAGS.interval_s))
    while not stop.is_set():
      t = synthetic_trajectory(i, seed=FLAGS.first + k, vocab_size=300)
      t.traj_id = f"load-{FLAGS.first + k}/n/{i}"
      c.push(t, stop)
      i += 1
      stop.wait(FLAGS.interval_s)

  threads = [threading.Thread(target=work, args=(k, c), daemon=True)
             for k, c in enumerate(clients)]
  for t in threads:
    t.start()
  print("ready", flush=True)
  sys.stdin.read()  # the main process closes stdin to stop us
  stop.set()
  acks = [sum(c.acks.values()) for c in clients]
  print(json.dumps(dict(streams=len(clients), served=sum(a > 0 for a in acks),
                        acks=sum(acks), reconnects=sum(c.reconnects for c in clients))),
        flush=True)
  for c in clients:
    c._closed.set()
  os._exit(0)


def pct(xs, q):
  return round(float(np.percentile(xs, q)) * 1e3, 1) if xs else None


def main(argv):
  del argv
  if FLAGS.role == "clients":
    return clients_main()
  import psutil

  from fr_jax.transport.client import GrpcClient
  emit = emitter("stream_load")
  emit("machine", **machine())
  emit("settings", streams=FLAGS.streams, procs=FLAGS.procs, seconds=FLAGS.seconds,
       interval_s=FLAGS.interval_s)
  run = tempfile.mkdtemp(prefix="fr_jax_streams_")
  pf = os.path.join(run, "port")
  learner = subprocess.Popen(
      [sys.executable, "-m", "launch.learner", "--config=experiments/configs/tiny_test.py",
       f"--run_dir={run}", f"--port_file={pf}", "--config.max_updates=100000000",
       "--config.checkpoint.every=50", "--config.checkpoint.async_save=True",
       f"--config.service.max_streams={max(1024, FLAGS.streams)}", "--linger_s=0"],
      stdout=subprocess.DEVNULL, stderr=open(os.path.join(run, "learner.log"), "w"), env=ENV)
  while not os.path.exists(pf):
    if learner.poll() is not None:
      sys.exit(f"learner failed; see {run}/learner.log")
    time.sleep(0.1)
  addr = f"127.0.0.1:{open(pf).read()}"
  proc = psutil.Process(learner.pid)
  per = -(-FLAGS.streams // FLAGS.procs)
  clients = []
  for p in range(FLAGS.procs):
    n = min(per, FLAGS.streams - p * per)
    clients.append(subprocess.Popen(
        [sys.executable, "-m", "experiments.benchmarks.stream_load", "--role=clients",
         f"--address={addr}", f"--first={p * per}", f"--count={n}",
         f"--interval_s={FLAGS.interval_s}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV))
  for c in clients:
    assert c.stdout.readline().strip() == "ready"
  probe = GrpcClient(addr, worker_id="probe")
  time.sleep(5.0)  # every stream is open and the queue has filled
  hb, gw, rss = [], [], []
  v0 = probe.heartbeat(dict(STATS))["version"]
  t_end = time.monotonic() + FLAGS.seconds
  next_fetch = 0.0
  while time.monotonic() < t_end:
    t0 = time.perf_counter()
    ok = probe.heartbeat(dict(STATS), timeout=10.0)
    hb.append(time.perf_counter() - t0 if ok else float("inf"))
    rss.append(proc.memory_info().rss)
    if time.monotonic() >= next_fetch:
      t0 = time.perf_counter()
      got = probe.get_weights(0, timeout=10.0)
      gw.append(time.perf_counter() - t0 if got else float("inf"))
      next_fetch = time.monotonic() + 1.0
    time.sleep(0.25)
  last = probe.heartbeat(dict(STATS))
  counts = []
  for c in clients:
    out, _ = c.communicate("", timeout=60)
    counts.append(json.loads(out.strip().splitlines()[-1]))
    emit("clients", **counts[-1])
  probe.close()
  learner.terminate()
  learner.wait(timeout=60)
  stats = json.loads(last["stats_json"])
  emit("summary", streams=FLAGS.streams,
       streams_served=sum(c["served"] for c in counts),
       heartbeat_ms=dict(n=len(hb), p50=pct(hb, 50), p99=pct(hb, 99), max=pct(hb, 100)),
       get_weights_ms=dict(n=len(gw), p50=pct(gw, 50), p99=pct(gw, 99), max=pct(gw, 100)),
       learner_rss_peak_mb=round(max(rss) / 2**20, 1),
       learner_rss_first_mb=round(rss[0] / 2**20, 1),
       updates_during=last["version"] - v0, queue_depth=stats["queue_depth"],
       admitted=stats["admitted"], run_dir=run)


if __name__ == "__main__":
  app.run(main)
