"""The LM head over action positions only (`packing.action_index`, `scoring.score_packed`)
against the full head, which scores every position: the loss, every gradient and every value
the update's metrics are built from, within 1e-5 in f32, for FlashREINFORCE (with the trust
gate acting), GRPO and SFT, on a dense model and on an MoE model whose records carry routing
(replayed, and scored the other way for the drift metrics)."""

import dataclasses

import jax
import numpy as np
import pytest

from fr_jax import objective as obj
from fr_jax.learner import compile as compiling
from fr_jax.learner import config as lcfg
from fr_jax.learner import step
from fr_jax.models import registry, scoring
from fr_jax.packing import pack
from tests.helpers import batches, max_diff, tiny_config
from tests.test_moe_learner import with_own_routing


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-moe"])
def test_action_head_equals_the_full_head(name):
  model = registry.load(name)
  # Agent-like records: long prompts, short actions.
  trajs = batches(1, B=8, seed=3, prompt_len=(30, 60), median_completion=12)[0]
  if model.config.is_moe:
    trajs = with_own_routing(trajs, model)
  # GRPO on the dense model only: the MoE's routes reach every loss the same way, and its
  # GRPO case cost about 40 s of CI's (a third of this model's share).
  for loss in ("flash_reinforce", "sft") + (() if model.config.is_moe else ("grpo",)):
    c = lcfg.ensure_valid(tiny_config(**{
        "model.name": name, "objective.loss": loss, "log.routing_counterfactual": True}))
    mc = compiling.learner_model_config(c, model.config)
    sc = compiling.step_config(c, mc)
    spec = lcfg.packing_spec(c)
    (b,), _, _ = pack(trajs, spec, mc.routing_shape if mc.is_moe else None)
    # The rows hold fewer action positions than the widest head bucket: the head scores a
    # bucket of K < L positions a row, and every action position is among them.
    K = b.head_width
    assert K < spec.row_len and K == spec.head_width(b.action_mask.sum(1).max())
    picked = np.zeros_like(b.action_mask)
    np.put_along_axis(picked, b.action_index, True, axis=1)
    assert (picked >= b.action_mask).all() and len(set(map(tuple, b.action_index))) > 0
    params = jax.tree.map(lambda x: x.astype(np.float32), model.params)
    # Behaviour log-probs near the model's own, further off for later trajectories, so that
    # the trust gate admits some and refuses others.
    logp, _ = scoring.score_packed(params, mc, b.tokens, b.targets, b.positions, b.segment_ids,
                                   routes=b.routes)
    noise = np.random.default_rng(0).normal(size=b.action_mask.shape) * 0.1 * b.segment_ids
    b = b._replace(behavior_logp=np.where(b.action_mask, np.minimum(logp + noise, 0), 0)
                   .astype(np.float32))
    stats = obj.batch_stats(b.rewards, b.segment_valid, np.asarray(
        obj.segment_sum(b.action_mask.astype(np.float32), b.segment_ids, b.rewards.shape[0])))
    if loss == "flash_reinforce":  # a trust bound between the trajectories' D_i
      _, aux = obj.flash_reinforce_loss_packed(logp, b.behavior_logp, b.action_mask,
                                               b.segment_ids, b.rewards, b.segment_valid)
      sc = dataclasses.replace(sc, delta=float(np.median(aux["seq_kl"][b.segment_valid])))
    # Op by op, not jitted: for these tiny models that is about 4x cheaper than compiling the
    # six programs (17 s against 55-90 s a model).
    def run(p, batch, sc=sc, st=stats):
      return step._grads_and_sums(p, batch, st, sc)

    head = run(params, b)
    full = run(params, b._replace(action_index=None))
    grads, sums, maxes, segment = head
    assert max_diff(head, full) <= 1e-5, (loss, max_diff(head, full))
    # Not vacuous: a gradient flowed, the gate refused some trajectories under
    # FlashREINFORCE, and the MoE's counterfactual pass scored the actions.
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e-4
    assert float(sums["tokens"]) == b.action_mask.sum()
    if loss == "flash_reinforce":
      assert 0 < float(sums["admitted"]) < float(sums["trajectories"]), loss
    if mc.is_moe and loss != "sft":
      assert float(segment["other_abs_dlogp_sum"].sum()) > 0
