"""The pure update: (state, packed micro-batch) -> (state, metrics).

One fresh batch of B trajectories is packed into one or more bucket-shaped micro-batches.
Every micro-batch is scored with the batch's global normalisers (`BatchStats`: B, sum R,
sum T), so its loss and gradient are unreduced parts of the one-batch objective; summing them
gives exactly the one-pass gradient. The last micro-batch applies one optimizer step.

A batch whose loss or gradient norm is not finite applies nothing: the state is kept and
`skipped` is incremented.

Each micro-batch also returns per-trajectory values [S] (`SEGMENT_VALUES`: the gate's D_i
and decision from the objective, the sums of |log pi - log mu| and of the Bernoulli KL over
the action tokens, and, for an MoE model whose records carry routing, how many of them
drifted: scored where the learner's own top-k is not the recorded set, and optionally the
same sums scored the other way, with replay or without): the learner splits
them on the host by what only the host knows per record (policy lag, response length,
advantage sign; `fr_jax.learner.diagnostics`). The
metrics' per-token ratio and KL are recomputed here from the same log-probs, for every loss
(sft and grpo included); the objective's own copies are not passed out.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fr_jax import objective as obj
from fr_jax.models import decoder
from fr_jax.models.config import ModelConfig


class TrainState(NamedTuple):
  step: jax.Array  # int32: optimizer steps applied (= the policy version of `params`)
  params: Any
  opt_state: Any
  skipped: jax.Array  # int32: batches refused by the non-finite guard


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Everything static the update step closes over (hashable)."""

  model: ModelConfig
  loss: str = "flash_reinforce"  # grpo (batch.rewards then holds advantages) or sft
  delta: float = 3e-3
  reduction: str = "sample_mean"
  trust: str = "sequence"
  advantage: str = "batch_centered"
  clip_eps: float = 0.2
  clip_eps_high: float = 0.2
  temperature: float = 1.0
  remat: bool = True
  replay: bool = False  # MoE: score with the batch's recorded experts (batch.routes)
  router_aux_loss_coef: float = 0.0  # MoE: weight of the routers' load-balancing loss
  # MoE with recorded routing: also score the batch the other way (without replay when
  # replaying, with it when not), for the mismatch metrics of both (one more forward pass).
  routing_counterfactual: bool = False


def init_state(params, optimizer: optax.GradientTransformation) -> TrainState:
  return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params),
                    jnp.zeros((), jnp.int32))


_SUMS = ("loss", "admitted", "trajectories", "tokens", "seq_kl_sum", "ratio_sum",
         "entropy_sum", "token_kl_sum", "ratio_outside", "admitted_tokens",
         "admitted_ratio_sum", "admitted_ratio_sq_sum", "drift_tokens", "router_balance")
_MAXES = ("seq_kl_max", "ratio_max")
SEGMENT_VALUES = ("seq_kl", "admitted", "abs_dlogp_sum", "token_kl_sum", "drift_sum",
                  "other_abs_dlogp_sum", "other_token_kl_sum")
# Importance ratios outside [1/RATIO_BAND, RATIO_BAND] are counted (`ratio_outside_frac`).
RATIO_BAND = 2.0


def _grads_and_sums(params, batch, stats: obj.BatchStats, sc: StepConfig):
  """Gradient, metric sums and per-trajectory values [S] of one micro-batch's share of the
  batch objective."""

  routes = batch.routes if sc.replay else None
  if sc.replay and routes is None:
    raise ValueError("routing replay needs a batch packed with routes (records carrying "
                     "routed_experts)")

  def loss_fn(params):
    logp, entropy, routing = decoder.score_packed(
        params, sc.model, batch.tokens, batch.targets, batch.positions, batch.segment_ids,
        sc.temperature, remat=sc.remat, routes=routes, routing_out=True)
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
          advantage=sc.advantage, stats=stats)
    else:
      loss, aux = obj.ppo_clip_loss_packed(
          logp, batch.behavior_logp, batch.action_mask, batch.segment_ids, batch.rewards,
          batch.segment_valid, clip_eps=sc.clip_eps, clip_eps_high=sc.clip_eps_high,
          reduction=sc.reduction, stats=stats)
    if sc.router_aux_loss_coef:
      loss = loss + sc.router_aux_loss_coef * routing.balance
    return loss, (aux, logp, entropy, routing)

  (loss, (aux, logp, entropy, routing)), grads = jax.value_and_grad(loss_fn,
                                                                    has_aux=True)(params)
  mask = batch.action_mask
  valid = batch.segment_valid
  f32 = jnp.float32
  n_tok = mask.sum().astype(f32)
  logp = jax.lax.stop_gradient(logp)
  # A supervised target is the policy's own action: ratio 1, KL 0, every sequence admitted.
  behavior = logp if sc.loss == "sft" else batch.behavior_logp
  log_rho = jnp.where(mask, logp - behavior, 0.0)
  rho = jnp.where(mask, jnp.exp(log_rho), 0.0)
  seq_kl = aux.get("seq_kl", jnp.zeros(valid.shape, f32))
  admitted = aux.get("admitted", valid) & valid
  d = jnp.where(mask, obj.bernoulli_kl(behavior, logp), 0.0)
  S = valid.shape[0]
  token_admitted = mask & jnp.concatenate([jnp.zeros((1,), bool), admitted])[batch.segment_ids]
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
      "seq_kl_sum": jnp.where(valid, seq_kl, 0.0).sum(),
      "ratio_sum": rho.sum(),
      "entropy_sum": jnp.where(mask, entropy, 0.0).sum(),
      "token_kl_sum": d.sum(),
      "ratio_outside": outside.sum().astype(f32),
      "admitted_tokens": token_admitted.sum().astype(f32),
      "admitted_ratio_sum": rho_admitted.sum(),
      "admitted_ratio_sq_sum": (rho_admitted * rho_admitted).sum(),
      "drift_tokens": drift.sum().astype(f32),
      "router_balance": routing.balance,
  }
  maxes = {"seq_kl_max": jnp.where(valid, seq_kl, 0.0).max(), "ratio_max": rho.max()}
  other_abs = other_kl = jnp.zeros(mask.shape, f32)
  if batch.routes is not None and sc.routing_counterfactual and sc.loss != "sft":
    other, _ = decoder.score_packed(params, sc.model, batch.tokens, batch.targets,
                                    batch.positions, batch.segment_ids, sc.temperature,
                                    routes=None if sc.replay else batch.routes)
    other = jax.lax.stop_gradient(other)
    other_abs = jnp.where(mask, jnp.abs(other - behavior), 0.0)
    other_kl = jnp.where(mask, obj.bernoulli_kl(behavior, other), 0.0)
  segment = {
      "seq_kl": jnp.where(valid, seq_kl, 0.0),
      "admitted": admitted,
      "abs_dlogp_sum": obj.segment_sum(jnp.abs(log_rho), batch.segment_ids, S),
      "token_kl_sum": obj.segment_sum(d, batch.segment_ids, S),
      "drift_sum": obj.segment_sum(drift.astype(f32), batch.segment_ids, S),
      "other_abs_dlogp_sum": obj.segment_sum(other_abs, batch.segment_ids, S),
      "other_token_kl_sum": obj.segment_sum(other_kl, batch.segment_ids, S),
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
  updates, opt_state = optimizer.update(safe, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa
  new_state = TrainState(
      step=state.step + ok.astype(jnp.int32),
      params=keep(params, state.params),
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
      "entropy": sums["entropy_sum"] / n_tok,
      "grad_norm": grad_norm,
      "lr": lr_schedule(state.step),
      "action_tokens": sums["tokens"],
      "trajectories": sums["trajectories"],
      "finite": ok,
  }
  if sc.model.is_moe:
    # The load-balancing loss summed over micro-batches (one per micro-batch: 1 normally).
    metrics["router_balance"] = sums["router_balance"]
    if batch.routes is not None:
      metrics["routing_drift"] = sums["drift_tokens"] / n_tok
  return new_state, metrics, segment
