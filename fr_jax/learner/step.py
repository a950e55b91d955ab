"""The pure update: (state, packed micro-batch) -> (state, metrics).

One fresh batch of B trajectories is packed into one or more bucket-shaped micro-batches.
Every micro-batch is scored with the batch's global normalisers (`BatchStats`: B, sum R,
sum T), so its loss and gradient are unreduced parts of the one-batch objective; summing them
gives exactly the one-pass gradient. The last micro-batch applies one optimizer step.

A batch whose loss or gradient norm is not finite applies nothing: the state is kept and
`skipped` is incremented.

Each micro-batch also returns per-trajectory values [S] (`segment` below: the advantage,
the gate's D_i and decision, the sums of |log pi - log mu| and of the Bernoulli KL over the
action tokens, and, for an MoE model whose records carry routing, how many of them drifted:
scored where the learner's own top-k is not the recorded set, and optionally the same sums
scored the other way, with replay or without): the learner splits them on the host by what
only the host knows per record (policy lag, response length; `fr_jax.learner.diagnostics`).

The objective owns every per-token and per-trajectory quantity (its `aux`: log-ratio, ratio,
Bernoulli KL, admitted tokens and trajectories, advantages), for every loss; this step only
sums them, so the metrics describe exactly the tokens the loss used.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fr_jax import objective as obj
from fr_jax.models import lora, scoring
from fr_jax.models.config import ModelConfig


class TrainState(NamedTuple):
  step: jax.Array  # int32: optimizer steps applied (= the policy version of `params`)
  params: Any  # the whole model, LoRA adapters (if any) included
  opt_state: Any  # of the trainable part only (`lora.split`: the adapters, or everything)
  skipped: jax.Array  # int32: batches refused by the non-finite guard


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Everything static the update step closes over (hashable).

  Built from the learner config (`compile.step_config`), which owns every default.
  """

  model: ModelConfig
  loss: str  # flash_reinforce, grpo (batch.rewards then holds advantages) or sft
  delta: float
  reduction: str
  length_norm: float  # reduction=constant_length: L in 1/(B L)
  trust: str
  advantage: str
  clip_eps: float
  clip_eps_high: float
  temperature: float
  remat: bool
  replay: bool  # MoE: score with the batch's recorded experts (batch.routes)
  router_aux_loss_coef: float  # MoE: weight of the routers' load-balancing loss
  # MoE with recorded routing: also score the batch the other way (without replay when
  # replaying, with it when not), for the mismatch metrics of both (one more forward pass).
  routing_counterfactual: bool


def init_state(params, optimizer: optax.GradientTransformation) -> TrainState:
  return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(lora.split(params)[0]),
                    jnp.zeros((), jnp.int32))


# Importance ratios outside [1/RATIO_BAND, RATIO_BAND] are counted (`ratio_outside_frac`).
RATIO_BAND = 2.0

# The per-token Bernoulli KL is also split by the behaviour probability p = mu(token) of the
# sampled token (`d_by_p/<bin>/...`): bins [0, .5), [.5, .9), [.9, .99), [.99, .999), [.999, 1].
# Near p = 1 a small change of p already costs d ~ delta (p .99 -> .98: d = 3.1e-3), so the
# split shows which tokens the gate's budget is spent on.
P_EDGES = (0.5, 0.9, 0.99, 0.999)
P_BINS = ("p0_50", "p50_90", "p90_99", "p99_999", "p999_1")


def _last_action(x_RxL, mask, segment_ids, S):
  """Per-trajectory value [S] of `x` at each trajectory's last action token (0 if it has none):
  for a reply that ended on a stop token, the log-prob of that token."""
  flat = jnp.arange(mask.size, dtype=jnp.int32)
  last = jax.ops.segment_max(jnp.where(mask.reshape(-1), flat, -1), segment_ids.reshape(-1),
                             num_segments=S + 1)[1:]
  return jnp.where(last >= 0, x_RxL.reshape(-1)[jnp.maximum(last, 0)], 0.0)


def _grads_and_sums(params, batch, stats: obj.BatchStats, sc: StepConfig):
  """Gradient (of the trainable part: `lora.split`), metric sums and per-trajectory values
  [S] of one micro-batch's share of the batch objective. With LoRA adapters the frozen base
  weights are constants of the loss: no gradient of theirs is computed."""

  routes = batch.routes if sc.replay else None  # the learner packs routes under replay
  trainable, frozen = lora.split(params)

  def loss_fn(trainable):
    params = lora.join(trainable, frozen)
    logp, entropy, routing = scoring.score_packed(
        params, sc.model, batch.tokens, batch.targets, batch.positions, batch.segment_ids,
        sc.temperature, remat=sc.remat, routes=routes, routing_out=True,
        action_index=batch.action_index)
    if sc.loss == "sft":
      # Supervised: the objective with A_i = 1, rho = 1 and no gate, i.e. the mean over
      # sequences of each one's mean negative log-likelihood of its action tokens (or the
      # token mean with reduction=token_mean). Rewards and behaviour log-probs are unused.
      loss, aux = obj.flash_reinforce_loss_packed(
          logp, jax.lax.stop_gradient(logp), batch.action_mask, batch.segment_ids,
          batch.segment_valid.astype(jnp.float32), batch.segment_valid, delta=float("inf"),
          reduction=sc.reduction, trust="none", advantage="positive_only", stats=stats)
    elif sc.loss == "flash_reinforce":
      loss, aux = obj.flash_reinforce_loss_packed(
          logp, batch.behavior_logp, batch.action_mask, batch.segment_ids, batch.rewards,
          batch.segment_valid, delta=sc.delta, reduction=sc.reduction, trust=sc.trust,
          advantage=sc.advantage, stats=stats, length_norm=sc.length_norm)
    else:
      loss, aux = obj.ppo_clip_loss_packed(
          logp, batch.behavior_logp, batch.action_mask, batch.segment_ids, batch.rewards,
          batch.segment_valid, clip_eps=sc.clip_eps, clip_eps_high=sc.clip_eps_high,
          reduction=sc.reduction, stats=stats, length_norm=sc.length_norm)
    if sc.router_aux_loss_coef:
      loss = loss + sc.router_aux_loss_coef * routing.balance
    return loss, (aux, entropy, routing)

  (loss, (aux, entropy, routing)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
  mask = batch.action_mask
  valid = batch.segment_valid
  f32 = jnp.float32
  n_tok = mask.sum().astype(f32)
  rho, d, token_admitted = aux["ratio"], aux["token_kl"], aux["token_admitted"]
  seq_kl, admitted = aux["seq_kl"], aux["admitted"]
  S = valid.shape[0]
  rho_admitted = jnp.where(token_admitted, rho, 0.0)
  outside = mask & ((rho > RATIO_BAND) | (rho < 1.0 / RATIO_BAND))
  # Routing drift: the positions scoring an action whose learner top-k (the current routers')
  # differs, in some sparse layer, from the experts the engine recorded.
  if batch.routes is None:
    drift = jnp.zeros(mask.shape, bool)
  elif sc.replay:
    drift = routing.drift & mask
  else:
    own, rec = jnp.sort(routing.experts, axis=-1), jnp.sort(batch.routes.astype(jnp.int32), -1)
    drift = jnp.any(own != rec, axis=(-2, -1)) & mask
  sums = {
      "loss": loss,
      "admitted": admitted.sum().astype(f32),
      "trajectories": valid.sum().astype(f32),
      "tokens": n_tok,
      "seq_kl_sum": seq_kl.sum(),
      "ratio_sum": rho.sum(),
      "entropy_sum": jnp.where(mask, entropy, 0.0).sum(),
      "token_kl_sum": d.sum(),
      "ratio_outside": outside.sum().astype(f32),
      "admitted_tokens": token_admitted.sum().astype(f32),
      "admitted_ratio_sum": rho_admitted.sum(),
      "admitted_ratio_sq_sum": (rho_admitted * rho_admitted).sum(),
      "drift_tokens": drift.sum().astype(f32),
      "router_balance": routing.balance,
      "expert_dropped": routing.dropped,
      "expert_pairs": jnp.float32(routing.experts.size),
  }
  p_bin = jnp.searchsorted(jnp.asarray(P_EDGES, f32), jnp.exp(batch.behavior_logp),
                           side="right")
  in_bin = mask[..., None] & (p_bin[..., None] == jnp.arange(len(P_BINS)))  # [R, L, bins]
  sums["p_bin_tokens"] = in_bin.sum((0, 1)).astype(f32)
  sums["p_bin_kl"] = jnp.where(in_bin, d[..., None], 0.0).sum((0, 1))
  sums["p_bin_over_delta"] = (in_bin & (d[..., None] > sc.delta)).sum((0, 1)).astype(f32)
  maxes = {"seq_kl_max": seq_kl.max(), "ratio_max": rho.max()}
  other_abs = other_kl = jnp.zeros(mask.shape, f32)
  if batch.routes is not None and sc.routing_counterfactual and sc.loss != "sft":
    other, _ = scoring.score_packed(params, sc.model, batch.tokens, batch.targets,
                                    batch.positions, batch.segment_ids, sc.temperature,
                                    routes=None if sc.replay else batch.routes,
                                    action_index=batch.action_index)
    other = jax.lax.stop_gradient(other)
    other_abs = jnp.where(mask, jnp.abs(other - batch.behavior_logp), 0.0)
    other_kl = jnp.where(mask, obj.bernoulli_kl(batch.behavior_logp, other), 0.0)
  segment = {
      "advantages": aux["advantages"],
      "seq_kl": seq_kl,
      "admitted": admitted,
      "abs_dlogp_sum": obj.segment_sum(jnp.abs(aux["log_ratio"]), batch.segment_ids, S),
      "token_kl_sum": obj.segment_sum(d, batch.segment_ids, S),
      "drift_sum": obj.segment_sum(drift.astype(f32), batch.segment_ids, S),
      "other_abs_dlogp_sum": obj.segment_sum(other_abs, batch.segment_ids, S),
      "other_token_kl_sum": obj.segment_sum(other_kl, batch.segment_ids, S),
      # The learner's log-prob of each reply's last sampled token: the stop token's (EOS)
      # for a reply that was not truncated (the host picks those, and has the behaviour's).
      "last_logp": _last_action(aux["log_ratio"] + batch.behavior_logp, mask,
                                batch.segment_ids, S),
  }
  return grads, sums, maxes, segment


def _add(acc, grads, sums, maxes):
  if acc is None:
    return {"grads": grads, "sums": sums, "maxes": maxes}
  return {"grads": jax.tree.map(jnp.add, acc["grads"], grads),
          "sums": {k: acc["sums"][k] + v for k, v in sums.items()},
          "maxes": {k: jnp.maximum(acc["maxes"][k], v) for k, v in maxes.items()}}


def accumulate(params, acc: dict | None, batch, stats, *, sc: StepConfig):
  """A non-final micro-batch: adds its gradient and metric sums to `acc` (None to start).
  Returns (acc, per-trajectory values [S])."""
  grads, sums, maxes, segment = _grads_and_sums(params, batch, stats, sc)
  return _add(acc, grads, sums, maxes), segment


def update(state: TrainState, acc: dict | None, batch, stats, *, sc: StepConfig,
           optimizer: optax.GradientTransformation, lr_schedule):
  """The final micro-batch of a batch: accumulate it, then one guarded optimizer step.

  Returns (state, metrics, per-trajectory values [S]); metrics are scalars (device arrays).
  """
  grads, sums, maxes, segment = _grads_and_sums(state.params, batch, stats, sc)
  acc = _add(acc, grads, sums, maxes)
  grads, sums, maxes = acc["grads"], acc["sums"], acc["maxes"]
  grad_norm = optax.tree.norm(grads)
  ok = jnp.isfinite(sums["loss"]) & jnp.isfinite(grad_norm)
  # Zero non-finite grads before the optimizer so the (discarded) branch stays NaN-free.
  safe = jax.tree.map(lambda g: jnp.where(ok, g, 0.0), grads)
  trainable, frozen = lora.split(state.params)
  updates, opt_state = optimizer.update(safe, state.opt_state, trainable)
  new = optax.apply_updates(trainable, updates)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa
  new_state = TrainState(
      step=state.step + ok.astype(jnp.int32),
      params=lora.join(keep(new, trainable), frozen),
      opt_state=keep(opt_state, state.opt_state),
      skipped=state.skipped + (~ok).astype(jnp.int32))
  n_traj = jnp.maximum(sums["trajectories"], 1.0)
  n_tok = jnp.maximum(sums["tokens"], 1.0)
  metrics = {
      "loss": sums["loss"],
      "acceptance_rate": sums["admitted"] / n_traj,
      "kl_proxy_mean": sums["seq_kl_sum"] / n_traj,
      "kl_proxy_max": maxes["seq_kl_max"],
      "token_kl_mean": sums["token_kl_sum"] / n_tok,
      "ratio_mean": sums["ratio_sum"] / n_tok,
      "ratio_max": maxes["ratio_max"],
      "ratio_outside_frac": sums["ratio_outside"] / n_tok,
      # Kish's effective sample size of the admitted tokens' importance weights, as a
      # fraction of them: (sum rho)^2 / (n sum rho^2); 1 when every ratio is equal.
      "ess_fraction": sums["admitted_ratio_sum"] ** 2
                      / jnp.maximum(sums["admitted_tokens"] * sums["admitted_ratio_sq_sum"],
                                    1e-30),
      # The gate's tokens: all of them under sequence trust's admitted records, the tokens
      # with d_it <= delta under token trust.
      "admitted_tokens": sums["admitted_tokens"],
      "token_acceptance_rate": sums["admitted_tokens"] / n_tok,
      "entropy": sums["entropy_sum"] / n_tok,
      "grad_norm": grad_norm,
      "lr": lr_schedule(state.step),
      "action_tokens": sums["tokens"],
      "trajectories": sums["trajectories"],
      "finite": ok,
  }
  p_tokens = sums["p_bin_tokens"]
  for k, name in enumerate(P_BINS):
    # Token share of the bin, its mean d and the share of its tokens with d > delta.
    metrics[f"d_by_p/{name}/tokens"] = p_tokens[k] / n_tok
    metrics[f"d_by_p/{name}/token_kl"] = sums["p_bin_kl"][k] / jnp.maximum(p_tokens[k], 1.0)
    metrics[f"d_by_p/{name}/over_delta"] = (sums["p_bin_over_delta"][k]
                                            / jnp.maximum(p_tokens[k], 1.0))
  if sc.model.is_moe:
    # The load-balancing loss summed over micro-batches (one per micro-batch: 1 normally).
    metrics["router_balance"] = sums["router_balance"]
    # Expert parallelism with a capacity factor: the share of (position, expert) pairs, of
    # all sparse layers, that found no slot (0 when dropless, the default).
    metrics["expert_drop_rate"] = sums["expert_dropped"] / jnp.maximum(sums["expert_pairs"], 1)
    if batch.routes is not None:
      metrics["routing_drift"] = sums["drift_tokens"] / n_tok
  return new_state, metrics, segment
