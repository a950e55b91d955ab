"""Rollout routing replay end to end on the embedded engine: the experts the engine records are
the ones its forward passes used (prefill, decode, reused prefixes, a weight swap mid-request),
the agent puts them in the record, and the learner scoring with them reproduces the engine's
expert choice where its own routers would choose others."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fr_jax import envs
from fr_jax.models import decoder, registry, scoring
from fr_jax.packing import PackingSpec, pack
from fr_jax.rollout.agent import AgentConfig, AgentLoop
from fr_jax.rollout.embedded import EmbeddedEngine
from fr_jax.rollout.engine import Request
from fr_jax.trajectory import validate
from tests.helpers import forward

# One engine shape for every test here: its prefill and decode steps compile once per process.
ENGINE = dict(num_slots=4, max_len=128)


def sharp(params, scale=20.0, experts=8.0):
  """The same model with routers 20x sharper (top-k decisions far from ties, so cached
  decoding and a packed forward, in different float orders, choose the same experts) and
  experts 8x stronger (which experts run matters to the log-probs)."""
  moe = {k: v * (scale if k == "router" else experts) for k, v in params["moe"].items()}
  return {**params, "moe": moe}


@pytest.fixture(scope="module")
def moe():
  m = registry.load("tiny-qwen3-moe", seed=3)
  return m.config, sharp(m.params)


def packed_routing(params, cfg, seq):
  """Experts of positions 0..len(seq)-2 from one packed forward (the learner's)."""
  seq = np.asarray(seq)
  _, _, r = forward(params, cfg, seq[None, :-1], np.arange(len(seq) - 1)[None],
                            routing_out=True)
  return np.asarray(r.experts[0])


def same_sets(a, b):
  return np.array_equal(np.sort(np.asarray(a, np.int64), -1), np.sort(np.asarray(b, np.int64), -1))


def test_engine_records_the_experts_its_forward_used(moe):
  cfg, params = moe
  eng = EmbeddedEngine(cfg, params, **ENGINE)
  rng = np.random.default_rng(0)
  reqs = [Request(f"r{i}", rng.integers(0, 256, int(rng.integers(3, 30))).tolist(),
                  max_new_tokens=int(rng.integers(2, 20)), seed=i, routed_experts_start=0)
          for i in range(4)]
  for r, c in zip(reqs, eng.generate(reqs)):
    seq = r.prompt_ids + c.token_ids
    assert c.routed_experts.shape == (len(seq) - 1, *cfg.routing_shape)
    assert c.routed_experts.dtype == np.int8
    assert same_sets(c.routed_experts, packed_routing(params, cfg, seq))
  # Without routed_experts_start nothing is reported; a dense model refuses the request.
  (c,) = eng.generate([Request("n", [1, 2, 3], 4)])
  assert c.routed_experts is None
  dense = registry.load("tiny-qwen3")
  with pytest.raises(ValueError, match="dense"):
    EmbeddedEngine(dense.config, dense.params, num_slots=1, max_len=32).generate(
        [Request("d", [1, 2], 2, routed_experts_start=0)])


def test_a_reused_prefix_reports_the_routing_its_entries_were_computed_with(moe):
  cfg, params = moe
  eng = EmbeddedEngine(cfg, params, **ENGINE)
  p = list(range(5, 25))
  (c1,) = eng.generate([Request("t1", p, 6, seed=1, routed_experts_start=0)])
  nxt = p + c1.token_ids + [7, 8, 9]
  known = len(p) + len(c1.token_ids) - 1
  before = eng.stats["reused_tokens"]
  # Ask from position 3 (inside the reused prefix) to read rows the slot kept.
  (c2,) = eng.generate([Request("t2", nxt, 6, seed=2, routed_experts_start=3)])
  assert eng.stats["reused_tokens"] - before == known
  full = packed_routing(params, cfg, nxt + c2.token_ids)
  assert c2.routed_experts.shape[0] == len(nxt) + len(c2.token_ids) - 1 - 3
  assert same_sets(c2.routed_experts, full[3:])
  assert np.array_equal(c2.routed_experts[:known - 3], c1.routed_experts[3:known])


def test_weight_swap_mid_request_keeps_the_experts_that_ran(moe):
  cfg, params = moe
  other = sharp(registry.load("tiny-qwen3-moe", seed=9).params)
  eng = EmbeddedEngine(cfg, params, **ENGINE)
  r = Request("s", [3, 1, 4, 1, 5, 9, 2, 6], max_new_tokens=12, seed=7, routed_experts_start=0)
  steps = []

  def hook():
    steps.append(1)
    if len(steps) == 5:
      eng.update_weights(other, 1)
    return False

  c = eng.generate([r], should_abort=hook)[0]
  assert c.versions == [0] * 5 + [1] * 7
  P, seq = len(r.prompt_ids), r.prompt_ids + c.token_ids
  old = P + 4  # the prompt and tokens 0-3 were fed to the old weights
  # Reference: the old weights write the cache for positions < old, the new ones decode on.
  cache = decoder.init_cache(cfg, 1, 64)
  toks = np.asarray(seq[:-1])[None]
  _, cache, r0 = forward(params, cfg, toks[:, :old], np.arange(old)[None], cache=cache,
                                 routing_out=True)
  _, _, r1 = forward(other, cfg, toks[:, old:], np.arange(old, len(seq) - 1)[None],
                             cache=cache, routing_out=True)
  want = np.concatenate([np.asarray(r0.experts[0]), np.asarray(r1.experts[0])])
  assert same_sets(c.routed_experts, want)
  # Rows before the swap are the old model's; after it, not the new model's full re-prefill.
  assert same_sets(c.routed_experts[:old], packed_routing(params, cfg, seq)[:old])
  assert not same_sets(c.routed_experts[old:], packed_routing(other, cfg, seq)[old:])


def test_agent_records_carry_routing_and_an_unread_tail_is_cut(moe):
  cfg, params = moe
  m = registry.load("tiny-chat-moe", seed=3)
  params = sharp(m.params)
  env = envs.make("textworld")
  eng = EmbeddedEngine(m.config, params, tokenizer=m.tokenizer, num_slots=2, max_len=1024)
  loop = AgentLoop(eng, m.tokenizer, env, AgentConfig(max_turns=3, max_new_tokens=10,
                                                      max_total_tokens=1024, template="chatml",
                                                      record_routing=True))
  # A random model seldom samples the one stop token within a turn, and a turn cut at
  # max_new_tokens ends the episode: half the vocabulary stops a turn here, so episodes take
  # several short turns (each a request whose prompt extends the last: prefix reuse).
  loop.stop_ids = tuple(range(160))
  tasks = [env.task("train", i) for i in range(2)]
  trajs, eps = loop.run(tasks, [1, 2])
  routing = (*m.config.routing_shape, m.config.num_experts)
  for t in trajs:
    assert t.num_turns == 3  # multi-turn: observations between the turns
    validate(t, routing=routing)
    assert same_sets(t.routed_experts, packed_routing(params, m.config, t.tokens))
  # An episode whose last request was aborted before it started: the observation appended
  # after its previous turn was never read, so the record drops it (no action is lost).
  ep = loop.start(tasks[0])
  loop.step([ep], [5])
  assert not ep.done and not ep.mask[-1]
  loop.step([ep], [5], should_abort=lambda: True)
  t = loop.trajectory(ep)
  assert ep.finish_reason == "abort" and t.length < ep.length
  assert t.num_action_tokens == sum(ep.mask)
  validate(t, routing=routing)


def test_replay_pins_the_recorded_experts_where_the_routers_moved(moe):
  """The acceptance figure: move the routers a little (2e-3 x noise), so that only near-ties
  flip. Without replay the flipped positions' log-probs jump (other experts run); with replay
  the learner's experts equal the recorded ones everywhere and the log-probs move only with
  the gate weights, in proportion to the move."""
  cfg, params = moe
  eng = EmbeddedEngine(cfg, params, **ENGINE)
  rng = np.random.default_rng(1)
  reqs = [Request(f"q{i}", rng.integers(0, 256, 12).tolist(), 24, seed=i,
                  routed_experts_start=0) for i in range(4)]
  outs = eng.generate(reqs)
  from fr_jax.trajectory import Trajectory
  trajs = [Trajectory(r.request_id, np.asarray(r.prompt_ids), np.asarray(c.token_ids),
                      np.ones(len(c.token_ids), bool), np.asarray(c.logprobs, np.float32), 0.0,
                      0, routed_experts=c.routed_experts) for r, c in zip(reqs, outs)]
  (b,) = pack(trajs, PackingSpec(128, (4,), 2), cfg.routing_shape).batches
  noise = jax.random.normal(jax.random.key(5), params["moe"]["router"].shape)
  moved = {**params, "moe": {**params["moe"], "router": params["moe"]["router"] + 2e-3 * noise}}

  def score(p, routes):
    lp, _, r = scoring.score_packed(p, cfg, b.tokens, b.targets, b.positions, b.segment_ids,
                                    routes=routes, routing_out=True)
    return np.asarray(lp), np.asarray(r.experts), np.asarray(r.drift)

  act = b.action_mask
  lp0, _, _ = score(params, None)
  np.testing.assert_allclose(lp0[act], b.behavior_logp[act], atol=1e-4)  # lag 0: the engine's
  lp_free, own, _ = score(moved, None)
  lp_replay, used, drift = score(moved, jnp.asarray(b.routes))
  flipped = act & np.any(np.sort(own, -1) != np.sort(b.routes, -1), axis=(-2, -1))
  assert 0 < flipped.sum() < 0.5 * act.sum()  # a small move flips the near-ties only
  # Under replay the routers still see where they would go (the drift metric), though every
  # layer uses the recorded experts.
  assert (drift & act).sum() > 0
  assert np.array_equal(used[act], b.routes[act].astype(np.int32))  # replay: recorded experts
  free = np.abs(lp_free - b.behavior_logp)[flipped]
  replay = np.abs(lp_replay - b.behavior_logp)[flipped]
  print(f"\nflipped {int(flipped.sum())} of {int(act.sum())} action positions; mean |dlogp| on"
        f" them: without replay {free.mean():.4f}, with replay {replay.mean():.4f}")
  assert replay.mean() < 0.5 * free.mean()


@pytest.mark.parametrize("replay", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_learner_routing_metrics_equal_a_per_record_recomputation(moe, replay):
  """routing_drift and the with/without-replay mismatch per lag bucket, from the update step,
  against forwards of each record on its own (no packing), with and without its routes."""
  import math

  from fr_jax.learner import config as lcfg
  from fr_jax.learner.learner import Learner
  from fr_jax.models.registry import LoadedModel
  from fr_jax.trajectory import Trajectory
  cfg, params = moe
  eng = EmbeddedEngine(cfg, params, **ENGINE)
  rng = np.random.default_rng(2)
  reqs = [Request(f"m{i}", rng.integers(0, 256, int(rng.integers(4, 12))).tolist(), 12,
                  seed=i, routed_experts_start=0) for i in range(4)]
  trajs = [Trajectory(r.request_id, np.asarray(r.prompt_ids), np.asarray(c.token_ids),
                      np.ones(len(c.token_ids), bool), np.asarray(c.logprobs, np.float32),
                      float(i % 2), 0, routed_experts=c.routed_experts)
           for i, (r, c) in enumerate(zip(reqs, eng.generate(reqs)))]
  noise = jax.random.normal(jax.random.key(6), params["moe"]["router"].shape)
  moved = {**params, "moe": {**params["moe"], "router": params["moe"]["router"] + 3e-3 * noise}}
  c = lcfg.default_config()
  c.model.name, c.batch_size = "given", 4
  c.packing.row_len, c.packing.row_buckets = 128, (2,)
  c.objective.delta, c.optim.lr, c.log.peak_flops = math.inf, 0.0, 1e11
  c.routing_replay, c.log.routing_counterfactual = replay, True
  learner = Learner(lcfg.validate(c), model=LoadedModel("given", cfg, moved, None, "", 0.0),
                    devices=jax.devices()[:1])
  lags = [0, 0, 5, 5]
  m = learner.update(trajs, lags=lags)
  # Per record, alone in a row (padding is segment 0, so the record sees only itself; one
  # compiled length): |delta log p| with and without replay, and drifted action positions.
  W = 64

  @functools.partial(jax.jit, static_argnums=3)
  def one(toks, seg, routes, with_routes):
    h, _, r = forward(moved, cfg, toks[None], jnp.arange(W)[None], seg[None],
                              routes=routes[None] if with_routes else None, routing_out=True)
    return decoder.logits_from_hidden(moved, cfg, h)[0], r.experts[0], r.drift[0]

  want = {}
  for t, lag in zip(trajs, lags):
    seq = t.tokens
    n = len(seq) - 1
    toks, seg = np.zeros(W, np.int32), (np.arange(W) < n).astype(np.int32)
    toks[:n] = seq[:-1]
    routes = np.zeros((W, *cfg.routing_shape), np.int32) + np.arange(cfg.num_experts_per_tok)
    routes[:n] = t.routed_experts
    rows = {}
    for name in ("with", "without"):
      z, experts, drift_r = one(toks, seg, routes, name == "with")
      z = np.asarray(z, np.float64)[:n]
      lp = z[np.arange(n), seq[1:]] - np.log(np.exp(z).sum(-1))
      rows[name] = np.abs(lp[len(t.prompt_tokens) - 1:] - t.behavior_logp)
      if name == ("with" if replay else "without"):
        drift = np.asarray(drift_r)[:n] if replay else np.any(
            np.sort(np.asarray(experts)[:n], -1) != np.sort(t.routed_experts, -1), axis=(-2, -1))
        rows["drift"] = drift[len(t.prompt_tokens) - 1:]
    bucket = "0" if lag == 0 else "4plus"
    for k, v in rows.items():
      want.setdefault((bucket, k), []).append(v)
  n_all = sum(t.num_action_tokens for t in trajs)
  drift_all = sum(v.sum() for (_, k), vs in want.items() if k == "drift" for v in vs)
  np.testing.assert_allclose(m["routing_drift"], drift_all / n_all, atol=1e-6)
  for bucket in ("0", "4plus"):
    n = sum(v.size for v in want[(bucket, "with")])
    np.testing.assert_allclose(m[f"mismatch/lag_{bucket}/routing_drift"],
                               sum(v.sum() for v in want[(bucket, "drift")]) / n, atol=1e-6)
    for k in ("with", "without"):
      np.testing.assert_allclose(m[f"mismatch/lag_{bucket}/abs_dlogp_{k}_replay"],
                                 sum(v.sum() for v in want[(bucket, k)]) / n, rtol=1e-3,
                                 atol=1e-5)
    own = "with" if replay else "without"
    key = f"mismatch/lag_{bucket}/abs_dlogp"
    assert m[key] == m[f"{key}_{own}_replay"]
  assert m["routing_drift"] > 0
