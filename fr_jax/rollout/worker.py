"""A rollout worker: prompts from its grain shard, episodes through the agent loop on its
engine, finished trajectories streamed to the learner the moment they end.

It keeps `inflight` episodes going (the learner's adaptive controller may set the number).
Each round, every live episode takes one model turn (batched on the engine with continuous
batching); an episode that ends is pushed at once and its place goes to a new prompt, so a
slow episode never holds back a fast one. Between rounds the worker heartbeats; when the
learner's version has advanced it loads the new weights (arrays for the embedded engine; an
HF directory through `update_weights_from_disk` for an SGLang fleet). Tokens carry the
version that sampled them, so a trajectory that spans an update records both.
While the learner is unreachable, the worker keeps its finished trajectories (bounded by the
client's outbox) and retries with backoff.

An engine that fails (one of `engine_errors`: for SGLang a server that is down or
restarting, a timeout, an HTTP error such as a duplicate request id) does not end the worker.
Its live episodes are given up (nothing of them was sent) and their tasks started again with
fresh sampling seeds (so fresh request ids), each task at most `max_task_attempts` times in
all (a task the server always refuses, say one too long for it, is then skipped and counted
in `tasks_given_up`); the worker waits with backoff (doubling from `backoff_min_s` to
`backoff_max_s`), heartbeating all the while, and counts the failures by reason
(`engine_failures`).

At a fixed lag L (`fixed_lag`, in-process, one worker) the worker does not chase the newest
weights: once it has pushed k batches' worth of trajectories it loads exactly version
k - L (counted from the version it started at), waiting for the learner if it must. Which
samples land in which batch, under which weights, then no longer depends on timing: the run
is the same on a quiet machine and a busy one.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid

from fr_jax.envs.base import prompt_dataset, stable_hash
from fr_jax.rollout.agent import AgentConfig, AgentLoop
from fr_jax.rollout.follower import WeightFollower

log = logging.getLogger("fr_jax.worker")


class Worker:
  def __init__(self, client, engine, tokenizer, env, agent_cfg: AgentConfig, *,
               worker_id: str = "worker-0", shard_index: int = 0, num_shards: int = 1,
               seed: int = 0, inflight: int = 8, weights: str = "arrays",
               heartbeat_every_s: float = 0.0, sample_tag: str | None = None,
               fixed_lag: int = -1, batch_size: int = 0, engine_errors: tuple = (),
               backoff_min_s: float = 0.5, backoff_max_s: float = 30.0,
               max_task_attempts: int = 3):
    if fixed_lag >= 0 and (batch_size < 1 or weights != "arrays"
                           or not hasattr(client, "weights_at")):
      raise ValueError("fixed_lag needs batch_size >= 1, the embedded engine (weights as "
                       "arrays) and an in-process client (versions by number)")
    self.client, self.engine, self.env = client, engine, env
    self.loop = AgentLoop(engine, tokenizer, env, agent_cfg)
    self.worker_id = worker_id
    self.follower = WeightFollower(client, engine, weights, worker_id)
    self.inflight = max(1, inflight)
    self.tasks = iter(prompt_dataset(env, "train", seed=seed, shard_index=shard_index,
                                     num_shards=num_shards))
    self.nonce = uuid.uuid4().hex[:8]  # a restarted worker never reuses trajectory ids
    # Sampling seeds come from (seed, worker_id, sample_tag, episode number). By default the
    # tag is the id nonce, so every start samples afresh; an in-process run passes a tag
    # fixed by its state, so that the same seed draws the same samples run after run.
    self.sample_tag = self.nonce if sample_tag is None else sample_tag
    self.seed = seed
    self.skipped_prompts = 0
    self.engine_errors = tuple(engine_errors)
    self.backoff_min_s, self.backoff_max_s = backoff_min_s, backoff_max_s
    self.engine_failures: collections.Counter = collections.Counter()  # by reason
    self.max_task_attempts = max(1, max_task_attempts)
    self._task_failures: collections.Counter = collections.Counter()  # task_id -> failures
    self.tasks_given_up = 0
    self._k = 0
    self.produced = 0
    self.tokens = 0
    self.t0 = time.perf_counter()
    self.heartbeat_every_s = heartbeat_every_s
    self._last_hb = 0.0
    self.shutdown = False
    self.fixed_lag, self.batch_size = fixed_lag, batch_size
    self.base_version = engine.version
    self.pushed = 0  # trajectories handed to the client (the fixed-lag schedule counts them)

  def _stats(self, live: int) -> dict:
    return dict(engine_version=self.engine.version, trajectories=self.produced,
                tokens=self.tokens, uptime_s=time.perf_counter() - self.t0, inflight=live)

  def sync(self, live: int = 0) -> None:
    """Heartbeat; load newer weights if the learner has them."""
    now = time.perf_counter()
    if now - self._last_hb < self.heartbeat_every_s:
      return
    self._last_hb = now
    hb = self.client.heartbeat(self._stats(live))
    if hb is None:
      return
    self.shutdown = bool(hb["shutdown"])
    if hb.get("inflight_target"):
      self.inflight = int(hb["inflight_target"])
    if self.fixed_lag < 0:  # at a fixed lag the schedule loads weights (`_load_scheduled`)
      self.follower.follow(hb)

  def _new_episode(self, eps, seeds, task=None):
    task = next(self.tasks) if task is None else task
    eps.append(self.loop.start(task))
    self._k += 1
    seeds.append(stable_hash(f"{self.seed}/{self.worker_id}/{self.sample_tag}/{self._k}") % 2**31)

  def _ride_out(self, e: Exception, eps: list, backoff: float, stop: threading.Event):
    """After an engine failure: (the episodes started again, their seeds, the next backoff),
    having waited `backoff` seconds with heartbeats."""
    reason = getattr(getattr(e, "reason", None), "name", type(e).__name__)
    self.engine_failures[reason] += 1
    n = sum(self.engine_failures.values())
    if n in (1, 2, 5) or n % 50 == 0:
      log.warning("%s: engine failed (%s, %d so far): %s; %d episode(s) start again in %.1f s",
                  self.worker_id, reason, n, e, len(eps), backoff)
    fresh, seeds = [], []
    for ep in eps:
      tid = ep.task.task_id
      self._task_failures[tid] += 1
      if self._task_failures[tid] < self.max_task_attempts:
        self._new_episode(fresh, seeds, ep.task)
        continue
      del self._task_failures[tid]
      self.tasks_given_up += 1
      log.warning("%s: task %s failed on the engine %d times; skipped", self.worker_id, tid,
                  self.max_task_attempts)
    t_end = time.monotonic() + backoff
    while not stop.is_set() and time.monotonic() < t_end:
      hb = self.client.heartbeat(self._stats(0))  # the learner still sees this worker
      if hb is not None and hb["shutdown"]:
        self.shutdown = True
        break
      stop.wait(min(1.0, max(t_end - time.monotonic(), 0.0)))
    return fresh, seeds, min(backoff * 2, self.backoff_max_s)

  def run(self, stop: threading.Event | None = None) -> int:
    """Produces trajectories until `stop` or the learner's shutdown; returns how many."""
    stop = stop or threading.Event()
    eps, seeds = [], []
    backoff = self.backoff_min_s
    while not stop.is_set() and not self.shutdown:
      try:
        self.sync(len(eps))
        if self.fixed_lag >= 0 and not self._load_scheduled(stop):
          break
        while len(eps) < self._room():
          self._new_episode(eps, seeds)
        self.loop.step(eps, seeds)
        backoff = self.backoff_min_s
      except self.engine_errors as e:
        self._last_hb = 0.0  # sync again, weights too
        self.follower.engine_failed()
        eps, seeds, backoff = self._ride_out(e, eps, backoff, stop)
        continue
      for e in eps:
        if e.done:
          self._finish(e, stop)
      seeds = [s for e, s in zip(eps, seeds) if not e.done]
      eps = [e for e in eps if not e.done]
    return self.produced

  def _room(self) -> int:
    """How many episodes may be in flight: `inflight`, and at a fixed lag no more than the
    current batch still needs, so that every episode of batch k starts and ends with the
    version the schedule gives batch k (one that takes several turns too)."""
    if self.fixed_lag < 0:
      return self.inflight
    return min(self.inflight, self.batch_size - self.pushed % self.batch_size)

  def _load_scheduled(self, stop: threading.Event) -> bool:
    """At a fixed lag: loads the version the schedule asks for now, waiting until the learner
    publishes it. False when stopped while waiting."""
    target = max(self.base_version,
                 self.base_version + self.pushed // self.batch_size - self.fixed_lag)
    if target == self.engine.version:
      return True
    while True:
      status, params = self.client.weights_at(target)
      if status == "ok":
        break
      if status == "gone":  # the learner is ahead of the schedule (records replayed after a
        got = self.client.get_weights(target)  # restart): the newest, and on from there
        if got is not None:
          log.warning("%s: version %d is no longer kept (the learner is at %d, ahead of the "
                      "schedule); the fixed lag counts on from %d", self.worker_id, target,
                      got[0], got[0])
          target, params = got[0], got[1]
          self.base_version = target - self.pushed // self.batch_size + self.fixed_lag
          break
      hb = self.client.heartbeat(self._stats(0))
      if stop.is_set() or (hb is not None and hb["shutdown"]):
        return False
      time.sleep(0.005)
    self.engine.update_weights(params, target)
    log.info("%s: weights -> version %d (fixed lag %d)", self.worker_id, target, self.fixed_lag)
    return True

  def _finish(self, ep, stop) -> None:
    """Streams a finished episode's trajectory (one that could not generate is skipped)."""
    self._task_failures.pop(ep.task.task_id, None)
    t = self.loop.trajectory(ep, f"{self.worker_id}/{self.nonce}/{self.produced}")
    self.produced += 1
    self.tokens += t.num_action_tokens
    if t.num_action_tokens:
      self.client.push(t, stop)
      self.pushed += 1
      return
    self.skipped_prompts += 1
    if self.skipped_prompts in (1, 100, 10_000):
      log.warning("%s: %d prompts left no room to generate within max_total_tokens",
                  self.worker_id, self.skipped_prompts)
