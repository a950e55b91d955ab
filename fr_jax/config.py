"""The run configuration: the learner's fields (`fr_jax.learner.config`) plus the
environment, the agent loop, the rollout workers and the learner service.

Experiment files (`experiments/configs/*.py`) start from `default_config()` and change what
they need; every field can be overridden on the command line (`--config.x=y`).

`validate` is the one check of a run config (the learner's fields included) and runs once, at
load (`launch.common.load_config`); it also fills what derives from other fields (checkpoint
and log directories from run_dir, `optim.total_steps` from max_updates). `System` and
`Learner` take the validated config as it is (`fr_jax.learner.config.ensure_valid`).
"""

from __future__ import annotations

import dataclasses

import ml_collections

from fr_jax.envs.sandbox import Limits
from fr_jax.learner import config as lcfg
from fr_jax.rollout import tool_formats

ConfigError = lcfg.ConfigError
ENGINES = ("embedded", "sglang", "vllm")


def default_config() -> ml_collections.ConfigDict:
  c = lcfg.default_config()
  c.run_dir = ""  # metrics.jsonl, TensorBoard, checkpoints/, exports/; empty: nothing written
  # Compiled programs kept between runs (fr_jax.compile_cache): "auto" is
  # JAX_COMPILATION_CACHE_DIR or ~/.cache/fr_jax/xla; a path; "off".
  c.compile_cache_dir = "auto"
  c.env = ml_collections.ConfigDict(dict(
      name="arithmetic",  # arithmetic | tool_arithmetic | countdown | textworld | digits
      kwargs=ml_collections.ConfigDict(),  # constructor settings, e.g. difficulty=2
      seed=0,  # prompt shuffling; in-process runs (launch.train) also draw samples from it
  ))
  c.agent = ml_collections.ConfigDict(dict(
      max_turns=3,
      max_new_tokens=128,  # per model turn
      max_total_tokens=512,  # prompt + completion
      top_p=1.0,
      template="chatml",  # chatml (plain) or model (the model's own template)
      # The Python tool runs model code only under Linux user-namespace isolation; where the
      # kernel refuses them the run stops at start. True runs it with resource limits only
      # (unsafe: the code can read the worker user's files and reach the network).
      allow_limits_only=False,
      # The tool's resource limits per call (fr_jax.envs.sandbox.Limits; defaults are its own):
      # wall_seconds, cpu_seconds, memory_bytes (address space per process),
      # call_memory_bytes (the whole call, where a memory cgroup can be made), max_processes,
      # max_output_bytes (what the model sees), max_file_bytes, tmpfs_bytes, max_code_bytes.
      tool_limits=ml_collections.ConfigDict(
          {k: v for k, v in dataclasses.asdict(Limits()).items() if k != "allow_limits_only"}),
  ))
  c.rollout = ml_collections.ConfigDict(dict(
      engine="embedded",  # embedded (in-process JAX), sglang or vllm
      # sglang, vllm: http://host:port of the server (or an SGLang gateway); its API key comes
      # from the environment ($SGLANG_API_KEY, $VLLM_API_KEY), never the config
      server_url="",
      server_timeout_s=600.0,  # an answer not back by then fails the round; the worker backs off
      # vllm: a weight update keeps the requests in flight (their caches are computed again
      # with the new weights) or aborts them (resumed from their partial tokens)
      vllm_pause_mode="keep",
      num_workers=1,  # launch.train: worker threads in this process
      inflight=8,  # episodes in flight per worker
      # embedded engine: decode slots (continuous batching). Keep >= inflight: each episode
      # in flight then keeps its KV cache between turns (prefix reuse, docs/rollout.md).
      num_slots=8,
      heartbeat_every_s=0.0,  # 0: every round
      # -1: workers load the newest weights as soon as they are published (the policy lag
      # follows timing). L >= 0 (launch.train, one worker, embedded engine): the worker samples
      # with version k - L once it has pushed k batches, waiting for it if it must; a run's
      # batches are then the same on a busy machine and a quiet one (docs/system.md).
      fixed_lag=-1,
  ))
  c.eval = ml_collections.ConfigDict(dict(
      n=0,  # launch.train: held-out tasks evaluated (greedy) at the start and the end; 0: none
      every=0,  # launch.train: also every this many updates (the run's curves); 0: never
      # those periodic evaluations use the first every_n tasks of the n (0: all n), so a
      # curve costs little; the start and end evaluations always use all n
      every_n=0,
      # 0: greedy; > 0: one sample per task at this temperature (fixed seeds). A policy that
      # is undecided between two actions shows it only when sampled.
      temperature=0.0,
      num_slots=32,
      # the start and end evaluations also run without the tool, per difficulty level:
      # accuracy without it, and how well tool calls follow need (fr_jax/evaluate.py)
      calibration=False,
  ))
  # The supervised warm start (launch.sft; launch.train runs it first when steps > 0).
  c.sft = ml_collections.ConfigDict(dict(
      steps=0,  # optimizer steps; 0: no warm start
      data="",  # JSONL of conversations (fr_jax.sft); empty: `examples` demonstrations of the env
      examples=1024,  # generated demonstrations (env.demonstration) when data is empty
      tool_fraction=0.5,  # share of generated demonstrations that call the tool
      batch_size=16,  # conversations per step
      lr=1e-4,
      warmup_frac=0.1,
      # cosine from lr to lr * min_lr_ratio over the steps; < 0: the RL run's
      # optim.min_lr_ratio (so a change to RL's schedule changes the warm start too)
      min_lr_ratio=-1.0,
      # token_mean: every assistant token weighs the same. sample_mean would weigh a token by
      # 1/(its conversation's length): the first token of a 5-token direct answer would count
      # 8x the first token of a 40-token tool call, and the warm start would learn to call the
      # tool far less often than its data does.
      reduction="token_mean",
      checkpoint_every=25,  # steps between checkpoints (resume)
      seed=0,  # data order and generated demonstrations
  ))
  c.service = ml_collections.ConfigDict(dict(
      address="127.0.0.1:0",  # gRPC bind (launch.learner); non-loopback needs a token or TLS
      queue_capacity=64,  # admitted trajectories waiting; a full queue blocks workers
      publish_every=1,  # updates between weight publications
      export_hf=False,  # also export HF safetensors for SGLang fleets (run_dir/exports)
      adaptive_inflight=False,  # the adaptive in-flight controller (off by default)
      target_rejection=0.1,  # controller: trust rejection rate to stay under
      lag_bound=4,  # controller: policy lag to stay under
      log_fsync=True,  # fsync each admitted record before acknowledging it (else: flush only)
      max_producers=65536,  # producer watermarks kept; idle ones beyond are evicted
      producer_ttl_versions=100,  # forget a producer owing nothing after this many updates
      worker_timeout_s=300.0,  # forget a worker's stats after this long without a heartbeat
      max_streams=1024,  # concurrent trajectory streams; more are refused and retry later
      # Weight relays (launch.learner): every learner process serves its own pieces of each
      # version in the servers' dtype; the hosts serve each version to `fanout` relays and
      # every relay to `fanout` more (fr_jax/transport/shards.py, docs/scale.md).
      shards=True,
      wire_dtype="bfloat16",  # what the SGLang servers load
      fanout=2,  # relays fetching from the hosts, and from each relay, per version
  ))
  # The OpenAI-compatible gateway (launch.gateway, fr_jax/rollout/gateway.py).
  c.gateway = ml_collections.ConfigDict(dict(
      address="127.0.0.1:8000",  # HTTP bind; loopback by default
      tool_format="auto",  # auto (from the chat template) | none | hermes | llama3_json | mistral
      max_open_episodes=1024,  # episodes without a reward yet; more are refused (429)
      episode_timeout_s=900.0,  # an episode idle this long is dropped (episodes_expired)
      max_segments=16,  # segments per episode
      max_connections=64,  # requests served at once; more get 503
      max_body_bytes=4 << 20,  # a larger request body is refused (413)
      max_batch=0,  # embedded engine: calls a batch starts with (0: rollout.num_slots)
  ))
  return c


def validate(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Learner checks plus the run's own, and the derived fields; raises ConfigError naming
  the field. Returns `c`, remembered as validated."""
  if c.objective.reduction == "constant_length" and c.objective.length_norm == 0:
    c.objective.length_norm = float(c.agent.max_new_tokens)  # the longest reply of a turn
  lcfg.check_fields(c)
  if c.rollout.engine not in ENGINES:
    raise ConfigError(f"rollout.engine={c.rollout.engine!r}: choose one of {ENGINES}")
  if c.rollout.engine != "embedded" and not c.rollout.server_url:
    raise ConfigError(f"rollout.engine={c.rollout.engine} needs rollout.server_url (the "
                      "server's http://host:port)")
  if c.rollout.vllm_pause_mode not in ("keep", "abort"):
    raise ConfigError(f"rollout.vllm_pause_mode={c.rollout.vllm_pause_mode!r}: keep or abort")
  if c.rollout.num_workers < 1 or c.rollout.inflight < 1 or c.rollout.num_slots < 1:
    raise ConfigError("rollout.num_workers, rollout.inflight and rollout.num_slots must be >= 1")
  if c.rollout.fixed_lag < -1:
    raise ConfigError(f"rollout.fixed_lag={c.rollout.fixed_lag}: -1 (off) or a lag >= 0")
  if c.rollout.fixed_lag >= 0 and (
      c.rollout.num_workers != 1 or c.rollout.engine != "embedded"
      or c.service.publish_every != 1 or c.service.adaptive_inflight):
    raise ConfigError(
        f"rollout.fixed_lag={c.rollout.fixed_lag} needs rollout.num_workers=1, "
        "rollout.engine=embedded, service.publish_every=1 and service.adaptive_inflight=False "
        "(each would make the schedule follow timing again)")
  if 0 <= c.max_policy_lag < c.rollout.fixed_lag:
    raise ConfigError(f"rollout.fixed_lag={c.rollout.fixed_lag} exceeds max_policy_lag="
                      f"{c.max_policy_lag}: every trajectory would be dropped as stale")
  if c.service.queue_capacity < c.batch_size * c.minibatches:
    raise ConfigError(f"service.queue_capacity={c.service.queue_capacity} must hold a batch "
                      f"(batch_size*minibatches={c.batch_size * c.minibatches})")
  if min(c.service.max_producers, c.service.max_streams, c.service.producer_ttl_versions) < 1 \
     or not c.service.worker_timeout_s > 0:
    raise ConfigError("service.max_producers, service.max_streams and "
                      "service.producer_ttl_versions must be >= 1, service.worker_timeout_s > 0")
  if c.service.wire_dtype not in ("bfloat16", "float16", "float32") or c.service.fanout < 1:
    raise ConfigError(f"service.wire_dtype={c.service.wire_dtype!r} must be bfloat16, float16 "
                      f"or float32, and service.fanout={c.service.fanout} >= 1")
  if c.agent.max_total_tokens > c.packing.row_len:
    raise ConfigError(f"agent.max_total_tokens={c.agent.max_total_tokens} exceeds "
                      f"packing.row_len={c.packing.row_len}: trajectories would not fit a row")
  if c.sft.steps < 0 or c.sft.batch_size < 1 or c.sft.lr < 0 or c.sft.checkpoint_every < 1 \
     or not 0 <= c.sft.tool_fraction <= 1 or not 0 <= c.sft.warmup_frac < 1:
    raise ConfigError("sft: steps >= 0, batch_size >= 1, lr >= 0, checkpoint_every >= 1, "
                      "tool_fraction in [0, 1] and warmup_frac in [0, 1) are required")
  if not (c.sft.min_lr_ratio < 0 or 0 <= c.sft.min_lr_ratio <= 1):
    raise ConfigError(f"sft.min_lr_ratio={c.sft.min_lr_ratio}: in [0, 1], or < 0 for the RL "
                      "schedule's optim.min_lr_ratio")
  if c.sft.reduction not in ("sample_mean", "token_mean"):
    raise ConfigError(f"sft.reduction={c.sft.reduction!r}: choose sample_mean or token_mean")
  if c.eval.temperature < 0:
    raise ConfigError(f"eval.temperature={c.eval.temperature} must be >= 0 (0: greedy)")
  if c.eval.every < 0:
    raise ConfigError(f"eval.every={c.eval.every} must be >= 0")
  if not 0 <= c.eval.every_n <= c.eval.n:
    raise ConfigError(f"eval.every_n={c.eval.every_n} must be in [0, eval.n={c.eval.n}] (the "
                      "periodic evaluations use the first every_n of the n held-out tasks)")
  g = c.gateway
  if g.tool_format not in ("auto", "none", *tool_formats.FORMATS):
    raise ConfigError(f"gateway.tool_format={g.tool_format!r}: choose auto, none or one of "
                      f"{tool_formats.FORMATS}")
  if min(g.max_open_episodes, g.max_segments, g.max_connections, g.max_body_bytes) < 1 \
     or not g.episode_timeout_s > 0 or g.max_batch < 0:
    raise ConfigError("gateway: max_open_episodes, max_segments, max_connections and "
                      "max_body_bytes must be >= 1, episode_timeout_s > 0, max_batch >= 0")
  bad = {k: v for k, v in c.agent.tool_limits.items() if not v > 0}
  if bad:
    raise ConfigError(f"agent.tool_limits {bad}: every limit must be > 0")
  from fr_jax import envs
  try:
    envs.make(c.env.name, **c.env.kwargs.to_dict())
  except (TypeError, ValueError) as e:
    raise ConfigError(f"env.name={c.env.name!r} / env.kwargs: {e}") from None
  resolve_dirs(c)
  lcfg.remember_valid(c)
  return c


def tool_limits(c: ml_collections.ConfigDict) -> Limits:
  """The Python tool's sandbox limits of this run (`agent.tool_limits`,
  `agent.allow_limits_only`)."""
  return Limits(**c.agent.tool_limits.to_dict(), allow_limits_only=c.agent.allow_limits_only)


def resolve_dirs(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Fills checkpoint.dir and log.dir from run_dir where they are empty."""
  if c.run_dir:
    with c.unlocked():
      if not c.checkpoint.dir:
        c.checkpoint.dir = f"{c.run_dir}/checkpoints"
      if not c.log.dir:
        c.log.dir = c.run_dir
  return c
