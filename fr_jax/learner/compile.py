"""The learner's update step compiled: from a config and a model, and from shapes alone.

`compile_update_from_shapes` lowers and compiles the update for a config far larger than this
machine (no parameter or optimizer state is materialised): `launch.compile_check`, the recipe
memory benchmark and the device check read its `memory_analysis()`. The `Learner` builds its
step config, model config, state shardings and jitted update with the same functions, so what
is checked is what runs. `measure_peak_flops` is the MFU denominator when `log.peak_flops` is
unset.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fr_jax import objective as obj
from fr_jax.learner import config as lcfg
from fr_jax.learner import mesh as meshlib
from fr_jax.learner import optim, step
from fr_jax.models import decoder, lora
from fr_jax.packing import pack
from fr_jax.trajectory import Trajectory


def measure_peak_flops(dtype: str = "float32", n: int = 2048, repeats: int = 5) -> float:
  """FLOP/s of a jitted n x n matmul on the default device (f32 accumulation)."""
  dt = jnp.dtype(dtype)
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dt)
  f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  f(a, a).block_until_ready()
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(a, a).block_until_ready()
    ts.append(time.perf_counter() - t0)
  return 2 * n**3 / float(np.median(ts))


def step_config(c: ml_collections.ConfigDict, model_config) -> step.StepConfig:
  o = c.objective
  moe = model_config.is_moe
  return step.StepConfig(
      model=model_config, loss=o.loss, delta=float(o.delta), reduction=o.reduction,
      length_norm=float(o.length_norm),
      trust=o.trust, advantage=o.advantage, clip_eps=float(o.clip_eps),
      clip_eps_high=float(o.clip_eps_high), temperature=float(o.temperature),
      # Supervised data (launch.sft) was not sampled by an engine: nothing to replay.
      remat=bool(c.model.remat), replay=moe and bool(c.routing_replay) and o.loss != "sft",
      router_aux_loss_coef=float(o.router_aux_loss_coef) if moe else 0.0,
      routing_counterfactual=moe and bool(c.log.routing_counterfactual))


def learner_model_config(c: ml_collections.ConfigDict, model_config):
  """The model's config with the learner's dtypes and how-not-what choices applied."""
  ep = c.mesh.get("expert", 1)
  if ep > 1 and not model_config.is_moe:
    raise lcfg.ConfigError(f"mesh.expert={ep}: expert parallelism is for MoE models; "
                           f"{c.model.name} has no experts")
  if ep > 1 and model_config.num_experts % (ep * c.mesh.fsdp):
    raise lcfg.ConfigError(f"mesh.expert={ep} x mesh.fsdp={c.mesh.fsdp} does not divide the "
                           f"model's {model_config.num_experts} experts")
  return model_config.replace(param_dtype=c.model.param_dtype,
                              compute_dtype=c.model.compute_dtype,
                              attention=c.model.attention, moe_impl=c.model.moe_impl,
                              # meshlib.params_sharding splits expert stacks over this axis
                              expert_shard_axis="fsdp" if model_config.is_moe else None,
                              expert_parallel_axis="expert" if ep > 1 else None,
                              moe_capacity_factor=float(c.model.get("moe_capacity_factor", 0.0)),
                              **lora.config_fields(c.model))





def state_shardings(params, optimizer, mesh):
  """The train state's shardings: every array (parameters and the optimizer's moments alike)
  split over fsdp as its parameter is (`mesh.params_sharding`), scalars replicated."""
  return meshlib.params_sharding(
      jax.eval_shape(lambda p: step.init_state(p, optimizer), params), mesh)


def jit_update(sc, optimizer, lr_schedule, state_shardings, mesh):
  return jax.jit(
      lambda s, a, b, st: step.update(s, a, b, st, sc=sc, optimizer=optimizer,
                                      lr_schedule=lr_schedule),
      donate_argnums=(0,),
      out_shardings=(state_shardings, meshlib.replicated(mesh), meshlib.replicated(mesh)))


def head_width(config: ml_collections.ConfigDict, action_fraction: float) -> int:
  """Positions per row the LM head scores in rows whose `action_fraction` of positions are
  actions (the config's head buckets; the whole row when none holds them)."""
  spec = lcfg.packing_spec(config)
  return spec.head_width(math.ceil(action_fraction * spec.row_len)) or spec.row_len


def compile_update_from_shapes(config: ml_collections.ConfigDict, model_config, rows: int,
                               devices=None, action_fraction: float = 1.0):
  """The learner's update step compiled for a micro-batch of `rows` packed rows of
  `packing.row_len` tokens, on the config's mesh, from shapes alone: no parameter or optimizer
  state is materialised, so a config far larger than this machine's memory compiles. The
  LM head scores the head bucket (`packing.head_buckets`) that holds rows whose
  `action_fraction` of positions are actions (1: every position). The executable's
  `memory_analysis()` is per device. Returns (executable, mesh, head positions per row)."""
  c = lcfg.ensure_valid(config)
  model_config = learner_model_config(c, model_config)
  mesh = meshlib.make_mesh(c.mesh.data, c.mesh.fsdp, devices, c.mesh.expert)
  optimizer, lr_schedule = optim.make_optimizer(c.optim), optim.schedule(c.optim)
  dtype = jnp.dtype(c.model.param_dtype)
  shapes = jax.eval_shape(lambda: decoder.init_params(model_config, jax.random.key(0)))
  shapes = jax.eval_shape(lambda p: lora.cast(p, dtype), shapes)  # adapters stay float32
  params = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                        shapes, meshlib.params_sharding(shapes, mesh))
  shardings = state_shardings(params, optimizer, mesh)
  state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                       jax.eval_shape(lambda p: step.init_state(p, optimizer), params),
                       shardings)
  # The batch's shapes and dtypes are packing's own: one tiny trajectory packed into `rows`.
  tiny = Trajectory("shape", np.zeros(1, np.int32), np.zeros(1, np.int32), np.ones(1, bool),
                    np.zeros(1, np.float32), 0.0, 0)
  routing = None
  if model_config.is_moe:
    routing = model_config.routing_shape
    tiny.routed_experts = np.zeros((1, *routing), model_config.routing_dtype)
  spec = lcfg.packing_spec(c)
  (b,) = pack([tiny], dataclasses.replace(spec, row_buckets=(rows,)), routing).batches
  width = head_width(c, action_fraction)
  b = b._replace(action_index=None if width == spec.row_len else np.zeros((rows, width),
                                                                          np.int32))
  batch = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), b,
                       meshlib.batch_sharding(b, mesh))
  rep = meshlib.replicated(mesh)
  stats = obj.BatchStats(*[jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)] * 3)
  fn = jit_update(step_config(c, model_config), optimizer, lr_schedule, shardings, mesh)
  with jax.set_mesh(mesh):  # the model's per-shard paths read it (moe._experts)
    return fn.lower(state, None, batch, stats).compile(), mesh, b.head_width
