"""The FlashREINFORCE objective, line by line against the paper (shared/PAPER_NOTES.md).

For trajectory i with reward R_i and T_i action tokens a_{i,t}:

  (1) one-batch REINFORCE     A_i = R_i - mean_j R_j               (mean over all B, gate ignored)
  (2) sequence trust region   p = mu(a|h), q = sg(pi(a|h)), both clamped to [1e-6, 1-1e-6]
                              d_it = p log(p/q) + (1-p) log((1-p)/(1-q))
                              D_i  = max(0, sum_t d_it / T_i);  m_i = [D_i <= delta]
  (3) sample-mean objective   L = -(1/B) sum_i m_i (A_i/T_i) sum_t sg(rho_it) log pi(a_it|h_it)
                              rho = exp(log pi - log mu), unclipped, constant.
      ablations of (3)        token_mean: 1/(B T_i) -> 1/sum_j T_j;
                              constant_length: 1/(B T_i) -> 1/(B L), L a constant (length_norm)

Every function here is pure and jit-able. Two layouts share one implementation:

* padded: arrays [B, T], row i is trajectory i (`flash_reinforce_loss`, `ppo_clip_loss`);
* packed: arrays [R, L] holding several trajectories per row, `segment_ids` in 0..S
  (0 = padding, s = trajectory slot s-1) and per-trajectory arrays of static length S
  (`flash_reinforce_loss_packed`, `ppo_clip_loss_packed`). Per-trajectory sums are segment
  sums with a static number of segments, so a bucket shape compiles once.

Global quantities (B, sum_j R_j, sum_j T_j) can be given from outside (`BatchStats`) so that
micro-batches see the whole batch's normalisers. On a mesh, the learner jits the packed loss
over globally sharded arrays, and XLA inserts the collectives for these sums.

Every loss here (the supervised one too: this one with A_i = 1, rho = 1 and no gate) returns
in `aux` the quantities its terms were built from: per token the log-ratio, the ratio, the
Bernoulli KL and the admitted mask; per trajectory the advantage, D_i and the decision. The
learner's metrics are sums of these, so they describe exactly the tokens the loss used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

PROB_CLAMP = 1e-6  # p and q are clamped to [1e-6, 1 - 1e-6] before the Bernoulli KL.
DELTA = 3e-3  # the paper's trust bound on D_i: the one default (the learner config's too)

# constant_length: the weight 1/(B T_i) becomes 1/(B L) for a constant L (`length_norm`), as in
# the reference code's variant (Dr. GRPO's): every token of the batch counts the same, and a
# reply's weight no longer grows as it gets shorter.
REDUCTIONS = ("sample_mean", "token_mean", "constant_length")
# sequence_negative (a deviation from the paper, off by default; DeepSeek-V3.2's off-policy
# sequence masking): the sequence gate applied to negative advantages only, so a rewarded
# reply is never gated away (issue 56: the gate removed the short rewarded replies).
TRUST_MODES = ("sequence", "token", "none", "sequence_negative")
ADVANTAGES = ("batch_centered", "positive_only")


class BatchStats(NamedTuple):
  """Whole-batch normalisers. Counts are floats so they can be psum-ed and traced."""

  num_trajectories: jax.Array  # B
  reward_sum: jax.Array  # sum_j R_j
  num_action_tokens: jax.Array  # sum_j T_j


class _Layout(NamedTuple):
  """How per-token values map to per-trajectory values and back."""

  to_traj: Callable[[jax.Array], jax.Array]  # per-token [..] -> per-trajectory sums [N]
  to_tok: Callable[[jax.Array], jax.Array]  # per-trajectory [N] -> per-token [..]
  traj_max: Callable[[jax.Array], jax.Array]  # per-token -> per-trajectory max


def _padded_layout() -> _Layout:
  return _Layout(
      to_traj=lambda x_BxT: x_BxT.sum(axis=-1),
      to_tok=lambda x_B: x_B[:, None],
      traj_max=lambda x_BxT: x_BxT.max(axis=-1),
  )


def segment_sum(x_RxL: jax.Array, segment_ids_RxL: jax.Array, num_segments: int) -> jax.Array:
  """Per-trajectory sums [S] of a packed per-token array [R, L] (segment 0, the padding, is
  dropped)."""
  # Segment 0 is padding; slot s-1 holds trajectory segment s. The extra bucket absorbs
  # padding so no token is ever dropped or branched on.
  return jax.ops.segment_sum(x_RxL.reshape(-1), segment_ids_RxL.reshape(-1),
                             num_segments=num_segments + 1)[1:]


def _packed_layout(segment_ids_RxL: jax.Array, num_segments: int) -> _Layout:
  seg_N = segment_ids_RxL.reshape(-1)

  def to_traj(x_RxL):
    return segment_sum(x_RxL, segment_ids_RxL, num_segments)

  def to_tok(x_S):
    return jnp.concatenate([jnp.zeros((1,), x_S.dtype), x_S])[segment_ids_RxL]

  def traj_max(x_RxL):
    m = jax.ops.segment_max(x_RxL.reshape(-1), seg_N, num_segments=num_segments + 1)
    return m[1:]

  return _Layout(to_traj, to_tok, traj_max)


def _f32(x):
  # Half precision is promoted to float32 inside the loss (reference-code rule).
  return jnp.asarray(x).astype(jnp.float32)


def _check_choice(name, value, allowed):
  if value not in allowed:
    raise ValueError(f"{name}={value!r} is not supported; choose one of {allowed}.")


def bernoulli_kl(behavior_logp, learner_logp):
  """Per-token Bernoulli KL proxy d = KL(Bern(p) || Bern(q)), p = exp(behavior_logp).

  Both probabilities are clamped to [1e-6, 1 - 1e-6]. Callers pass the learner log-prob
  already stop-gradiented. Shapes: any, broadcast together. Units: nats.
  """
  p = jnp.clip(jnp.exp(_f32(behavior_logp)), PROB_CLAMP, 1.0 - PROB_CLAMP)
  q = jnp.clip(jnp.exp(_f32(learner_logp)), PROB_CLAMP, 1.0 - PROB_CLAMP)
  # d = p log(p/q) + (1-p) log((1-p)/(1-q)); log1p keeps the (1-p) terms accurate near 0.
  return p * (jnp.log(p) - jnp.log(q)) + (1.0 - p) * (jnp.log1p(-p) - jnp.log1p(-q))


def batch_stats(rewards_N, valid_N, num_action_tokens_N) -> BatchStats:
  """B, sum R and sum T over the valid trajectories."""
  valid = _f32(valid_N)
  return BatchStats(
      num_trajectories=valid.sum(),
      reward_sum=(_f32(rewards_N) * valid).sum(),
      num_action_tokens=(_f32(num_action_tokens_N) * valid).sum(),
  )


def _token_terms(layout, logp_sg, behavior_logp, mask, T_N):
  """Per-token log-ratio, ratio and Bernoulli KL (0 off the action tokens) and per-trajectory
  D_i of detached learner log-probs against the behaviour's: (2), and (3)'s rho."""
  log_rho = jnp.where(mask, logp_sg - behavior_logp, 0.0)
  rho = jnp.where(mask, jnp.exp(log_rho), 0.0)
  d = jnp.where(mask, bernoulli_kl(behavior_logp, logp_sg), 0.0)
  seq_kl_N = jnp.maximum(0.0, layout.to_traj(d) / jnp.maximum(T_N, 1.0))  # D_i
  return log_rho, rho, d, seq_kl_N


def _aux(A_N, T_N, valid_N, mask, log_rho, rho, d, seq_kl_N, admitted_N, token_admitted):
  """What a loss was built from: per-token and per-trajectory arrays, and their means over
  this call's action tokens and valid trajectories."""
  n_tok = jnp.maximum(mask.astype(jnp.float32).sum(), 1.0)
  n_valid = jnp.maximum(valid_N.astype(jnp.float32).sum(), 1.0)
  seq_kl_N = jnp.where(valid_N, seq_kl_N, 0.0)
  return {
      "log_ratio": log_rho, "ratio": rho, "token_kl": d, "token_admitted": token_admitted,
      "advantages": A_N, "seq_kl": seq_kl_N, "admitted": admitted_N, "num_action_tokens": T_N,
      "acceptance_rate": admitted_N.astype(jnp.float32).sum() / n_valid,
      "token_acceptance_rate": token_admitted.astype(jnp.float32).sum() / n_tok,
      "seq_kl_mean": seq_kl_N.sum() / n_valid,
      "seq_kl_max": seq_kl_N.max(),
      "token_kl_mean": d.sum() / n_tok,
      "ratio_mean": rho.sum() / n_tok,
      "ratio_max": jnp.where(mask, rho, -jnp.inf).max(),
      "ratio_min": -jnp.where(mask, -rho, -jnp.inf).max(),
      "log_ratio_abs_mean": jnp.abs(log_rho).sum() / n_tok,
  }


def _length_norm(reduction, length_norm):
  if reduction == "constant_length" and not (length_norm and length_norm > 0):
    raise ValueError(f"reduction='constant_length' needs length_norm > 0 (the constant L in "
                     f"1/(B L)), got {length_norm!r}")


def _reinforce(layout, logp, behavior_logp, rewards_N, valid_N, action_mask, *, delta,
               reduction, trust, advantage, stats, length_norm=None):
  _check_choice("reduction", reduction, REDUCTIONS)
  _length_norm(reduction, length_norm)
  _check_choice("trust", trust, TRUST_MODES)
  _check_choice("advantage", advantage, ADVANTAGES)

  logp, behavior_logp, rewards_N = _f32(logp), _f32(behavior_logp), _f32(rewards_N)
  valid_N = jnp.asarray(valid_N, bool)
  mask = jnp.asarray(action_mask, bool)
  maskf = mask.astype(jnp.float32)
  T_N = layout.to_traj(maskf)  # action tokens per trajectory
  if stats is None:
    stats = batch_stats(rewards_N, valid_N, T_N)

  # (1) A_i = R_i - mean_j R_j over the whole fresh batch; rejected rows still count.
  if advantage == "batch_centered":
    A_N = rewards_N - stats.reward_sum / jnp.maximum(stats.num_trajectories, 1.0)
  else:  # positive_only: A_i = R_i, uncentred (ablation)
    A_N = rewards_N
  A_N = jnp.where(valid_N, A_N, 0.0)

  # (2) Trust region on the Bernoulli-KL proxy, with the learner prob detached.
  log_rho, rho, d, seq_kl_N = _token_terms(layout, jax.lax.stop_gradient(logp), behavior_logp,
                                           mask, T_N)
  if trust in ("sequence", "sequence_negative"):
    admitted_N = seq_kl_N <= delta  # inclusive bound; delta=inf admits everything finite
    if trust == "sequence_negative":  # only a negative advantage can be gated
      admitted_N = admitted_N | (A_N >= 0)
    token_admitted = mask & layout.to_tok(admitted_N)
  elif trust == "token":
    token_admitted = mask & (d <= delta)  # token-local gate (ablation)
    # A trajectory counts as admitted when none of its action tokens was gated.
    admitted_N = layout.to_traj(token_admitted.astype(jnp.float32)) == T_N
  else:
    admitted_N = jnp.ones_like(valid_N)
    token_admitted = mask
  admitted_N = admitted_N & valid_N

  # (3) rho = exp(sg(log pi) - log mu), a constant, unclipped.
  weighted_logp = jnp.where(token_admitted, rho * logp, 0.0)
  per_traj_N = layout.to_traj(weighted_logp)  # sum_t m rho log pi
  if reduction == "sample_mean":
    # L = -(1/B) sum_i (A_i / T_i) sum_t m rho log pi
    coef_N = A_N / jnp.maximum(T_N, 1.0) / jnp.maximum(stats.num_trajectories, 1.0)
  elif reduction == "constant_length":
    coef_N = A_N / length_norm / jnp.maximum(stats.num_trajectories, 1.0)
  else:
    # token_mean: the weight 1/(B T_i) becomes 1/sum_j T_j, T over all B rows.
    coef_N = A_N / jnp.maximum(stats.num_action_tokens, 1.0)
  loss = -(coef_N * per_traj_N).sum()
  return loss, _aux(A_N, T_N, valid_N, mask, log_rho, rho, d, seq_kl_N, admitted_N,
                    token_admitted)


def flash_reinforce_loss(logp, behavior_logp, rewards, action_mask, *, delta=DELTA,
                         reduction="sample_mean", trust="sequence",
                         advantage="batch_centered", stats=None, length_norm=None):
  """FlashREINFORCE loss on padded arrays.

  Args:
    logp: float [B, T], learner log-probs of the sampled tokens (differentiable).
    behavior_logp: float [B, T], the engine's log-probs of the same tokens (0 off-action).
    rewards: float [B].
    action_mask: bool [B, T], True for tokens the policy sampled.
    delta: trust bound on D_i (or on d_it for trust="token"); inf disables the gate.
    reduction: "sample_mean" (paper), "token_mean" (ablation) or "constant_length" (the
      reference code's variant: 1/(B L) for every trajectory, L = `length_norm`).
    trust: "sequence" (paper), "token" (token-local ablation), "none", or
      "sequence_negative" (a deviation: only trajectories with A_i < 0 can be gated).
    advantage: "batch_centered" (paper) or "positive_only" (A_i = R_i, ablation).
    stats: optional `BatchStats` of the whole batch (for micro-batches); default: this batch.
    length_norm: L for reduction="constant_length" (e.g. the most tokens a reply may have).

  Returns:
    (loss, aux). aux: per token [B, T] (0 or False off the action tokens) `log_ratio`
    (log pi - log mu, detached), `ratio` (rho), `token_kl` (d_it), `token_admitted` (the
    tokens the loss used); per trajectory [B] `advantages`, `seq_kl` (D_i), `admitted`,
    `num_action_tokens`; scalars `acceptance_rate` (admitted trajectories / B),
    `token_acceptance_rate`, `seq_kl_mean/max`, `token_kl_mean`, `ratio_mean/max/min`,
    `log_ratio_abs_mean`.
  """
  rewards = jnp.asarray(rewards)
  valid = jnp.ones(rewards.shape, bool)
  return _reinforce(_padded_layout(), logp, behavior_logp, rewards, valid, action_mask,
                    delta=delta, reduction=reduction, trust=trust, advantage=advantage,
                    stats=stats, length_norm=length_norm)


def flash_reinforce_loss_packed(logp, behavior_logp, action_mask, segment_ids, rewards,
                                segment_valid, *, delta=DELTA, reduction="sample_mean",
                                trust="sequence", advantage="batch_centered", stats=None,
                                length_norm=None):
  """FlashREINFORCE loss on packed arrays; same values and gradients as the padded form.

  Args:
    logp, behavior_logp: float [R, L], in the target frame (see fr_jax.packing).
    action_mask: bool [R, L].
    segment_ids: int [R, L] in 0..S; 0 is padding, s means trajectory slot s-1.
    rewards: float [S] per slot; segment_valid: bool [S], False for empty slots.
    Other arguments as in `flash_reinforce_loss`. Per-trajectory aux arrays are [S].
  """
  rewards = jnp.asarray(rewards)
  layout = _packed_layout(jnp.asarray(segment_ids), rewards.shape[0])
  return _reinforce(layout, logp, behavior_logp, rewards, segment_valid, action_mask,
                    delta=delta, reduction=reduction, trust=trust, advantage=advantage,
                    stats=stats, length_norm=length_norm)


def group_advantages(rewards, group_ids, normalize_std=True, *, num_groups=None):
  """GRPO baseline: A_i = R_i - mean_{g(i)} R, optionally / (std_{g(i)} R + 1e-6).

  Args:
    rewards: float [B].
    group_ids: int [B] in [0, num_groups); siblings of one prompt share an id.
    normalize_std: divide by the group's unbiased (ddof=1) std + 1e-6, as verl and TRL do.
      A group of one has std 0 (and advantage 0).
    num_groups: static number of groups; defaults to B.
  """
  rewards = _f32(rewards)
  group_ids = jnp.asarray(group_ids)
  G = rewards.shape[0] if num_groups is None else num_groups
  count = jax.ops.segment_sum(jnp.ones_like(rewards), group_ids, num_segments=G)
  mean = jax.ops.segment_sum(rewards, group_ids, num_segments=G) / jnp.maximum(count, 1.0)
  centered = rewards - mean[group_ids]
  if not normalize_std:
    return centered
  sq = jax.ops.segment_sum(centered**2, group_ids, num_segments=G)
  std = jnp.sqrt(sq / jnp.maximum(count - 1.0, 1.0))
  return centered / (std[group_ids] + 1e-6)


def _ppo_clip(layout, logp, old_logp, advantages_N, valid_N, action_mask, *, clip_eps,
              clip_eps_high, reduction, stats, length_norm=None):
  _check_choice("reduction", reduction, REDUCTIONS)
  _length_norm(reduction, length_norm)
  logp, old_logp, A_N = _f32(logp), _f32(old_logp), _f32(advantages_N)
  valid_N = jnp.asarray(valid_N, bool)
  mask = jnp.asarray(action_mask, bool)
  maskf = mask.astype(jnp.float32)
  T_N = layout.to_traj(maskf)
  if stats is None:
    stats = batch_stats(jnp.zeros_like(A_N), valid_N, T_N)
  hi = clip_eps if clip_eps_high is None else clip_eps_high

  # PPO-clip: per token, -min(r A, clip(r, 1-eps, 1+eps_high) A), r = pi/pi_old.
  ratio = jnp.exp(jnp.where(mask, logp - old_logp, 0.0))
  A_tok = layout.to_tok(jnp.where(valid_N, A_N, 0.0))
  surr = jnp.minimum(ratio * A_tok, jnp.clip(ratio, 1.0 - clip_eps, 1.0 + hi) * A_tok)
  per_traj_N = layout.to_traj(jnp.where(mask, surr, 0.0))
  if reduction == "sample_mean":
    coef_N = 1.0 / jnp.maximum(T_N, 1.0) / jnp.maximum(stats.num_trajectories, 1.0)
  elif reduction == "constant_length":  # Dr. GRPO's
    coef_N = jnp.full_like(T_N, 1.0) / length_norm / jnp.maximum(stats.num_trajectories, 1.0)
  else:
    coef_N = jnp.full_like(T_N, 1.0) / jnp.maximum(stats.num_action_tokens, 1.0)
  loss = -(jnp.where(valid_N, coef_N, 0.0) * per_traj_N).sum()

  # No gate: every valid trajectory's tokens are used; D_i is reported, not applied.
  log_rho, rho, d, seq_kl_N = _token_terms(layout, jax.lax.stop_gradient(logp), old_logp, mask,
                                           T_N)
  aux = _aux(A_N, T_N, valid_N, mask, log_rho, rho, d, seq_kl_N, valid_N, mask)
  clipped = mask & (((rho > 1.0 + hi) & (A_tok > 0)) | ((rho < 1.0 - clip_eps) & (A_tok < 0)))
  aux["clip_fraction"] = clipped.astype(jnp.float32).sum() / jnp.maximum(maskf.sum(), 1.0)
  return loss, aux


def ppo_clip_loss(logp, old_logp, advantages, action_mask, *, clip_eps=0.2,
                  clip_eps_high=None, reduction="sample_mean", stats=None, length_norm=None):
  """GRPO/PPO-clip policy loss on padded arrays, for matched baselines.

  Args:
    logp: float [B, T] learner log-probs (differentiable); old_logp: float [B, T] the
      log-probs of the policy that sampled (the behaviour log-probs in an async run).
    advantages: float [B] (e.g. from `group_advantages`). action_mask: bool [B, T].
    clip_eps / clip_eps_high: lower / upper clip range (upper defaults to clip_eps).
    reduction: "sample_mean" (GRPO: mean over tokens, then over trajectories),
      "token_mean" (mean over all action tokens of the batch) or "constant_length" (token sums
      over B L, L = `length_norm`: Dr. GRPO).
  """
  advantages = jnp.asarray(advantages)
  return _ppo_clip(_padded_layout(), logp, old_logp, advantages,
                   jnp.ones(advantages.shape, bool), action_mask, clip_eps=clip_eps,
                   clip_eps_high=clip_eps_high, reduction=reduction, stats=stats,
                   length_norm=length_norm)


def ppo_clip_loss_packed(logp, old_logp, action_mask, segment_ids, advantages, segment_valid,
                         *, clip_eps=0.2, clip_eps_high=None, reduction="sample_mean",
                         stats=None, length_norm=None):
  """`ppo_clip_loss` on packed arrays (layout as in `flash_reinforce_loss_packed`)."""
  advantages = jnp.asarray(advantages)
  layout = _packed_layout(jnp.asarray(segment_ids), advantages.shape[0])
  return _ppo_clip(layout, logp, old_logp, advantages, segment_valid, action_mask,
                   clip_eps=clip_eps, clip_eps_high=clip_eps_high, reduction=reduction,
                   stats=stats, length_norm=length_norm)
