"""The learner: effects around the pure update step.

`Learner.update(trajectories)` takes one fresh batch of B admitted records, packs them
into bucket-shaped micro-batches, computes the whole batch's normalisers, accumulates the
micro-batch gradients and makes exactly one optimizer step (k steps in the sequential-
minibatch ablation), then returns the step's metrics (also written to JSONL/TensorBoard).
Nothing is replayed. Each (micro-batch shape, final or not) compiles once, ahead of time, and
the MFU figure counts its model FLOPs analytically (`ModelConfig.train_flops`). An update
enqueues all its work before it reads anything back, computes the host's share of the metrics
while the device runs, then waits once.

A step whose loss or gradient is not finite applies nothing (the step's guard); its records
are reported in `skipped_traj_ids`, and `find_offenders` names the ones responsible by
bisection, without touching the state.

Around it: `compile` builds the step config and jitted update (and compiles them from shapes
alone for the fit checks), `quarantine` holds the offender search, `diagnostics` splits the
step's per-record values, and `multihost` makes the collective calls and follows process 0.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from fr_jax import objective as obj
from fr_jax.learner import checkpoint as ckpt
from fr_jax.learner import compile as compiling
from fr_jax.learner import config as lcfg
from fr_jax.learner import diagnostics, multihost, optim, quarantine, step
from fr_jax.learner import mesh as meshlib
from fr_jax.learner.metrics import MetricsWriter
from fr_jax.learner.programs import PROGRAMS
from fr_jax.models import hf_shards, lora, registry
from fr_jax.models.hf_io import export_hf
from fr_jax.packing import pack
from fr_jax.trajectory import Trajectory

log = logging.getLogger("fr_jax.learner")


class Learner:
  """Owns the train state, the mesh, compiled steps, checkpoints and metric files.

  With several JAX processes (`jax.distributed`), every process holds one; process 0's
  drives the run and the others `follow()` it (see `multihost`). Only process 0 writes
  metric files."""

  def __init__(self, config: ml_collections.ConfigDict,
               model: registry.LoadedModel | None = None, devices=None,
               group: multihost.Group | None = None):
    self.config = lcfg.ensure_valid(config)
    c = self.config
    self.group = group if group is not None else multihost.group()
    if model is None:
      model = registry.load_configured(c.model)
    self.model_config = compiling.learner_model_config(c, model.config)
    self.tokenizer = model.tokenizer
    self.mesh = meshlib.make_mesh(c.mesh.data, c.mesh.fsdp, devices, c.mesh.expert)
    self.spec = lcfg.packing_spec(c)
    self.optimizer = optim.make_optimizer(c.optim)
    self.lr_schedule = optim.schedule(c.optim)
    dtype = jnp.dtype(c.model.param_dtype)
    # A copy: updates donate the state's buffers, which must never alias the caller's model.
    params = lora.cast(model.params, dtype)
    # LoRA: fresh adapters (B = 0) on the base, unless the model carries them already.
    params = lora.init_adapters(params, self.model_config,
                                jax.random.fold_in(jax.random.key(c.model.seed), 0x10A))
    params = meshlib.put(params, meshlib.params_sharding(params, self.mesh))
    self._state_shardings = compiling.state_shardings(params, self.optimizer, self.mesh)
    self.state = jax.jit(lambda p: step.init_state(p, self.optimizer),
                         out_shardings=self._state_shardings)(params)
    self.step_config = compiling.step_config(c, self.model_config)
    self._jit_update = compiling.jit_update(self.step_config, self.optimizer, self.lr_schedule,
                                   self._state_shardings, self.mesh)
    # The per-trajectory values come back replicated, as the update's metrics do: every
    # process of a multi-process learner reads them whole (a value sharded across processes
    # cannot be fetched).
    self._jit_accumulate = jax.jit(
        lambda p, a, b, st: step.accumulate(p, a, b, st, sc=self.step_config),
        donate_argnums=(1,), out_shardings=(None, meshlib.replicated(self.mesh)))
    self._compiled: dict = {}  # (kind, shape, has_acc) -> (executable, flops)
    self.compile_s = 0.0  # seconds spent compiling updates (the run summary reports it)
    # What this learner's programs depend on besides their arguments (`PROGRAMS`): the
    # optimizer and its schedule are built from c.optim alone.
    self._program_base = (self.step_config, json.dumps(c.optim.to_dict(), sort_keys=True),
                          jax.config.jax_enable_x64,
                          str(jax.config.jax_default_matmul_precision))
    self.checkpointer = (ckpt.Checkpointer(c.checkpoint.dir, every=c.checkpoint.every,
                                           keep=c.checkpoint.keep,
                                           async_save=c.checkpoint.async_save)
                         if c.checkpoint.dir else None)
    self.writer = MetricsWriter(c.log.dir if self.is_leader else "")
    self._peak = float(c.log.peak_flops) or compiling.measure_peak_flops(c.model.compute_dtype)
    self._jit_finite = jax.jit(lambda acc: jnp.isfinite(acc["sums"]["loss"]) &
                               jnp.isfinite(optax.tree.norm(acc["grads"])))
    self._last_saved = -1

  # --- state ---
  @property
  def is_leader(self) -> bool:
    """Process 0 of a multi-process learner, or the only process."""
    return self.group is None or self.group.leader

  @property
  def version(self) -> int:
    """Policy version of the current parameters: optimizer steps applied."""
    return int(self.state.step)

  @property
  def params(self):
    """The current parameters, LoRA adapters (if any) included: what the update trains."""
    return self.state.params

  def policy_params(self, params=None):
    """The plain model the (current) parameters compute, adapters folded in
    (`lora.merged`): what engines run and HF exports hold. Without adapters, `params`
    itself."""
    params = self.state.params if params is None else params
    if not lora.has_adapters(params):
      return params
    if self._merge is None:
      self._merge = jax.jit(lambda p: lora.merged(p, self.model_config))
    return self._merge(params)

  @property
  def record_limits(self) -> dict:
    """What a record must satisfy to be digestible by this model (`trajectory.validate`)."""
    limits = dict(max_length=self.spec.max_trajectory_length,
                  vocab_size=self.model_config.vocab_size)
    if self.model_config.is_moe:  # routing, whenever present, is packed: check it all
      limits["routing"] = (*self.model_config.routing_shape, self.model_config.num_experts)
      # Under replay every record must carry the engine's experts.
      limits["require_routing"] = bool(self.step_config.replay)
    return limits

  def _routing(self, trajs) -> tuple[int, int] | None:
    """(sparse layers, k) when the batch's routing is packed: always under replay; without
    it, when every record carries routing (for the drift metric)."""
    mc = self.model_config
    if mc.is_moe and (self.step_config.replay or all(
        getattr(t, "routed_experts", None) is not None for t in trajs)):
      return mc.routing_shape
    return None

  @property
  def compile_count(self) -> int:
    return len(self._compiled)

  # --- compilation ---
  def _executable(self, kind, *args):
    b = args[2]
    key = (kind, b.shape, b.head_width, args[1] is not None)
    if key not in self._compiled:
      fn = self._jit_update if kind == "update" else self._jit_accumulate

      def compile_():
        with jax.set_mesh(self.mesh):  # the model's per-shard paths read it (moe._experts)
          return fn.lower(*args).compile()

      t0 = time.perf_counter()
      exe, compiled = PROGRAMS.get(self._program_key(kind, args), compile_)
      R, L, _ = b.shape
      flops = self.model_config.train_flops(R, L)
      self._compiled[key] = (exe, flops)
      dt = time.perf_counter() - t0
      self.compile_s += dt
      log.info("%s %s for micro-batch %s, head over %d positions a row, in %.1fs (%.3g FLOPs)",
               "compiled" if compiled else "reused", kind, b.shape, b.head_width, dt, flops)
    return self._compiled[key]

  def _program_key(self, kind: str, args) -> tuple:
    """Everything the `kind` program compiled for `args` depends on: the learner's step config
    and optimizer settings, and each argument's shape, dtype and sharding (its mesh)."""
    leaves, tree = jax.tree.flatten(args)
    return (kind, *self._program_base, tree,
            tuple((x.shape, x.dtype, x.sharding) for x in leaves))

  # --- one batch ---
  def _device_batch(self, b, values_S=None):
    if values_S is not None:
      b = b._replace(rewards=values_S)
    return meshlib.put(b, meshlib.batch_sharding(b, self.mesh))

  def _grpo_advantages(self, trajs: Sequence[Trajectory]) -> np.ndarray:
    ids = {}
    groups = np.array([ids.setdefault(t.prompt_id, len(ids)) for t in trajs])
    rewards = np.array([t.reward for t in trajs], np.float32)
    return np.asarray(obj.group_advantages(rewards, groups,
                                           self.config.objective.normalize_std))

  def _micro_batches(self, trajs, reward_mean: float, advantages: np.ndarray | None):
    """(packed batch, whole-batch normalisers, device micro-batches)."""
    packed = pack(trajs, self.spec, self._routing(trajs))
    B = len(trajs)
    T = float(sum(t.num_action_tokens for t in trajs))
    # Whole-batch normalisers: every micro-batch sees B, sum R (as B * mean) and sum T.
    stats = meshlib.put(obj.BatchStats(np.float32(B), np.float32(reward_mean * B),
                                       np.float32(T)), meshlib.replicated(self.mesh))
    dbs = []
    for b in packed.batches:
      vals = None
      if advantages is not None:
        vals = np.where(b.segment_valid, advantages[np.maximum(b.traj_index, 0)], 0.0)
        vals = vals.astype(np.float32)
      dbs.append(self._device_batch(b, vals))
    return packed, stats, dbs

  def _dispatch(self, trajs: Sequence[Trajectory], reward_mean: float,
                advantages: np.ndarray | None) -> tuple:
    """Packs `trajs` and enqueues their micro-batches, the last one applying the step; waits
    for nothing. Returns (packed batch, FLOPs, device metrics, device per-slot values)."""
    packed, stats, dbs = self._micro_batches(trajs, reward_mean, advantages)
    acc, flops, segments = None, 0.0, []
    for i, db in enumerate(dbs):
      if i + 1 < len(packed.batches):
        exe, f = self._executable("accumulate", self.state.params, acc, db, stats)
        acc, seg = exe(self.state.params, acc, db, stats)
      else:
        exe, f = self._executable("update", self.state, acc, db, stats)
        self.state, m, seg = exe(self.state, acc, db, stats)
      segments.append(seg)
      flops += f
    return packed, flops, m, segments

  def accumulated(self, trajs: Sequence[Trajectory]) -> tuple[int, dict]:
    """(micro-batches, accumulated gradient and metric sums) of the one-batch objective on
    `trajs` alone (their own B, mean reward and token count) at the current parameters,
    through the programs updates run. Applies nothing."""
    adv = self._grpo_advantages(trajs) if self.config.objective.loss == "grpo" else None
    _, stats, dbs = self._micro_batches(trajs, float(np.mean([t.reward for t in trajs])), adv)
    acc = None
    for db in dbs:
      exe, _ = self._executable("accumulate", self.state.params, acc, db, stats)
      acc, _ = exe(self.state.params, acc, db, stats)
    return len(dbs), acc

  @multihost.collective
  def find_offenders(self, trajs: Sequence[Trajectory]) -> list[int]:
    """Indices of a smallest set of records whose removal makes the batch's objective finite
    (`quarantine.minimal_offenders`); empty if the batch is finite now."""
    def finite_without(removed: set) -> bool:
      rest = [t for i, t in enumerate(trajs) if i not in removed]
      return not rest or bool(self._jit_finite(self.accumulated(rest)[1]))

    return quarantine.minimal_offenders(len(trajs), finite_without)

  @multihost.collective
  def update(self, trajs: Sequence[Trajectory], *, lags: Sequence[int] | None = None,
             log_ids: bool = True) -> dict:
    """One fresh batch of admitted records (checked by `trajectory.validate` against
    `record_limits` or tighter, once, where they were admitted: the learner service, or the
    caller), then one optimizer step (k with `minibatches=k`, the batch split into k
    consecutive updates whose advantages use the whole batch's mean). `lags` are the records'
    policy lags as the caller measured them when it took the batch (default: against the
    current version). Returns the last step's metrics; every step is written to the metric
    files."""
    c = self.config
    k = c.minibatches
    if len(trajs) != c.batch_size * k:
      raise ValueError(f"update() needs batch_size*minibatches = {c.batch_size}*{k} = "
                       f"{c.batch_size * k} trajectories, got {len(trajs)}")
    reward_mean = float(np.mean([t.reward for t in trajs]))
    adv = self._grpo_advantages(trajs) if c.objective.loss == "grpo" else None
    B = c.batch_size
    if lags is None:
      lags = [t.policy_lag(self.version) for t in trajs]
    lags, v0, skipped0 = np.asarray(lags, np.int64), self.version, int(self.state.skipped)
    t0 = time.perf_counter()
    chunks = [trajs[j * B:(j + 1) * B] for j in range(k)]
    # Every step is enqueued before anything is read back, and the host's share of the
    # metrics is computed while the device runs; then one transfer brings every step's.
    steps = [self._dispatch(chunk, reward_mean, None if adv is None else adv[j * B:(j + 1) * B])
             for j, chunk in enumerate(chunks)]
    host = [_record_means(chunk) for chunk in chunks]
    device = jax.device_get([(m, seg) for _, _, m, seg in steps])
    dt = (time.perf_counter() - t0) / k  # the update's time, split evenly over its k steps
    o = self.config.objective
    m, skipped, applied = {}, [], 0
    for j, (chunk, (packed, flops, _, _), (dm, seg)) in enumerate(zip(chunks, steps, device)):
      m = {key: (bool(v) if key == "finite" else float(v)) for key, v in dm.items()}
      # Each update applied before this chunk (k > 1 ablation) puts it one version further
      # behind.
      lag = lags[j * B:(j + 1) * B] + applied
      m.update(diagnostics.record_metrics(
          chunk, lag, packed, seg, replay=self.step_config.replay,
          counterfactual=self.step_config.routing_counterfactual and o.loss != "sft"))
      applied += m["finite"]
      m.update(host[j], step_time_s=dt, tokens=packed.real_tokens,
               tokens_per_s=packed.real_tokens / dt, packing_efficiency=packed.efficiency,
               micro_batches=len(packed.batches), policy_lag_mean=float(np.mean(lag)),
               policy_lag_max=int(max(lag)), flops=flops, mfu=flops / dt / self._peak,
               version=v0 + applied, skipped_total=skipped0 + j + 1 - applied)
      if not m["finite"]:  # nothing applied: not an update row (versions stay one per row)
        ids = [t.traj_id for t in chunk]
        log.warning("non-finite loss or gradient: batch skipped, state kept (trajectories %s)",
                    ids)
        skipped += ids
        self.writer.write(m["version"], m, prefix="skipped/")
        continue
      if log_ids:
        m["traj_ids"] = [t.traj_id for t in chunk]
        # what each record was, for analyses by task offline (experiments/agent_demo/by_level)
        m["traj_prompt_ids"] = [t.prompt_id for t in chunk]
        m["traj_rewards"] = [float(t.reward) for t in chunk]
        m["traj_tool_calls"] = [int(t.num_tool_calls) for t in chunk]
        m["traj_action_tokens"] = [int(np.sum(t.action_mask)) for t in chunk]
      self.writer.write(m["version"], m)
    if skipped:
      m["skipped_traj_ids"] = skipped
    return m

  def state_intact(self) -> bool:
    """False if an update that raised left the train state's buffers donated (deleted)."""
    return not any(a.is_deleted() for a in jax.tree.leaves(self.state)
                   if isinstance(a, jax.Array))

  # --- checkpoints and export ---
  @multihost.collective
  def save(self, data_state=None, *, force: bool = False, extra: dict | None = None) -> bool:
    """Saves (asynchronously) every `checkpoint.every` versions, or now with force=True."""
    if self.checkpointer is None:
      return False
    v = self.version
    if not force and not self.checkpointer.should_save(v):
      return False
    if v == self._last_saved or v == self.checkpointer.latest_step():
      return False  # this version is already on disk
    self._last_saved = v
    # A copy, so the asynchronous write never reads buffers the next update donates.
    state = jax.tree.map(jnp.copy, self.state)
    meta = {"config": self.config.to_dict(), "policy_version": v, "data_state": data_state,
            "skipped": int(self.state.skipped), "extra": extra or {}}
    return self.checkpointer.save(v, state, meta, force=force)

  @multihost.collective
  def restore(self, step_: int | None = None) -> dict | None:
    """Restores the latest checkpoint if there is one; returns its meta (with data_state).
    The metric rows of updates past the restored version (or of all, with no checkpoint)
    are dropped: they will be made again."""
    meta = None
    if self.checkpointer is not None and self.checkpointer.latest_step() is not None:
      state, meta, s = self.checkpointer.restore(self.state, step_)
      self.state = jax.device_put(state, self._state_shardings)
      log.info("restored checkpoint at version %d from %s", s, self.checkpointer.dir)
    self.writer.forget_after(self.version)
    return meta

  @multihost.collective
  def snapshot_params(self):
    """A copy of the current parameters that the next update cannot donate: on device
    where this process holds them all, else gathered to host memory (on every process)."""
    params = self.policy_params()  # with adapters: a new (merged) tree, not donated
    if all(a.is_fully_addressable for a in jax.tree.leaves(params)):
      if params is self.state.params:
        params = jax.tree.map(jnp.copy, params)
      return jax.block_until_ready(params)
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(params, tiled=True)

  def lora_snapshot(self, with_base: bool):
    """(adapters, frozen base or None) of the current parameters, host NumPy copies keyed as
    `codec.flatten` keys them, for workers that fetch a LoRA run's versions as adapters
    (`Publisher`). One process only; call between updates."""
    from fr_jax.transport import codec
    trainable, frozen = lora.split(self.state.params)
    # copies (np.array), never views of the state's buffers, which the next update donates
    host = lambda tree: {k: np.array(a) for k, a in  # noqa: E731
                         codec.flatten(jax.device_get(tree)).items()}
    return host(trainable), host(frozen) if with_base else None

  shard_sink = None  # a transport.shards.ShardHost on every process (launch.learner sets it)
  _shard_manifest = None
  _shard_pool = None
  _shard_job = None
  _merge = None  # the jitted lora.merged, compiled on first use

  @multihost.collective
  def publish_shards(self, version: int) -> None:
    """Hands this process's pieces of the current parameters (a LoRA model's base weights
    and adapters, unmerged), in the sink's dtype, to
    `shard_sink` as `version` (`fr_jax.models.hf_shards`: each process takes its own
    addressable shards; nothing is gathered). Every process calls it, like an update. The
    parameters are copied on device here (the next update donates them); the copy to host,
    the cast and the HF layout happen on a background thread, one version after another,
    while the learner trains on (`wait_shards` waits for them)."""
    if self.shard_sink is None:
      return
    self.wait_shards()  # one version in the works at a time: at most one more device copy
    # With LoRA the base and the adapters as they are, not merged: versions then differ in
    # the adapters' bytes only, and the relays fold them in (`hf_shards.write_merged`).
    params, cfg = jax.tree.map(jnp.copy, self.state.params), self.model_config
    if self._shard_manifest is None or self._shard_manifest.dtype != self.shard_sink.dtype:
      self._shard_manifest = hf_shards.manifest_of(params, cfg, self.shard_sink.dtype)
    m, sink, host = self._shard_manifest, self.shard_sink, jax.process_index()
    if self._shard_pool is None:
      from concurrent import futures
      self._shard_pool = futures.ThreadPoolExecutor(1, thread_name_prefix="shards")

    def put():
      try:
        sink.put(version, m, hf_shards.local_pieces(params, cfg, m, host))
      except Exception:  # noqa: BLE001 -- relays wait for the next version; training goes on
        log.exception("could not publish the shards of version %d", version)

    self._shard_job = self._shard_pool.submit(put)

  def wait_shards(self) -> None:
    """Until this process's pieces of the last published version are in its sink."""
    if self._shard_job is not None:
      self._shard_job.result()

  def export_hf(self, path, params=None) -> str:
    """Writes the parameters (default: the current ones) as a HF safetensors directory
    (for SGLang)."""
    params = jax.device_get(self.policy_params(params))
    return str(export_hf(path, params, self.model_config, self.tokenizer))

  @multihost.collective
  def close(self):
    if self.checkpointer is not None:
      self.checkpointer.close()
    if self._shard_pool is not None:
      self._shard_pool.shutdown(wait=True)
    self.writer.close()


def _record_means(trajs: Sequence[Trajectory]) -> dict:
  """The metrics of a batch that its records alone give."""
  return dict(reward_mean=float(np.mean([t.reward for t in trajs])),
              response_length=float(np.mean([t.completion_tokens.shape[0] for t in trajs])),
              truncation_rate=float(np.mean([t.truncated for t in trajs])),
              tool_calls=float(np.mean([t.num_tool_calls for t in trajs])),
              turns=float(np.mean([t.num_turns for t in trajs])))
