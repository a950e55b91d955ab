r"""Asynchronous FlashREINFORCE vs synchronous GRPO (G=8, group barrier) at an equal rollout
budget, plus loopback gRPC trajectory throughput.

  python -m experiments.benchmarks.async_pipeline
  python -m experiments.benchmarks.async_pipeline --updates=40 --batch=32 --sigma=1.2

Rollouts are simulated: each takes a heavy-tailed time (lognormal generation plus a Poisson
number of lognormal tool waits) and yields a synthetic trajectory; the learner's steps are
real steps of the tiny model through the real LearnerService (queue, admission, lag
accounting). Both pipelines consume updates * batch rollouts.

* FlashREINFORCE: `slots` rollouts always in flight, one per prompt, each streamed to the
  learner the moment it ends; the learner takes the next B in arrival order.
* Synchronous GRPO: each update launches B/8 prompts x 8 rollouts together (slots >= B, so
  all run at once), waits for the slowest (the group barrier), then updates; nothing is
  generated while the learner works.

Learner utilisation is the fraction of the learner loop's wall time spent updating, counted
after the first (compiling) update. The fleet size `slots` defaults to 1.5x what keeps the
learner fed (B * mean rollout time / measured update time), the way one sizes a deployment.
Prints JSON lines: machine, settings, one line per pipeline, the gRPC figures and a summary.
"""

import itertools
import math
import threading
import time

import numpy as np
from absl import app, flags, logging

from experiments.benchmarks.common import emitter, machine

flags.DEFINE_integer("updates", 20, "updates per pipeline (after one warm-up update)")
flags.DEFINE_integer("batch", 16, "B: trajectories per update (a multiple of 8)")
flags.DEFINE_integer("slots", 0, "rollouts in flight; 0 sizes the fleet to 1.5x demand")
flags.DEFINE_float("median_s", 0.4, "median generation time of one rollout")
flags.DEFINE_float("sigma", 1.0, "lognormal sigma of generation time (heavy tail)")
flags.DEFINE_float("tool_calls", 1.0, "mean tool calls per rollout (Poisson)")
flags.DEFINE_float("tool_median_s", 0.1, "median tool wait")
flags.DEFINE_float("tool_sigma", 1.0, "lognormal sigma of tool waits")
flags.DEFINE_float("grpc_seconds", 5.0, "duration of the gRPC throughput test")
flags.DEFINE_integer("grpc_clients", 4, "concurrent streams in the gRPC test")
F = flags.FLAGS
emit = emitter("async_pipeline")


def latency(rng) -> float:
  t = rng.lognormal(math.log(F.median_s), F.sigma)
  for _ in range(rng.poisson(F.tool_calls)):
    t += rng.lognormal(math.log(F.tool_median_s), F.tool_sigma)
  return float(t)


def mean_latency() -> float:
  m = lambda med, s: med * math.exp(s * s / 2)  # noqa: E731
  return m(F.median_s, F.sigma) + F.tool_calls * m(F.tool_median_s, F.tool_sigma)


def config(loss: str):
  from experiments.configs import tiny_test
  c = tiny_test.get_config()
  c.model.name = "tiny-llama"
  c.batch_size = F.batch
  c.objective.loss = loss
  c.max_policy_lag = -1
  c.service.queue_capacity = 2 * F.batch
  c.checkpoint.every = 10**9
  c.packing.row_buckets = (4,)  # one shape: 4 x 512 holds any batch of 16 (<= 120 tokens)
  return c


def traj(i, version, prompt_id=None):
  from fr_jax.learner.synthetic import synthetic_trajectory
  t = synthetic_trajectory(i, seed=7, vocab_size=256, version=version, median_completion=48,
                           max_len=120)
  t.traj_id = f"r{i}"
  if prompt_id is not None:
    t.prompt_id = prompt_id
  return t


def run_async(model, slots: int) -> dict:
  from fr_jax import system
  from fr_jax.transport.client import LocalClient
  _, service = system.build_service(config("flash_reinforce"), model, resume=False)
  counter = itertools.count()
  service.step([traj(next(counter), 0) for _ in range(F.batch)])  # compile, untimed
  client = LocalClient(service)
  stop = threading.Event()
  made = []

  def slot(k):
    rng = np.random.default_rng(1000 + k)
    while not stop.is_set():
      v = service.version
      time.sleep(latency(rng))
      if stop.is_set():
        return
      client.push(traj(next(counter), v))
      made.append(1)

  service.busy_s = service.idle_s = 0.0
  threads = [threading.Thread(target=slot, args=(k,), daemon=True) for k in range(slots)]
  t0 = time.perf_counter()
  for t in threads:
    t.start()
  s = service.run(1 + F.updates)
  wall = time.perf_counter() - t0
  stop.set()
  service.close()
  service.learner.close()
  busy, idle = service.busy_s, service.idle_s
  return dict(pipeline="flashreinforce_async", updates=F.updates, wall_s=round(wall, 2),
              learner_busy_s=round(busy, 2), learner_idle_s=round(idle, 2),
              startup_wait_s=s["startup_wait_s"],
              learner_utilisation=round(busy / (busy + idle), 4),
              rollouts_finished=len(made), rollouts_used=F.updates * F.batch,
              max_lag=s["max_lag"], lag_histogram=s["lag_histogram"])


def run_sync(model) -> dict:
  from fr_jax import system
  learner, _ = system.build_service(config("grpo"), model, resume=False)
  G = 8
  counter = itertools.count()
  rng = np.random.default_rng(0)

  def batch(u):
    return [traj(next(counter), learner.version, prompt_id=f"p{u}-{j // G}")
            for j in range(F.batch)]

  learner.update(batch(-1))  # compile, untimed
  busy = 0.0
  t0 = time.perf_counter()
  for u in range(F.updates):
    time.sleep(max(latency(rng) for _ in range(F.batch)))  # all at once; barrier on slowest
    b = batch(u)
    t1 = time.perf_counter()
    learner.update(b)
    busy += time.perf_counter() - t1
  wall = time.perf_counter() - t0
  learner.close()
  return dict(pipeline="grpo_sync_G8", updates=F.updates, wall_s=round(wall, 2),
              learner_busy_s=round(busy, 2), learner_utilisation=round(busy / wall, 4),
              rollouts_used=F.updates * F.batch, max_lag=0)


def grpc_throughput(model, completion_tokens: int) -> dict:
  """Loopback gRPC: `grpc_clients` streams push records as fast as they can into a learner
  service whose queue a drain thread empties."""
  from fr_jax import system
  from fr_jax.learner.synthetic import synthetic_trajectory
  from fr_jax.transport import codec
  from fr_jax.transport import server as srv
  from fr_jax.transport.client import GrpcClient
  c = config("flash_reinforce")
  c.service.queue_capacity = 4096
  c.packing.row_len = c.agent.max_total_tokens = 8192
  learner, service = system.build_service(c, model, resume=False)
  server, port = srv.serve(service, "127.0.0.1:0")
  stop = threading.Event()

  def drain():
    while not stop.is_set():
      service.queue.pop(timeout=0.1)

  records = [codec.trajectory_to_proto(synthetic_trajectory(
      i, seed=9, fixed_completion=completion_tokens, max_len=8192)) for i in range(64)]
  size = float(np.mean([r.ByteSize() for r in records]))
  clients = [GrpcClient(f"127.0.0.1:{port}", worker_id=f"c{k}", outbox_size=64,
                        max_unacked=64) for k in range(F.grpc_clients)]

  def push(k):
    for i in itertools.count():
      if stop.is_set():
        return
      r = type(records[0])()
      r.CopyFrom(records[i % len(records)])
      r.traj_id = f"c{k}-{i}"
      clients[k].push(r)

  threads = [threading.Thread(target=drain, daemon=True)] + [
      threading.Thread(target=push, args=(k,), daemon=True) for k in range(F.grpc_clients)]
  for t in threads:
    t.start()
  time.sleep(1.0)  # warm up
  n0, t0 = service.admitted, time.perf_counter()
  time.sleep(F.grpc_seconds)
  n, dt = service.admitted - n0, time.perf_counter() - t0
  stop.set()
  for cl in clients:
    cl.close()
  srv.stop(server)
  service.close()
  learner.close()
  return dict(streams=F.grpc_clients, completion_tokens=completion_tokens,
              record_bytes_mean=round(size), seconds=round(dt, 2),
              trajectories_per_s=round(n / dt, 1), mb_per_s=round(n * size / dt / 2**20, 2))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if F.batch % 8 or F.batch > 16:
    raise app.UsageError(f"--batch={F.batch} must be 8 or 16 (GRPO groups of 8; the packing "
                         "shape holds 16)")
  from fr_jax.models import registry
  emit("machine", **machine())
  model = registry.load("tiny-llama")
  # Size the fleet from a measured update time.
  from fr_jax import system
  learner, _ = system.build_service(config("flash_reinforce"), model, resume=False)
  for r in range(2):  # compile and settle
    learner.update([traj(10**6 + 50 * r + j, learner.version) for j in range(F.batch)])
  t0 = time.perf_counter()
  for r in range(3):
    learner.update([traj(10**6 + 100 * (r + 1) + j, learner.version) for j in range(F.batch)])
  t_update = (time.perf_counter() - t0) / 3
  learner.close()
  slots = F.slots or max(F.batch, math.ceil(1.5 * F.batch * mean_latency() / t_update))
  emit("settings", batch=F.batch, updates=F.updates, slots=slots,
       rollout_mean_s=round(mean_latency(), 3), median_s=F.median_s, sigma=F.sigma,
       tool_calls=F.tool_calls, tool_median_s=F.tool_median_s, tool_sigma=F.tool_sigma,
       update_s=round(t_update, 4), model="tiny-llama")
  a = run_async(model, slots)
  emit("pipeline", slots=slots, **a)
  a_b = run_async(model, F.batch)  # the same fleet as synchronous GRPO uses
  emit("pipeline", slots=F.batch, **a_b)
  s = run_sync(model)
  emit("pipeline", slots=F.batch, **s)
  grpc = {}
  for n in (96, 4000):
    grpc[n] = grpc_throughput(model, n)
    emit("grpc_loopback", **grpc[n])
  emit("summary", async_utilisation=a["learner_utilisation"],
       async_same_fleet_utilisation=a_b["learner_utilisation"],
       sync_utilisation=s["learner_utilisation"], async_wall_s=a["wall_s"],
       async_same_fleet_wall_s=a_b["wall_s"], sync_wall_s=s["wall_s"],
       speedup_wall=round(s["wall_s"] / a["wall_s"], 2),
       speedup_wall_same_fleet=round(s["wall_s"] / a_b["wall_s"], 2),
       grpc_small_trajectories_per_s=grpc[96]["trajectories_per_s"],
       grpc_large_trajectories_per_s=grpc[4000]["trajectories_per_s"],
       grpc_large_mb_per_s=grpc[4000]["mb_per_s"],
       target="async learner utilisation >= 0.90")


if __name__ == "__main__":
  app.run(main)
