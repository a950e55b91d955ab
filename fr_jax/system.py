"""Assembles a run from its config: the learner and its service, rollout workers, and the
all-in-one-process trainer. The launches (`launch/train.py`, `launch/learner.py`,
`launch/worker.py`) are thin flag wrappers around these functions.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import ml_collections

from fr_jax import config as rcfg
from fr_jax import envs
from fr_jax.learner import config as lcfg
from fr_jax.learner.learner import Learner
from fr_jax.learner.service import InflightController, LearnerService
from fr_jax.models import lora, registry
from fr_jax.rollout.agent import AgentConfig
from fr_jax.rollout.worker import Worker
from fr_jax.transport import codec

log = logging.getLogger("fr_jax.system")


def build_service(c: ml_collections.ConfigDict, model=None, *, resume: bool = True,
                  admission_log: bool = False, shards=None):
  """(learner, service), restored from the latest committed checkpoint in run_dir if there
  is one. With `admission_log` (separate worker processes), admitted records are logged to
  run_dir/admission.log before they are acknowledged, and those the restored checkpoint still
  owes are queued again. Dead letters go to run_dir/dead_letter.jsonl. `shards` (a
  `transport.shards.ShardHost`) receives this process's pieces of every published version
  and answers weight relays (`service.shards`)."""
  c = lcfg.ensure_valid(c, rcfg.validate)
  learner = Learner(c, model=model)
  learner.shard_sink = shards
  s = c.service
  controller = (InflightController(c.rollout.inflight, target_rejection=s.target_rejection,
                                   max_lag=s.lag_bound) if s.adaptive_inflight else None)
  run = Path(c.run_dir) if c.run_dir else None
  export = str(run / "exports") if (s.export_hf and run) else ""
  service = LearnerService(
      learner, queue_capacity=s.queue_capacity, max_lag=c.max_policy_lag,
      publish_every=s.publish_every, hf_export_dir=export, controller=controller,
      max_length=c.agent.max_total_tokens,
      admission_log=str(run / "admission.log") if (admission_log and run) else "",
      dead_letter=str(run / "dead_letter.jsonl") if run else "", log_fsync=s.log_fsync,
      max_producers=s.max_producers, producer_ttl_versions=s.producer_ttl_versions,
      worker_timeout_s=s.worker_timeout_s, keep_versions=max(1, c.rollout.fixed_lag + 1),
      encode=codec.encode_record, decode=codec.decode_record)
  service.shards = shards
  if resume and service.restore() is not None:
    log.info("resumed at version %d (%d trajectories already used)", service.version,
             service.used)
  return learner, service


def agent_config(c: ml_collections.ConfigDict, model_config=None) -> AgentConfig:
  """The agent loop's settings. With an MoE `model_config`, records carry the engine's routing
  when the learner replays it, and always from the embedded engine (where it costs nothing
  and feeds the learner's routing-drift metric)."""
  a = c.agent
  moe = model_config is not None and model_config.is_moe
  return AgentConfig(max_turns=a.max_turns, max_new_tokens=a.max_new_tokens,
                     max_total_tokens=a.max_total_tokens, temperature=c.objective.temperature,
                     top_p=a.top_p, template=a.template,
                     tool_limits=rcfg.tool_limits(c),
                     record_routing=moe and (bool(c.routing_replay)
                                             or c.rollout.engine == "embedded"))


def _embedded(c, model, params, version):
  from fr_jax.rollout.embedded import EmbeddedEngine
  # with the run's LoRA fields: a remote worker's versions may come as base + adapters
  # (`GrpcClient(lora=True)`), which the engine folds in
  return EmbeddedEngine(model.config.replace(**lora.config_fields(c.model)),
                        model.params if params is None else params,
                        tokenizer=model.tokenizer, num_slots=c.rollout.num_slots,
                        max_len=agent_config(c).engine_max_len, version=version)


def server_engine(name: str):
  """The client class of an engine that runs as a server (rollout.engine sglang or vllm)."""
  if name == "sglang":
    from fr_jax.rollout.sglang import SGLangEngine
    return SGLangEngine
  if name == "vllm":
    from fr_jax.rollout.vllm import VLLMEngine
    return VLLMEngine
  raise ValueError(f"{name!r} is not an engine that runs as a server (sglang, vllm)")


def _server(c, model, params, version):
  engine = server_engine(c.rollout.engine)
  if agent_config(c, model.config).record_routing and not engine.reports_routing:
    raise rcfg.ConfigError(
        f"rollout.engine={c.rollout.engine} cannot report the experts it routed to, and "
        f"routing_replay is on for the mixture-of-experts model {c.model.name!r}: set "
        "routing_replay=False (the learner then routes for itself), or use the sglang or "
        "embedded engine")
  extra = {"pause_mode": c.rollout.vllm_pause_mode} if c.rollout.engine == "vllm" else {}
  # The model's config tells the SGLang client which of its per-layer routing rows are the
  # sparse layers' (routing replay), and with the run's LoRA fields that its versions are
  # adapters to name (`ServerEngine.follow_adapter`). The API key comes from the environment.
  mc = model.config.replace(**lora.config_fields(c.model))
  return engine(c.rollout.server_url, version=version, model_config=mc,
                timeout=c.rollout.server_timeout_s,
                api_key=os.environ.get(engine.api_key_env) or None, **extra)


# The engine factory: rollout.engine -> a builder. Everything else asks the engine itself
# (`weight_format`: arrays or an HF directory; `errors`: the failures a worker rides out).
ENGINE_BUILDERS = {"embedded": _embedded, "sglang": _server, "vllm": _server}


def build_engine(c: ml_collections.ConfigDict, model, params=None, version: int = 0):
  """The config's engine (a server's API key comes from the environment, never the
  config)."""
  return ENGINE_BUILDERS[c.rollout.engine](c, model, params, version)


def require_tokenizer(c: ml_collections.ConfigDict, model) -> None:
  if model.tokenizer is None:
    raise rcfg.ConfigError(f"model {c.model.name!r} has no tokenizer; rollouts need one "
                           "(use tiny-chat for tiny runs)")


def build_worker(c: ml_collections.ConfigDict, client, model, *, index: int, num_shards: int,
                 worker_id: str | None = None, params=None, version: int = 0,
                 sample_tag: str | None = None) -> Worker:
  require_tokenizer(c, model)
  env = envs.make(c.env.name, **c.env.kwargs.to_dict())
  engine = build_engine(c, model, params, version)
  return Worker(client, engine, model.tokenizer, env, agent_config(c, model.config),
                worker_id=worker_id or f"worker-{index}", shard_index=index,
                num_shards=num_shards, seed=c.env.seed, inflight=c.rollout.inflight,
                weights=engine.weight_format,
                heartbeat_every_s=c.rollout.heartbeat_every_s, sample_tag=sample_tag,
                fixed_lag=c.rollout.fixed_lag, batch_size=c.batch_size * c.minibatches,
                engine_errors=engine.errors)


def start_worker_threads(c, service, model, n: int, stop: threading.Event,
                         max_restarts: int = 3) -> tuple[list, list]:
  """(threads, errors): workers as threads of this process; a worker that raises is logged
  (in `errors`) and restarted."""
  from fr_jax.transport.client import LocalClient
  errors: list = []

  def body(i):
    restarts = 0
    while not stop.is_set() and not service.shutdown.is_set():
      try:
        v, params = service.weights(0)
        # Samples are drawn from env.seed, the version the worker starts at and its restarts:
        # a fresh run repeats its draws (`make demo SEED=...`), a resumed or restarted worker
        # draws new ones.
        w = build_worker(c, LocalClient(service, f"worker-{i}"), model, index=i,
                         num_shards=n, params=params, version=v,
                         sample_tag=f"v{v}.r{restarts}")
        w.run(stop)
        return
      except Exception as e:  # a worker's failure never kills the learner
        errors.append((i, repr(e)))
        log.exception("worker-%d failed (%s)", i, e)
        restarts += 1
        if restarts > max_restarts:
          log.error("worker-%d gave up after %d restarts", i, max_restarts)
          return
        time.sleep(1.0)

  threads = [threading.Thread(target=body, args=(i,), name=f"worker-{i}", daemon=True)
             for i in range(n)]
  for t in threads:
    t.start()
  return threads, errors


def train_in_process(c: ml_collections.ConfigDict, *, model=None,
                     on_update: Callable | None = None,
                     stop: threading.Event | None = None, final: dict | None = None) -> dict:
  """The whole system in one process: learner loop on this thread, workers as threads
  sharing the model and the devices (weights handed over as arrays, nothing serialised).
  Setting `stop` ends the run after the current update, with a checkpoint. `final`, if
  given, receives the last published (version, params)."""
  model = model or registry.load_configured(c.model)
  if c.rollout.engine == "embedded":  # fail here, not in every worker thread
    require_tokenizer(c, model)
  learner, service = build_service(c, model)
  learner_stop = stop or threading.Event()
  stop = threading.Event()  # the workers'
  threads, errors = start_worker_threads(c, service, model, c.rollout.num_workers, stop)

  def watchdog():  # every worker gave up: stop rather than wait for data forever
    while not stop.is_set():
      if not any(t.is_alive() for t in threads):
        log.error("all rollout workers stopped (%s); ending the run", errors[-3:])
        learner_stop.set()
        return
      time.sleep(0.5)

  threading.Thread(target=watchdog, daemon=True, name="watchdog").start()
  try:
    summary = service.run(c.max_updates, learner_stop, on_update=on_update)
    if final is not None:
      final["version"], final["params"] = service.weights(0)
  finally:
    stop.set()
    service.close()
    for t in threads:
      t.join(timeout=60)
    learner.close()
  summary["worker_errors"] = errors
  summary["tool_isolation"] = tool_isolation(c)
  return summary


def tool_isolation(c: ml_collections.ConfigDict) -> str:
  """How the run's Python tool isolates model code: namespaces, limits-only (allowed by
  agent.allow_limits_only, and warned about), unavailable, or none (no tool offered)."""
  from fr_jax.envs.sandbox import isolation_mode
  env = envs.make(c.env.name, **c.env.kwargs.to_dict())
  if "python" not in env.tools:
    return "none"
  return isolation_mode(rcfg.tool_limits(c))
