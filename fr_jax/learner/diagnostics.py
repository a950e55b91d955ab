"""Per-batch diagnostics that need to know each record: the split metrics of docs/learner.md.

The update step returns, per trajectory, the gate's D_i and decision and the sums of
|log pi - log mu| and of the Bernoulli KL over its action tokens (`step`'s `segment`).
Only the host knows each record's policy lag and response length, so the splits
are made here, in NumPy, after the step:

* **mismatch by policy lag** (`mismatch/lag_{0,1,2_3,4plus}/...`): at lag 0 the learner
  scores the very weights that sampled, so what is left is the engine's numerical mismatch;
  at higher lags staleness drift adds to it. Per bucket: the token mean of |delta log p|
  (`abs_dlogp`) and of the Bernoulli KL (`token_kl`), the mean of D_i (`kl_proxy`, what the
  gate bounds) and the number of trajectories; for an MoE model whose records carry routing,
  the fraction of action tokens whose learner top-k differs from the recorded experts
  (`routing_drift`); with `log.routing_counterfactual`, the same batch's |delta log p| and
  Bernoulli KL with and without replay (`abs_dlogp_with_replay`, `abs_dlogp_without_replay`,
  `token_kl_with_replay`, `token_kl_without_replay`: one of each pair is the update's own).
* **the gate's acceptance by response length** (`gate/acceptance_len_q{1..4}`): records sorted
  by completion length and cut into four groups of equal size (by rank, so ties may straddle
  a cut); `gate/len_q{k}_max` is each group's longest response.
* **the gate's acceptance by advantage sign** (`gate/acceptance_adv_{pos,neg,zero}`), and
  what the gate leaves of the batch's advantages (`gate/admitted_adv_sum`: sum_i m_i A_i; the
  batch-mean baseline makes sum_i A_i = 0, so rejecting positives leaves it below zero, and
  the admitted records then push the policy, on balance, away from what it sampled).
* **the stop token's log-prob** (`eos/logp_at_stop`, `eos/behavior_logp_at_stop`): the
  learner's and the behaviour's log-prob of the last sampled token of the replies that ended
  on a stop token (not truncated), mean over them, and `eos/logp_at_stop_adv_{pos,neg}` split
  by advantage sign. Truncated replies have no stop token: once the short rewarded replies are
  gone, nothing raises it.

A bucket with no record is left out of the row (no NaN in metrics.jsonl).
"""

from __future__ import annotations

import numpy as np

# (name, lowest lag, highest lag) of the mismatch buckets.
LAG_BUCKETS = (("0", 0, 0), ("1", 1, 1), ("2_3", 2, 3), ("4plus", 4, np.iinfo(np.int64).max))


def split_metrics(*, lag_B, action_tokens_B, response_len_B, advantage_B, admitted_B,
                  seq_kl_B, abs_dlogp_sum_B, token_kl_sum_B, drift_sum_B=None, other_B=None,
                  replay=False, stopped_B=None, last_logp_B=None,
                  last_behavior_logp_B=None) -> dict:
  """The split metrics of one batch of B records (every argument is [B], in record order)."""
  lag = np.asarray(lag_B)
  tokens = np.asarray(action_tokens_B, np.float64)
  admitted = np.asarray(admitted_B, np.float64)
  out = {}
  for name, lo, hi in LAG_BUCKETS:
    sel = (lag >= lo) & (lag <= hi)
    if not sel.any():
      continue
    n_tok = max(tokens[sel].sum(), 1.0)
    out[f"mismatch/lag_{name}/abs_dlogp"] = float(np.sum(abs_dlogp_sum_B, where=sel) / n_tok)
    out[f"mismatch/lag_{name}/token_kl"] = float(np.sum(token_kl_sum_B, where=sel) / n_tok)
    out[f"mismatch/lag_{name}/kl_proxy"] = float(np.mean(np.asarray(seq_kl_B)[sel]))
    out[f"mismatch/lag_{name}/trajectories"] = int(sel.sum())
    if drift_sum_B is not None:
      out[f"mismatch/lag_{name}/routing_drift"] = float(np.sum(drift_sum_B, where=sel) / n_tok)
    if other_B is not None:
      own, other = ("with", "without") if replay else ("without", "with")
      for key, mine, theirs in (("abs_dlogp", abs_dlogp_sum_B, other_B[0]),
                                ("token_kl", token_kl_sum_B, other_B[1])):
        out[f"mismatch/lag_{name}/{key}_{own}_replay"] = float(np.sum(mine, where=sel) / n_tok)
        out[f"mismatch/lag_{name}/{key}_{other}_replay"] = float(np.sum(theirs, where=sel)
                                                                 / n_tok)
  length = np.asarray(response_len_B)
  order = np.argsort(length, kind="stable")
  for q, idx in enumerate(np.array_split(order, 4), start=1):
    if idx.size:
      out[f"gate/acceptance_len_q{q}"] = float(admitted[idx].mean())
      out[f"gate/len_q{q}_max"] = int(length[idx].max())
  adv = np.asarray(advantage_B, np.float64)
  for name, sel in (("pos", adv > 0), ("neg", adv < 0), ("zero", adv == 0)):
    if sel.any():
      out[f"gate/acceptance_adv_{name}"] = float(admitted[sel].mean())
  out["gate/admitted_adv_sum"] = float(np.sum(admitted * adv))
  if stopped_B is not None:
    stop = np.asarray(stopped_B, bool)
    for suffix, sel in (("", stop), ("_adv_pos", stop & (adv > 0)),
                        ("_adv_neg", stop & (adv < 0))):
      if sel.any():
        out[f"eos/logp_at_stop{suffix}"] = float(np.mean(np.asarray(last_logp_B)[sel]))
    if stop.any():
      out["eos/behavior_logp_at_stop"] = float(np.mean(np.asarray(last_behavior_logp_B)[stop]))
  return out


def record_metrics(trajs, lags_B, packed, segments, *, counterfactual: bool,
                   replay: bool) -> dict:
  """`split_metrics` of one update's batch: each micro-batch's per-slot values [S]
  (`step`'s `segment`, host arrays) gathered back into record order (`traj_index`).
  `counterfactual`: the step scored the batch the other way too (`routing_counterfactual`)."""
  B = len(trajs)
  per = {k: np.zeros(B, np.float64) for k in segments[0]}
  for b, seg in zip(packed.batches, segments):
    slots = np.flatnonzero(b.segment_valid)
    for k, v in seg.items():
      per[k][b.traj_index[slots]] = np.asarray(v, np.float64)[slots]
  routed = packed.batches[0].routes is not None
  return split_metrics(
      lag_B=lags_B, action_tokens_B=[t.num_action_tokens for t in trajs],
      response_len_B=[t.completion_tokens.shape[0] for t in trajs],
      advantage_B=per["advantages"],  # the objective's own
      admitted_B=per["admitted"], seq_kl_B=per["seq_kl"],
      abs_dlogp_sum_B=per["abs_dlogp_sum"], token_kl_sum_B=per["token_kl_sum"],
      drift_sum_B=per["drift_sum"] if routed else None,
      other_B=(per["other_abs_dlogp_sum"], per["other_token_kl_sum"])
      if routed and counterfactual else None,
      replay=replay, stopped_B=[t.finish_reason == "stop" for t in trajs],
      last_logp_B=per["last_logp"],
      last_behavior_logp_B=[t.behavior_logp[np.flatnonzero(t.action_mask)[-1]] for t in trajs])
