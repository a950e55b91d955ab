"""The learner: mesh == single device, accumulation == one pass, restart == uninterrupted,
one compile per bucket, the non-finite guard, ablation modes, schedule, metric files."""

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fr_jax.learner import config as lcfg
from fr_jax.learner import optim
from fr_jax.learner.checkpoint import Checkpointer
from fr_jax.learner.learner import Learner
from fr_jax.learner.metrics import read_jsonl
from fr_jax.models import decoder, registry
from fr_jax.trajectory import TrajectoryError, validate
from tests import learner_driver
from tests.helpers import batches, forward, max_diff, tiny_config


def test_mesh_4x2_equals_single_device():
  data = batches(3)
  # lr 1e-3: Adam turns float-reordering noise in near-zero gradients into sign flips of
  # size ~lr, so the comparison is meaningful only well below the 1e-5 bound per step.
  single = Learner(tiny_config(**{"optim.lr": 1e-3}), devices=jax.devices()[:1])
  mesh = Learner(tiny_config(**{"optim.lr": 1e-3, "mesh.data": 4, "mesh.fsdp": 2}))
  # Parameters really are split over fsdp and the batch rows over the whole mesh.
  wq = mesh.state.params["layers"]["wq"]
  assert len({str(s.index) for s in wq.addressable_shards}) == 2
  for b in data:
    m1 = single.update(b)
    m8 = mesh.update(b)
    assert m1["grad_norm"] > 0
    assert m8["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-7)
  assert single.version == mesh.version == 3
  assert max_diff(single.params, mesh.params) <= 1e-5
  assert max_diff(single.params, registry.load("tiny-llama").params) > 2e-3  # it trained


def test_optimizer_state_is_sharded_like_the_parameters():
  """Adam's moments are as large as the parameters: with fsdp they must be split the same
  way, or every device holds them whole (they were replicated: zeros_like carries no
  sharding)."""
  L = Learner(tiny_config(**{"mesh.data": 2, "mesh.fsdp": 4}))
  params = L.state.params
  moments = [x for x in jax.tree.leaves(L.state.opt_state) if np.ndim(x) > 0]
  flat_p = {np.shape(p): p.sharding.spec for p in jax.tree.leaves(params)}
  sharded = 0
  for m in moments:
    assert m.sharding.spec == flat_p[np.shape(m)], (np.shape(m), m.sharding.spec)
    sharded += m.sharding.spec != jax.sharding.PartitionSpec()
  assert sharded >= 2 * len(jax.tree.leaves(params["layers"]))  # mu and nu of every layer
  L.close()


def test_update_compiled_from_shapes_is_the_learners_own():
  """compile_update_from_shapes (what a config too large for this machine needs per device)
  builds the program the Learner runs: same per-device memory and FLOPs as the executable
  the Learner compiled for a real batch of the same shape, on the same 2 x 4 mesh."""
  from fr_jax.learner.compile import compile_update_from_shapes
  c = tiny_config(**{"mesh.data": 2, "mesh.fsdp": 4})
  L = Learner(c)
  L.update(batches(1, prompt_len=(30, 60), median_completion=12)[0])  # short actions
  ((kind, shape, width, _), (exe, _)), = L._compiled.items()
  assert width < shape[1]  # the head scored a bucket of positions, not the whole row
  abstract, mesh, head = compile_update_from_shapes(
      c, registry.load("tiny-llama").config, shape[0], action_fraction=width / shape[1])
  assert dict(mesh.shape) == {"data": 2, "fsdp": 4} and kind == "update" and head == width
  m1, m2 = exe.memory_analysis(), abstract.memory_analysis()
  for f in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"):
    assert getattr(m1, f) == getattr(m2, f), f
  assert exe.cost_analysis()["flops"] == abstract.cost_analysis()["flops"]
  L.close()


def test_equal_learners_share_one_compiled_update_and_different_ones_do_not():
  """Programs are shared process-wide by what they depend on: a second learner of the same
  config compiles nothing and makes the same update bit for bit; a learner with another
  delta (a step-config field) compiles its own program and updates differently. Another
  learning rate (an optimizer field), mesh or bucket is another key."""
  from fr_jax.learner.programs import PROGRAMS as programs
  (b,) = batches(1)

  def run(**kw):
    before = programs.compiles
    L = Learner(tiny_config(**kw), devices=jax.devices()[:1])
    return L, L.update(b), programs.compiles - before

  a, ma, na = run(**{"optim.lr": 2e-2})  # a config no other test compiles first
  assert na == 1  # one bucket, one micro-batch: the update program
  a2, ma2, na2 = run(**{"optim.lr": 2e-2})
  assert na2 == 0
  assert ma2["loss"] == ma["loss"] and max_diff(a.params, a2.params) == 0.0
  c, mc, nc = run(**{"optim.lr": 2e-2, "objective.delta": 1e-3})
  assert nc == 1 and max_diff(c.params, a.params) > 0

  def key(L):
    _, stats, dbs = L._micro_batches(b, 0.0, None)
    return L._program_key("update", (L.state, None, dbs[-1], stats))

  assert key(a2) == key(a)
  for kw in ({"optim.lr": 1e-3}, {"mesh.data": 2}, {"packing.row_buckets": (16,)}):
    other = Learner(tiny_config(**{"optim.lr": 2e-2, **kw}),
                    devices=jax.devices()[:2 if "mesh.data" in kw else 1])
    assert key(other) != key(a), kw


def test_grad_accumulation_over_4_micro_batches_equals_one_pass():
  (b,) = batches(1, fixed_completion=40)  # 45-56 tokens each: one per 64-token row
  L1 = Learner(tiny_config(**{"packing.row_len": 64}))
  L4 = Learner(tiny_config(**{"packing.row_len": 64, "packing.row_buckets": (2,)}))
  (n1, g1), (n4, g4) = L1.accumulated(b), L4.accumulated(b)
  assert n1 == 1 and n4 == 4
  assert float(optim.optax.tree.norm(g1["grads"])) > 0
  assert max_diff(g1["grads"], g4["grads"]) <= 1e-5
  assert float(g1["sums"]["loss"]) == pytest.approx(float(g4["sums"]["loss"]), abs=1e-6)
  # End to end: the learner with 2-row buckets makes the same update as with 8-row ones.
  m1, m4 = L1.update(b), L4.update(b)
  assert m1["micro_batches"] == 1 and m4["micro_batches"] == 4
  assert max_diff(L1.params, L4.params) <= 1e-5


def test_restart_equals_uninterrupted_run(tmp_path):
  N = 3
  assert learner_driver.train(str(tmp_path / "a"), 2 * N) == 2 * N  # uninterrupted
  assert learner_driver.train(str(tmp_path / "b"), N) == N
  # A new process: restores params, optimizer and data stream, and trains on.
  r = subprocess.run([sys.executable, "-m", "tests.learner_driver",
                      f"--workdir={tmp_path / 'b'}", f"--until={2 * N}"],
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  states = {}
  for name in ("a", "b"):
    learner = Learner(learner_driver.config(str(tmp_path / name)))
    learner.restore()
    states[name] = learner.state
    learner.close()
  assert int(states["a"].step) == int(states["b"].step) == 2 * N
  assert max_diff(states["a"].params, states["b"].params) == 0.0
  assert max_diff(states["a"].opt_state, states["b"].opt_state) == 0.0
  ids = {n: [r["traj_ids"] for r in read_jsonl(tmp_path / n / "metrics.jsonl")]
         for n in ("a", "b")}
  assert len(ids["b"]) == 2 * N and ids["a"] == ids["b"]
  flat = [i for step_ids in ids["b"] for i in step_ids]
  assert len(flat) == len(set(flat))  # nothing repeated


def test_compile_count_over_50_ragged_steps_is_at_most_the_buckets():
  """At most one program per (row bucket, head width): the head buckets and the full head."""
  c = tiny_config(**{"packing.row_buckets": (2, 4, 6, 8), "optim.lr": 1e-4})
  learner = Learner(c)
  shapes = set()
  for b in batches(50, seed=3, median_completion=20.0, sigma=0.9):
    m = learner.update(b, log_ids=False)
    shapes.add(m["micro_batches"])
  assert learner.version == 50
  widths = {k[2] for k in learner._compiled}
  assert widths <= {math.ceil(f * 128) for f in c.packing.head_buckets} | {128}
  assert learner.compile_count <= len(c.packing.row_buckets) * (len(c.packing.head_buckets) + 1)
  assert learner.compile_count >= 2  # the raggedness did reach several buckets


def test_non_finite_batch_is_skipped_and_state_unchanged(tmp_path):
  learner = Learner(tiny_config(**{"objective.trust": "none", "log.dir": str(tmp_path)}))
  good, bad = batches(2)
  learner.update(good)
  before = jax.tree.map(jnp.copy, learner.state)
  bad[2].reward = 3e38  # finite in float32, so valid; A_i * grad overflows
  m = learner.update(bad)
  assert m["finite"] is False and m["skipped_total"] == 1
  assert m["skipped_traj_ids"] == [x.traj_id for x in bad]
  assert learner.version == 1
  assert max_diff(before.params, learner.state.params) == 0.0
  assert max_diff(before.opt_state, learner.state.opt_state) == 0.0
  rows = read_jsonl(tmp_path / "metrics.jsonl")  # no update row for the skipped step
  assert [r["step"] for r in rows if "loss" in r] == [1]
  assert [r["step"] for r in rows if "skipped/loss" in r] == [1]
  # Group testing names the offender without touching the state.
  assert learner.find_offenders(bad) == [2]
  bad[5].reward = -3e38
  assert learner.find_offenders(bad) == [2, 5]
  assert learner.version == 1 and max_diff(before.params, learner.state.params) == 0.0
  m = learner.update(batches(1, seed=9)[0])  # and training continues
  assert m["finite"] and learner.version == 2


def _reference_loss(params, cfg, inputs_BxL, targets_BxL, mask_BxL, blogp_BxL, A_B,
                    clip_eps=None):
  """The batch objective written out from the paper's formulas over a plain decoder forward
  pass, one trajectory per row (no packing, no fr_jax.objective):
  -(1/B) sum_i (1/T_i) sum_t over action tokens of
    FlashREINFORCE (clip_eps None): sg(rho_it) A_i log pi_it   (no gate: delta = inf)
    PPO-clip (GRPO):                min(rho_it A_i, clip(rho_it, 1 -+ eps) A_i)
  with rho = pi / mu, at temperature 1."""
  B, L = inputs_BxL.shape
  h, _ = forward(params, cfg, inputs_BxL, jnp.broadcast_to(jnp.arange(L), (B, L)))
  logp_all = jax.nn.log_softmax(decoder.logits_from_hidden(params, cfg, h), -1)
  logp = jnp.take_along_axis(logp_all, targets_BxL[..., None], -1)[..., 0]
  rho = jnp.exp(logp - blogp_BxL)
  A = A_B[:, None]
  if clip_eps is None:
    per_token = jax.lax.stop_gradient(rho) * A * logp
  else:
    per_token = jnp.minimum(rho * A, jnp.clip(rho, 1 - clip_eps, 1 + clip_eps) * A)
  per_traj = jnp.where(mask_BxL, per_token, 0.0).sum(1) / mask_BxL.sum(1)
  return -per_traj.sum() / B


_reference_value_and_grad = jax.jit(jax.value_and_grad(_reference_loss),
                                    static_argnames=("cfg", "clip_eps"))


def reference_loss_and_grad_norm(params, cfg, trajs, adv, clip_eps=None):
  """(loss, global gradient norm) of `_reference_loss`. Each trajectory sits alone in its row,
  padded at the end (causal attention: the padding changes nothing before it)."""
  L = max(t.length for t in trajs) - 1
  inputs, targets = np.zeros((2, len(trajs), L), np.int32)
  mask, blogp = np.zeros((len(trajs), L), bool), np.zeros((len(trajs), L), np.float32)
  for i, t in enumerate(trajs):
    seq = np.concatenate([t.prompt_tokens, t.completion_tokens])
    P, C = len(t.prompt_tokens), len(t.completion_tokens)
    inputs[i, :len(seq) - 1] = seq[:-1]
    targets[i, P - 1:P - 1 + C] = t.completion_tokens  # position P-1+j predicts token j
    mask[i, P - 1:P - 1 + C] = t.action_mask
    blogp[i, P - 1:P - 1 + C] = t.behavior_logp
  loss, g = _reference_value_and_grad(params, cfg, inputs, targets, mask, blogp,
                                      np.asarray(adv, np.float32), clip_eps=clip_eps)
  return float(loss), math.sqrt(sum(float(np.sum(np.square(np.asarray(x, np.float64))))
                                    for x in jax.tree.leaves(g)))


def test_sequential_minibatches_use_the_whole_batch_mean(tmp_path):
  b = batches(1, B=8)[0]
  for i, t in enumerate(b):
    t.reward = 1.0 if i < 4 else 0.0  # minibatch 1: all ones; minibatch 2: all zeros
  # lr 0: both minibatches are scored at the same parameters (AdamW moves nothing).
  learner = Learner(tiny_config(batch_size=4, minibatches=2,
                                **{"optim.lr": 0.0, "log.dir": str(tmp_path)}))
  params, cfg = jax.device_get(learner.params), learner.model_config
  learner.update(b)
  assert learner.version == 2
  learner.close()
  rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
  assert [r["step"] for r in rows] == [1, 2]
  # The whole batch's mean reward is 1/2, so A = +1/2 on minibatch 1 and -1/2 on minibatch 2
  # (per-minibatch baselines would make both 0: no gradient).
  for row, chunk, A in ((rows[0], b[:4], 0.5), (rows[1], b[4:], -0.5)):
    want_loss, want_norm = reference_loss_and_grad_norm(params, cfg, chunk, [A] * 4)
    assert row["loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert row["grad_norm"] == pytest.approx(want_norm, rel=1e-4)
    assert want_norm > 1e-3


def test_grpo_mode_uses_group_advantages():
  b = batches(1, B=8)[0]
  for i, t in enumerate(b):  # 4 prompts, 2 samples each
    t.prompt_id = f"q{i // 2}"
  learner = Learner(tiny_config(**{"objective.loss": "grpo"}))
  for t in b:
    t.reward = 1.0  # equal rewards inside every group: all advantages 0
  assert learner.update(b)["grad_norm"] == 0.0
  for i, t in enumerate(b):
    t.reward = float(i % 2)
  adv = learner._grpo_advantages(b)
  # Each group (0, 1): mean 1/2, unbiased std sqrt(1/2) -> A = -+ (1/2) / (sqrt(1/2) + 1e-6).
  a = 0.5 / (math.sqrt(0.5) + 1e-6)
  np.testing.assert_allclose(adv, [-a, a] * 4, rtol=1e-5)
  # The update's loss and gradient are PPO-clip's with those hand-derived advantages.
  params, cfg = jax.device_get(learner.params), learner.model_config
  m = learner.update(b)
  want_loss, want_norm = reference_loss_and_grad_norm(params, cfg, b, [-a, a] * 4,
                                                      clip_eps=0.2)
  assert m["loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
  assert m["grad_norm"] == pytest.approx(want_norm, rel=1e-4)
  assert want_norm > 1e-3
  learner.close()


def test_schedule_warmup_then_cosine_to_min_ratio():
  c = lcfg.default_config().optim
  c.lr, c.total_steps, c.warmup_frac, c.min_lr_ratio = 1e-3, 100, 0.1, 0.1
  s = optim.schedule(c)
  assert float(s(0)) == 0.0
  assert float(s(5)) == pytest.approx(0.5e-3)
  assert float(s(10)) == pytest.approx(1e-3)
  mid = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * 45 / 90))
  assert float(s(55)) == pytest.approx(mid, rel=1e-5)
  assert float(s(100)) == pytest.approx(1e-4)
  mask = optim.decay_mask(registry.load("tiny-qwen2").params)
  assert mask["layers"]["wq"] and not mask["layers"]["bq"] and not mask["final_norm"]


def test_metric_files_jsonl_and_tensorboard(tmp_path):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  learner = Learner(tiny_config(**{"log.dir": str(tmp_path)}))
  data = batches(2)
  for b in data:
    learner.update(b)
  learner.close()
  rows = read_jsonl(tmp_path / "metrics.jsonl")
  # every record of each update, in batch order, for analyses by task (JSONL only)
  for r, b in zip(rows, data):
    assert r["traj_ids"] == [t.traj_id for t in b]
    assert r["traj_prompt_ids"] == [t.prompt_id for t in b]
    assert r["traj_rewards"] == [float(t.reward) for t in b]
    assert r["traj_tool_calls"] == [t.num_tool_calls for t in b]
    assert r["traj_action_tokens"] == [int(t.action_mask.astype(int).sum()) for t in b]
  need = {"loss", "acceptance_rate", "kl_proxy_mean", "kl_proxy_max", "ratio_mean",
          "ratio_max", "entropy", "grad_norm", "lr", "tokens", "packing_efficiency",
          "policy_lag_mean", "policy_lag_max", "step_time_s", "tokens_per_s", "mfu"}
  assert [r["step"] for r in rows] == [1, 2] and need <= set(rows[0])
  assert rows[1]["policy_lag_max"] == 1  # synthetic trajectories carry version 0
  ea = EventAccumulator(str(tmp_path / "tb"))
  ea.Reload()
  assert need <= set(ea.Tags()["scalars"])
  assert [e.step for e in ea.Scalars("loss")] == [1, 2]


def test_checkpoint_keep_and_export(tmp_path):
  learner = Learner(tiny_config(**{"checkpoint.dir": str(tmp_path / "c"), "checkpoint.every": 2,
                                   "checkpoint.keep": 2}))
  for i, b in enumerate(batches(6)):
    learner.update(b)
    learner.save(data_state={"i": i})
  learner.checkpointer.wait()
  assert sorted(learner.checkpointer.manager.all_steps()) == [4, 6]
  out = learner.export_hf(tmp_path / "hf")
  again = registry.load(f"hf:{out}")
  assert max_diff(jax.device_get(learner.params), again.params) == 0.0
  learner.close()
  with pytest.raises(FileNotFoundError):
    Checkpointer(str(tmp_path / "empty")).restore(learner.state)


def test_config_errors_name_the_field():
  with pytest.raises(lcfg.ConfigError, match="objective.trust='seq'"):
    Learner(tiny_config(**{"objective.trust": "seq"}))
  with pytest.raises(lcfg.ConfigError, match="multiples of the mesh size"):
    Learner(tiny_config(**{"mesh.data": 4, "packing.row_buckets": (2, 4)}))
  learner = Learner(tiny_config())
  with pytest.raises(ValueError, match="needs batch_size"):
    learner.update(batches(1, B=5)[0])
  bad = batches(1)[0]
  bad[2].reward = float("nan")
  # Records are validated where they are admitted (the service), not again by update():
  # there the record is refused with its reason; a batch that gets past admission anyway
  # is caught by the update's non-finite guard, which applies nothing.
  with pytest.raises(TrajectoryError, match="nonfinite_reward"):
    validate(bad[2], **learner.record_limits)
  m = learner.update(bad)
  assert not m["finite"] and bad[2].traj_id in m["skipped_traj_ids"]
  assert learner.version == 0
  json.dumps(learner.config.to_dict())  # the config is checkpointable as JSON
