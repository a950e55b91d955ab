"""Packing: layout, buckets, errors; packed objective == padded objective; one compile per
bucket; a shard_map mesh run equals the single-device run."""

import functools
import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from fr_jax import objective as obj
from fr_jax.packing import PackingError, PackingSpec, first_fit_decreasing, pack
from fr_jax.trajectory import Trajectory, TrajectoryError, validate


def make_trajs(rng, n, max_prompt=12, max_completion=30, reward_levels=2):
  out = []
  for i in range(n):
    P_ = int(rng.integers(1, max_prompt + 1))
    C = int(rng.integers(1, max_completion + 1))
    mask = rng.random(C) < 0.75
    mask[int(rng.integers(C))] = True
    blogp = np.where(mask, np.log(rng.uniform(0.05, 1.0, C)), 0.0).astype(np.float32)
    out.append(Trajectory(
        prompt_id=f"p{i}", prompt_tokens=rng.integers(0, 1000, P_).astype(np.int32),
        completion_tokens=rng.integers(0, 1000, C).astype(np.int32), action_mask=mask,
        behavior_logp=blogp, reward=float(rng.integers(0, reward_levels)),
        policy_version=int(rng.integers(0, 5))))
  return out


def learner_logp(rng, trajs, drift=0.1):
  """Random learner log-probs per completion token, near the behaviour ones."""
  out = []
  for t in trajs:
    base = np.where(t.action_mask, t.behavior_logp, np.log(0.5))
    out.append(np.minimum(base + drift * rng.standard_normal(base.shape), -1e-3))
  return out


def padded(trajs, lps):
  B, T = len(trajs), max(t.completion_tokens.shape[0] for t in trajs)
  logp = np.zeros((B, T))
  blogp = np.zeros((B, T))
  mask = np.zeros((B, T), bool)
  for i, (t, lp) in enumerate(zip(trajs, lps)):
    C = t.completion_tokens.shape[0]
    logp[i, :C], blogp[i, :C], mask[i, :C] = lp, t.behavior_logp, t.action_mask
  return logp, blogp, np.array([t.reward for t in trajs]), mask


def to_packed(batch, trajs, per_traj, fill):
  """Scatters per-completion-token values into the packed target frame, by hand."""
  out = np.full(batch.tokens.shape, fill, np.float64)
  for (r, c) in zip(*np.nonzero(batch.segment_ids)):
    i = batch.traj_index[batch.segment_ids[r, c] - 1]
    k = batch.positions[r, c] - (trajs[i].prompt_tokens.shape[0] - 1)
    if k >= 0:
      out[r, c] = per_traj[i][k]
  return out


def from_packed(batch, trajs, x, T):
  out = np.zeros((len(trajs), T))
  for (r, c) in zip(*np.nonzero(batch.segment_ids)):
    i = batch.traj_index[batch.segment_ids[r, c] - 1]
    k = batch.positions[r, c] - (trajs[i].prompt_tokens.shape[0] - 1)
    if k >= 0:
      out[i, k] += x[r, c]
  return out


# --- layout ----------------------------------------------------------------------------------

def test_layout_places_every_token_once():
  rng = np.random.default_rng(0)
  trajs = make_trajs(rng, 40)
  spec = PackingSpec(row_len=64, row_buckets=(1, 2, 4, 8), max_segments_per_row=8)
  packed = pack(trajs, spec)
  seen = []
  for b in packed.batches:
    assert b.shape in spec.shapes()
    for s in np.flatnonzero(b.segment_valid):
      i = b.traj_index[s]
      t = trajs[i]
      seen.append(i)
      sel = b.segment_ids == s + 1
      r = np.flatnonzero(sel.any(1))
      assert len(r) == 1  # a trajectory never straddles rows
      cols = np.flatnonzero(sel[r[0]])
      assert np.all(np.diff(cols) == 1)  # contiguous
      seq = t.tokens
      np.testing.assert_array_equal(b.tokens[r[0], cols], seq[:-1])
      np.testing.assert_array_equal(b.targets[r[0], cols], seq[1:])
      np.testing.assert_array_equal(b.positions[r[0], cols], np.arange(len(seq) - 1))
      P_ = t.prompt_tokens.shape[0]
      # Completion token k is scored at position P-1+k; prompt targets are never actions.
      np.testing.assert_array_equal(b.action_mask[r[0], cols][P_ - 1:], t.action_mask)
      assert not b.action_mask[r[0], cols][:P_ - 1].any()
      np.testing.assert_array_equal(b.behavior_logp[r[0], cols][P_ - 1:], t.behavior_logp)
      assert b.rewards[s] == t.reward
      assert b.policy_version[s] == t.min_policy_version
    assert not b.action_mask[b.segment_ids == 0].any()
    assert (b.traj_index[~b.segment_valid] == -1).all()
  assert sorted(seen) == list(range(len(trajs)))
  real = sum(t.length - 1 for t in trajs)
  assert packed.real_tokens == real
  assert packed.buffer_tokens == sum(b.tokens.size for b in packed.batches)
  assert packed.efficiency == pytest.approx(real / packed.buffer_tokens)


def test_first_fit_decreasing_by_hand():
  # Capacity 10: sorted 7,6,4,3,2 -> bins [7,3], [6,4], [2].
  bins = first_fit_decreasing([3, 7, 2, 6, 4], capacity=10, max_items=4)
  assert bins == [[1, 0], [3, 4], [2]]
  # At most 2 items per bin: [7,3]... 3 first fits bin0 -> [7,3],[6,4],[2]; with max 1:
  assert first_fit_decreasing([3, 7, 2], capacity=10, max_items=1) == [[1], [0], [2]]


def test_microbatches_use_the_smallest_bucket_for_the_tail():
  rng = np.random.default_rng(1)
  trajs = make_trajs(rng, 5, max_prompt=2, max_completion=2)
  spec = PackingSpec(row_len=4, row_buckets=(1, 2, 4), max_segments_per_row=1)
  packed = pack(trajs, spec)  # 5 rows of one segment -> 4 + 1
  assert [b.shape[0] for b in packed.batches] == [4, 1]


def test_a_row_holds_max_trajectory_length_and_validation_refuses_longer():
  """Length has one check, admission's (`trajectory.validate` against the learner's
  `max_length`, which is the spec's `max_trajectory_length`); packing trusts it."""
  rng = np.random.default_rng(2)
  t = make_trajs(rng, 1)[0]
  fits = PackingSpec(row_len=t.length - 1, row_buckets=(1,))  # n tokens fit a row of n-1
  assert fits.max_trajectory_length == t.length
  (b,) = pack([t], fits).batches
  assert b.segment_ids.max() == 1 and (b.segment_ids > 0).sum() == t.length - 1
  short = PackingSpec(row_len=t.length - 2, row_buckets=(1,))
  with pytest.raises(TrajectoryError, match=f"length {t.length} .* maximum {t.length - 1}"):
    validate(t, max_length=short.max_trajectory_length)


def test_head_buckets_and_the_action_index_by_hand():
  spec = PackingSpec(row_len=100, head_buckets=(0.125, 0.5))
  # widths ceil(12.5) = 13 and 50; a row with more action positions scores all 100
  assert [spec.head_width(n) for n in (0, 13, 14, 50, 51)] == [13, 13, 50, 50, None]
  assert PackingSpec(row_len=100).head_width(1) is None  # no buckets: the full head
  # One trajectory: prompt of 3, completion of 5 whose 2nd and 4th tokens are tool output.
  # Target-frame positions 2..6 hold the completion; the actions are 2, 4 and 6.
  t = Trajectory("p", np.arange(3, dtype=np.int32), np.arange(5, dtype=np.int32),
                 np.array([1, 0, 1, 0, 1], bool), np.full(5, -1.0, np.float32), 1.0, 0)
  (b,) = pack([t], PackingSpec(row_len=16, row_buckets=(1,), head_buckets=(0.25,))).batches
  assert np.flatnonzero(b.action_mask[0]).tolist() == [2, 4, 6]
  # width 4: the actions in order, then the row's first other position
  assert b.action_index.tolist() == [[2, 4, 6, 0]] and b.head_width == 4
  (b,) = pack([t], PackingSpec(row_len=16, row_buckets=(1,), head_buckets=(0.125,))).batches
  assert b.action_index is None and b.head_width == 16  # 2 positions cannot hold 3 actions


def test_bad_spec():
  with pytest.raises(PackingError, match="ascending"):
    PackingSpec(row_buckets=(4, 2))
  for h in ((0.5, 0.25), (0.25, 1.0), (0.0,)):
    with pytest.raises(PackingError, match="head_buckets"):
      PackingSpec(head_buckets=h)
  with pytest.raises(PackingError, match="empty"):
    pack([], PackingSpec())


# --- packed objective == padded objective ---------------------------------------------------

def packed_loss_fn(batch, **kw):
  def f(logp):
    return obj.flash_reinforce_loss_packed(
        logp, batch.behavior_logp, batch.action_mask, batch.segment_ids, batch.rewards,
        batch.segment_valid, **kw)
  return f


@pytest.mark.parametrize("reduction,trust,advantage", list(itertools.product(
    ["sample_mean", "token_mean"], ["sequence", "token", "none"],
    ["batch_centered", "positive_only"])) + [("constant_length", "sequence", "batch_centered"),
                                             ("sample_mean", "sequence_negative",
                                              "batch_centered")])
def test_packed_equals_padded(reduction, trust, advantage):
  rng = np.random.default_rng(zlib.crc32(f"{reduction}-{trust}-{advantage}".encode()))
  trajs = make_trajs(rng, 24, reward_levels=3)
  lps = learner_logp(rng, trajs)
  spec = PackingSpec(row_len=48, row_buckets=(24,), max_segments_per_row=8)
  (batch,) = pack(trajs, spec).batches  # 24 rows always hold 24 trajectories
  logp_pad, blogp_pad, rewards, mask = padded(trajs, lps)
  kw = dict(delta=3e-3, reduction=reduction, trust=trust, advantage=advantage,
            length_norm=64.0 if reduction == "constant_length" else None)

  (l_pad, a_pad), g_pad = jax.value_and_grad(
      lambda lp: obj.flash_reinforce_loss(lp, blogp_pad, rewards, mask, **kw),
      has_aux=True)(jnp.asarray(logp_pad, jnp.float32))
  # Prompt positions get garbage log-probs: they are not actions and must not matter.
  logp_packed = to_packed(batch, trajs, lps, fill=-7.0)
  (l_pk, a_pk), g_pk = jax.value_and_grad(packed_loss_fn(batch, **kw), has_aux=True)(
      jnp.asarray(logp_packed, jnp.float32))

  assert 0 < float(a_pad["token_acceptance_rate"]) < 1 or trust == "none"
  np.testing.assert_allclose(l_pk, l_pad, rtol=1e-5, atol=1e-5)
  g_back = from_packed(batch, trajs, np.asarray(g_pk), logp_pad.shape[1])
  np.testing.assert_allclose(g_back, g_pad, atol=1e-5)
  # Nothing else in the packed buffer receives gradient.
  assert np.abs(np.asarray(g_pk)).sum() == pytest.approx(np.abs(g_back).sum(), rel=1e-5)
  idx = batch.traj_index[batch.segment_valid]
  for k in ("advantages", "seq_kl", "admitted", "num_action_tokens"):
    np.testing.assert_allclose(np.asarray(a_pk[k])[batch.segment_valid],
                               np.asarray(a_pad[k])[idx], atol=1e-5, err_msg=k)
  for k in ("acceptance_rate", "token_acceptance_rate", "seq_kl_mean", "seq_kl_max",
            "ratio_mean", "ratio_max", "ratio_min", "token_kl_mean"):
    np.testing.assert_allclose(a_pk[k], a_pad[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_packed_ppo_equals_padded():
  rng = np.random.default_rng(7)
  trajs = make_trajs(rng, 16)
  lps = learner_logp(rng, trajs, drift=0.4)
  (batch,) = pack(trajs, PackingSpec(row_len=48, row_buckets=(12,))).batches
  logp_pad, blogp_pad, _, mask = padded(trajs, lps)
  adv = rng.standard_normal(len(trajs))
  adv_S = np.zeros(batch.rewards.shape, np.float32)
  adv_S[batch.segment_valid] = adv[batch.traj_index[batch.segment_valid]]
  for reduction in ("sample_mean", "token_mean"):
    (l_pad, _), g_pad = jax.value_and_grad(
        lambda lp, reduction=reduction: obj.ppo_clip_loss(lp, blogp_pad, adv, mask,
                                                          reduction=reduction),
        has_aux=True)(jnp.asarray(logp_pad, jnp.float32))
    (l_pk, _), g_pk = jax.value_and_grad(
        lambda lp, reduction=reduction: obj.ppo_clip_loss_packed(
            lp, batch.behavior_logp, batch.action_mask, batch.segment_ids, adv_S,
            batch.segment_valid, reduction=reduction),
        has_aux=True)(jnp.asarray(to_packed(batch, trajs, lps, -3.0), jnp.float32))
    np.testing.assert_allclose(l_pk, l_pad, rtol=1e-5)
    np.testing.assert_allclose(from_packed(batch, trajs, np.asarray(g_pk), mask.shape[1]),
                               g_pad, atol=1e-6)


def test_one_compile_per_bucket():
  spec = PackingSpec(row_len=64, row_buckets=(4, 8), max_segments_per_row=8)
  traces = []

  @jax.jit
  def step(logp, batch):
    traces.append(1)
    return jax.value_and_grad(packed_loss_fn(batch), has_aux=True)(logp)

  rng = np.random.default_rng(3)
  shapes = set()
  for n, max_c in [(12, 30), (9, 40), (14, 25), (5, 55), (10, 20), (12, 30)]:
    trajs = make_trajs(rng, n, max_completion=max_c)
    for b in pack(trajs, spec).batches:
      shapes.add(b.shape)
      step(jnp.asarray(to_packed(b, trajs, learner_logp(rng, trajs), 0.0), jnp.float32), b)
  assert len(traces) == len(shapes) == step._cache_size()
  assert len(shapes) <= len(spec.row_buckets)


# --- mesh: shard_map over 8 devices equals one device ---------------------------------------

def test_shard_map_equals_single_device():
  n_dev = jax.device_count()
  assert n_dev == 8
  rng = np.random.default_rng(11)
  trajs = make_trajs(rng, 8 * 5, reward_levels=3)
  lps = learner_logp(rng, trajs)
  spec = PackingSpec(row_len=64, row_buckets=(4,), max_segments_per_row=8)
  # Each data shard packs its own trajectories and scores them with the whole batch's
  # normalisers (B, sum R, sum T: what the learner passes every micro-batch); the shards'
  # losses and admitted counts are parts that sum to the whole.
  shards = [trajs[k::8] for k in range(8)]
  shard_lps = [lps[k::8] for k in range(8)]
  batches = [pack(s, spec).batches[0] for s in shards]
  stacked = jax.tree.map(lambda *xs: np.stack(xs), *batches)
  logp = np.stack([to_packed(b, s, lp, -1.0) for b, s, lp in zip(batches, shards, shard_lps)])
  stats = obj.BatchStats(np.float32(len(trajs)),
                         np.float32(sum(t.reward for t in trajs)),
                         np.float32(sum(t.num_action_tokens for t in trajs)))

  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  kw = dict(delta=5e-3, reduction="sample_mean")

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P("data"), P()),
                     out_specs=(P("data"), P("data"), P("data")))
  def sharded(logp, b, stats):
    def local(lp):
      loss, aux = obj.flash_reinforce_loss_packed(
          lp[0], b.behavior_logp[0], b.action_mask[0], b.segment_ids[0], b.rewards[0],
          b.segment_valid[0], stats=stats, **kw)
      return loss, aux
    (loss, aux), g = jax.value_and_grad(local, has_aux=True)(logp)
    return loss[None], g, aux["admitted"].sum()[None]

  # Explicit axis types: inputs are placed with their data sharding before the call.
  shard = jax.sharding.NamedSharding(mesh, P("data"))
  loss, g, admitted = jax.jit(sharded)(jax.device_put(jnp.asarray(logp, jnp.float32), shard),
                                       jax.device_put(stacked, shard), stats)
  loss, acc = np.asarray(loss).sum(), np.asarray(admitted).sum() / len(trajs)

  order = [t for s in shards for t in s]
  order_lps = [lp for s in shard_lps for lp in s]
  logp_pad, blogp_pad, rewards, mask = padded(order, order_lps)
  (want, a_want), g_want = jax.value_and_grad(
      lambda lp: obj.flash_reinforce_loss(lp, blogp_pad, rewards, mask, **kw),
      has_aux=True)(jnp.asarray(logp_pad, jnp.float32))
  assert 0 < float(a_want["acceptance_rate"]) < 1
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  np.testing.assert_allclose(acc, a_want["acceptance_rate"], rtol=1e-6)
  g = np.asarray(g)
  got = np.concatenate([from_packed(b, s, g[k], mask.shape[1])
                        for k, (b, s) in enumerate(zip(batches, shards))])
  np.testing.assert_allclose(got, g_want, atol=1e-6)
