"""Independent NumPy references, written from shared/PAPER_NOTES.md with explicit loops in
float64. They share no code with fr_jax and return the analytic gradient with respect to the
learner log-probs, derived by hand:

  dL/dlogp_it = -w_i * m_it * rho_it,   w_i = A_i / (B T_i)  (sample mean)
                                         w_i = A_i / sum_j T_j (token mean)
(rho is a constant, so only the explicit log pi factor is differentiated).
"""

import math

import numpy as np

EPS = 1e-6


def bern_kl(p, q):
  p = min(max(p, EPS), 1 - EPS)
  q = min(max(q, EPS), 1 - EPS)
  return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def _weight(reduction, B, T_i, total_T, length_norm):
  """The per-trajectory factor of the reduction: 1/(B T_i), 1/sum T or 1/(B L)."""
  return {"sample_mean": lambda: 1.0 / (B * T_i), "token_mean": lambda: 1.0 / total_T,
          "constant_length": lambda: 1.0 / (B * length_norm)}[reduction]()


def flash_reinforce(logp, blogp, rewards, mask, *, delta=3e-3, reduction="sample_mean",
                    trust="sequence", advantage="batch_centered", length_norm=None):
  logp = np.asarray(logp, np.float64)
  blogp = np.asarray(blogp, np.float64)
  rewards = np.asarray(rewards, np.float64)
  mask = np.asarray(mask, bool)
  B, T = logp.shape
  n_act = [int(mask[i].sum()) for i in range(B)]
  if advantage == "batch_centered":
    mean_r = sum(rewards) / B
    adv = [rewards[i] - mean_r for i in range(B)]
  else:
    adv = [rewards[i] for i in range(B)]

  seq_kl, admitted, tok_ok = [], [], np.zeros((B, T), bool)
  for i in range(B):
    ds = {}
    for t in range(T):
      if mask[i, t]:
        ds[t] = bern_kl(math.exp(blogp[i, t]), math.exp(logp[i, t]))
    D = max(0.0, sum(ds.values()) / n_act[i])
    seq_kl.append(D)
    if trust in ("sequence", "sequence_negative"):
      # sequence_negative: only a trajectory whose advantage is negative can be gated
      ok = D <= delta or (trust == "sequence_negative" and adv[i] >= 0)
      for t in ds:
        tok_ok[i, t] = ok
      admitted.append(ok)
    elif trust == "token":
      for t, d in ds.items():
        tok_ok[i, t] = d <= delta
      admitted.append(all(d <= delta for d in ds.values()))
    else:
      for t in ds:
        tok_ok[i, t] = True
      admitted.append(True)

  total_T = sum(n_act)
  loss = 0.0
  grad = np.zeros((B, T))
  ratios = []
  for i in range(B):
    w = adv[i] * _weight(reduction, B, n_act[i], total_T, length_norm)
    for t in range(T):
      if not mask[i, t]:
        continue
      rho = math.exp(logp[i, t] - blogp[i, t])
      ratios.append(rho)
      if tok_ok[i, t]:
        loss -= w * rho * logp[i, t]
        grad[i, t] = -w * rho
  aux = {
      "advantages": np.array(adv),
      "seq_kl": np.array(seq_kl),
      "admitted": np.array(admitted),
      "acceptance_rate": sum(admitted) / B,
      "token_acceptance_rate": tok_ok.sum() / total_T,
      "ratio_mean": sum(ratios) / len(ratios),
      "ratio_max": max(ratios),
      "ratio_min": min(ratios),
  }
  return loss, grad, aux


def group_advantages(rewards, group_ids, normalize_std=True):
  rewards = [float(r) for r in rewards]
  out = []
  for i, g in enumerate(group_ids):
    members = [rewards[j] for j, h in enumerate(group_ids) if h == g]
    mean = sum(members) / len(members)
    a = rewards[i] - mean
    if normalize_std:
      n = len(members)
      var = sum((m - mean) ** 2 for m in members) / (n - 1) if n > 1 else 0.0
      a = a / (math.sqrt(var) + 1e-6)
    out.append(a)
  return np.array(out)


def ppo_clip(logp, old_logp, adv, mask, *, eps=0.2, eps_high=None, reduction="sample_mean",
             length_norm=None):
  """PPO-clip surrogate and its gradient wrt logp (d/dlogp of r*A is r*A; clipped: 0)."""
  hi = eps if eps_high is None else eps_high
  logp = np.asarray(logp, np.float64)
  old_logp = np.asarray(old_logp, np.float64)
  B, T = logp.shape
  n_act = [int(np.asarray(mask[i]).sum()) for i in range(B)]
  total_T = sum(n_act)
  loss, grad = 0.0, np.zeros((B, T))
  for i in range(B):
    w = _weight(reduction, B, n_act[i], total_T, length_norm)
    for t in range(T):
      if not mask[i][t]:
        continue
      r = math.exp(logp[i, t] - old_logp[i, t])
      unclipped = r * adv[i]
      clipped = min(max(r, 1 - eps), 1 + hi) * adv[i]
      loss -= w * min(unclipped, clipped)
      if unclipped <= clipped:  # the unclipped branch is active
        grad[i, t] = -w * r * adv[i]
  return loss, grad
