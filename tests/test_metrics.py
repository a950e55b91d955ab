"""The learner's split metrics (docs/learner.md "Metrics"): engine mismatch by policy lag,
importance-ratio band, the gate's acceptance by response length and advantage sign, and the
effective sample size, against hand-derived values and against a NumPy recomputation from an
independent per-record scoring of the same batch."""

import math

import numpy as np
import pytest

from fr_jax.learner import diagnostics, synthetic
from fr_jax.learner.learner import Learner
from fr_jax.learner.metrics import read_jsonl
from fr_jax.models import decoder, registry
from tests.helpers import forward, tiny_config
from tests.np_reference import bern_kl


def test_split_metrics_hand_derived():
  m = diagnostics.split_metrics(
      lag_B=[0, 0, 1, 5], action_tokens_B=[2, 3, 4, 1], response_len_B=[10, 40, 20, 30],
      advantage_B=[0.5, -0.5, 0.0, 1.0], admitted_B=[1, 1, 1, 0],
      seq_kl_B=[0.01, 0.03, 0.1, 0.5], abs_dlogp_sum_B=[0.2, 0.3, 2.0, 1.0],
      token_kl_sum_B=[0.02, 0.03, 0.4, 0.5], stopped_B=[True, False, True, True],
      last_logp_B=[-0.1, -5.0, -0.3, -0.7], last_behavior_logp_B=[-0.2, -1.0, -0.4, -0.6])
  want = {
      # lag 0: records 0 and 1, 5 action tokens
      "mismatch/lag_0/abs_dlogp": 0.5 / 5, "mismatch/lag_0/token_kl": 0.05 / 5,
      "mismatch/lag_0/kl_proxy": 0.02, "mismatch/lag_0/trajectories": 2,
      "mismatch/lag_1/abs_dlogp": 0.5, "mismatch/lag_1/token_kl": 0.1,
      "mismatch/lag_1/kl_proxy": 0.1, "mismatch/lag_1/trajectories": 1,
      "mismatch/lag_4plus/abs_dlogp": 1.0, "mismatch/lag_4plus/token_kl": 0.5,
      "mismatch/lag_4plus/kl_proxy": 0.5, "mismatch/lag_4plus/trajectories": 1,
      # lengths sorted: 10 (record 0), 20 (2), 30 (3), 40 (1); record 3 was refused
      "gate/acceptance_len_q1": 1.0, "gate/len_q1_max": 10,
      "gate/acceptance_len_q2": 1.0, "gate/len_q2_max": 20,
      "gate/acceptance_len_q3": 0.0, "gate/len_q3_max": 30,
      "gate/acceptance_len_q4": 1.0, "gate/len_q4_max": 40,
      "gate/acceptance_adv_pos": 0.5, "gate/acceptance_adv_neg": 1.0,
      "gate/acceptance_adv_zero": 1.0,
      "gate/admitted_adv_sum": 0.5 - 0.5 + 0.0,  # record 3 (A = 1) refused
      # replies 0, 2, 3 stopped (1 was truncated); A > 0: 0 and 3; no stopped A < 0
      "eos/logp_at_stop": (-0.1 - 0.3 - 0.7) / 3, "eos/logp_at_stop_adv_pos": (-0.1 - 0.7) / 2,
      "eos/behavior_logp_at_stop": (-0.2 - 0.4 - 0.6) / 3,
  }
  assert set(m) == set(want)  # no lag 2-3 record: that bucket is left out, not NaN
  for k, v in want.items():
    assert m[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
  # Refusing a positive record leaves the admitted advantages summing below zero.
  m = diagnostics.split_metrics(
      lag_B=[0] * 3, action_tokens_B=[1] * 3, response_len_B=[1, 2, 3],
      advantage_B=[0.75, -0.25, -0.5], admitted_B=[0, 1, 1], seq_kl_B=[0.0] * 3,
      abs_dlogp_sum_B=[0.0] * 3, token_kl_sum_B=[0.0] * 3)
  assert m["gate/admitted_adv_sum"] == -0.75
  assert not any(k.startswith("eos/") for k in m)  # no finish reasons given


def _independent_logp(params, cfg, t) -> np.ndarray:
  """Log-probs of a record's completion tokens from one unpacked forward pass of that record
  alone, log-softmax in float64 (no packing, no segment sums)."""
  tokens = t.tokens
  pos = np.arange(tokens.shape[0])
  h, _ = forward(params, cfg, tokens[None], pos[None])
  logits = np.asarray(decoder.logits_from_hidden(params, cfg, h)[0], np.float64)
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  P = t.prompt_tokens.shape[0]
  rows = np.arange(P - 1, tokens.shape[0] - 1)
  return logits[rows, tokens[P:]] - lse[rows]


def _shifted_batch(model):
  """8 records whose behaviour log-probs are the model's own (independently scored), pushed
  down by a per-record amount, so the records span both sides of the gate and of the ratio
  band. Returns (records, learner log-probs, behaviour log-probs, action masks, per-token
  Bernoulli KL), the last four per record over its completion tokens."""
  it = iter(synthetic.dataset(seed=3, vocab_size=256, max_len=100).to_iter_dataset())
  trajs = synthetic.take(it, 8)
  rng = np.random.default_rng(0)
  shift = [0.0, 0.0, 0.05, 0.2, 0.5, 1.0, 2.0, 4.0]
  lp = []
  for t, s in zip(trajs, shift):
    lp_t = _independent_logp(model.params, model.config, t)
    noise = s * rng.uniform(0.5, 1.5, lp_t.shape)
    t.behavior_logp = np.where(t.action_mask, lp_t - noise, 0.0).astype(np.float32)
    t.reward = float(rng.normal())
    lp.append(lp_t)
  mask = [t.action_mask for t in trajs]
  blogp = [t.behavior_logp.astype(np.float64) for t in trajs]
  d = [np.array([bern_kl(math.exp(b), math.exp(a)) for a, b in zip(x[k], y[k])])
       for x, y, k in zip(lp, blogp, mask)]
  return trajs, lp, blogp, mask, d


def test_learner_split_metrics_equal_a_numpy_recomputation(tmp_path):
  model = registry.load("tiny-llama")
  trajs, lp, blogp, mask, d = _shifted_batch(model)
  D = np.array([di.mean() for di in d])
  delta = float(np.sqrt(np.sort(D)[3] * np.sort(D)[4]))  # half the records pass the gate
  learner = Learner(tiny_config(**{"objective.delta": delta, "log.dir": str(tmp_path)}),
                    model=model)
  lags = [0, 0, 1, 2, 3, 4, 9, 0]
  for i in (1, 4, 6):
    trajs[i].finish_reason = "length"
  m = learner.update(trajs, lags=lags)

  # The reference, in NumPy from the independent scores.
  dlogp = [np.abs(a - b)[k] for a, b, k in zip(lp, blogp, mask)]
  admitted = D <= delta
  assert admitted.sum() == 4
  lags = np.array(lags)
  for name, sel in (("0", lags == 0), ("1", lags == 1), ("2_3", (lags >= 2) & (lags <= 3)),
                    ("4plus", lags >= 4)):
    idx = np.flatnonzero(sel)
    n_tok = sum(mask[i].sum() for i in idx)
    assert m[f"mismatch/lag_{name}/abs_dlogp"] == pytest.approx(
        sum(dlogp[i].sum() for i in idx) / n_tok, rel=2e-4, abs=2e-6)
    assert m[f"mismatch/lag_{name}/token_kl"] == pytest.approx(
        sum(d[i].sum() for i in idx) / n_tok, rel=2e-3, abs=1e-6)
    assert m[f"mismatch/lag_{name}/kl_proxy"] == pytest.approx(D[idx].mean(), rel=2e-3,
                                                                abs=1e-6)
    assert m[f"mismatch/lag_{name}/trajectories"] == len(idx)
  rho = np.concatenate([np.exp(a - b)[k] for a, b, k in zip(lp, blogp, mask)])
  assert m["ratio_mean"] == pytest.approx(rho.mean(), rel=1e-4)
  assert m["ratio_max"] == pytest.approx(rho.max(), rel=1e-4)
  outside = ((rho < 0.5) | (rho > 2.0)).mean()
  assert 0 < outside < 1
  assert m["ratio_outside_frac"] == pytest.approx(outside, abs=1e-6)
  w = np.concatenate([np.exp(a - b)[k] for a, b, k, ok in zip(lp, blogp, mask, admitted)
                      if ok])
  assert m["ess_fraction"] == pytest.approx(w.sum() ** 2 / (w.size * (w ** 2).sum()), rel=1e-4)
  assert m["acceptance_rate"] == pytest.approx(admitted.mean())
  lengths = np.array([t.completion_tokens.shape[0] for t in trajs])
  for q, idx in enumerate(np.array_split(np.argsort(lengths, kind="stable"), 4), start=1):
    assert m[f"gate/acceptance_len_q{q}"] == pytest.approx(admitted[idx].mean())
  rewards = np.array([t.reward for t in trajs])
  adv = rewards - rewards.mean()  # batch-centred advantages
  assert m["gate/acceptance_adv_pos"] == pytest.approx(admitted[adv > 0].mean())
  assert m["gate/acceptance_adv_neg"] == pytest.approx(admitted[adv < 0].mean())
  assert m["gate/admitted_adv_sum"] == pytest.approx((adv * admitted).sum(), abs=1e-5)
  # The stop token's log-probs: each stopped record's last action token.
  stopped = [i for i in range(8) if i not in (1, 4, 6)]
  last = [np.flatnonzero(mask[i])[-1] for i in range(8)]
  assert m["eos/logp_at_stop"] == pytest.approx(
      np.mean([lp[i][last[i]] for i in stopped]), rel=1e-4)
  assert m["eos/behavior_logp_at_stop"] == pytest.approx(
      np.mean([blogp[i][last[i]] for i in stopped]), rel=1e-6)
  pos = [i for i in stopped if adv[i] > 0]
  assert pos and m["eos/logp_at_stop_adv_pos"] == pytest.approx(
      np.mean([lp[i][last[i]] for i in pos]), rel=1e-4)
  # The same row is in metrics.jsonl.
  learner.close()
  (row,) = read_jsonl(tmp_path / "metrics.jsonl")
  assert row["mismatch/lag_0/abs_dlogp"] == pytest.approx(m["mismatch/lag_0/abs_dlogp"])
  assert row["gate/acceptance_len_q4"] == m["gate/acceptance_len_q4"]


def test_token_trust_metrics_count_the_tokens_the_loss_admitted(tmp_path):
  """Under trust="token" the gate admits tokens, not records: ess_fraction, admitted_tokens
  and token_acceptance_rate are over exactly the tokens with d_it <= delta (NumPy, from an
  independent scoring), not over the tokens of records with no gated token."""
  model = registry.load("tiny-llama")
  trajs, lp, blogp, mask, d = _shifted_batch(model)
  # About half the tokens pass: delta in the widest relative gap between neighbouring d's of
  # the middle half, above the unshifted records' float noise (|d| < 1e-15), so no token sits
  # near the threshold (at the median, 1.178e-4, two tokens did, and the learner's float32
  # d_it put one on the other side).
  s = np.sort(np.concatenate(d))
  lo, hi = len(s) // 4, 3 * len(s) // 4
  ratio = np.where(s[lo:hi] > 1e-9, s[lo + 1:hi + 1] / np.maximum(s[lo:hi], 1e-30), 0)
  i = lo + int(np.argmax(ratio))
  assert s[i + 1] > 2 * s[i]
  delta = float(np.sqrt(s[i] * s[i + 1]))
  learner = Learner(tiny_config(**{"objective.delta": delta, "objective.trust": "token",
                                   "log.dir": str(tmp_path)}), model=model)
  m = learner.update(trajs, lags=[0] * 8)
  learner.close()
  gate = [di <= delta for di in d]  # per record, over its action tokens
  w = np.concatenate([np.exp(a - b)[k][g] for a, b, k, g in zip(lp, blogp, mask, gate)])
  n_tok = sum(k.sum() for k in mask)
  assert 0 < w.size < n_tok
  assert m["ess_fraction"] == pytest.approx(w.sum() ** 2 / (w.size * (w ** 2).sum()), rel=1e-4)
  assert m["admitted_tokens"] == w.size
  assert m["token_acceptance_rate"] == pytest.approx(w.size / n_tok)
  # A record counts as admitted when none of its action tokens was gated.
  assert m["acceptance_rate"] == pytest.approx(np.mean([g.all() for g in gate]))


def test_token_kl_by_behaviour_probability(tmp_path):
  """`d_by_p/<bin>/...`: the token share, mean Bernoulli KL and share above delta of the tokens
  in each bin of the behaviour's probability p, against NumPy from an independent scoring.
  The behaviour log-probs are drawn so that every bin has tokens (p = 1 - 10^-u)."""
  model = registry.load("tiny-llama")
  trajs, lp, _, mask, _ = _shifted_batch(model)
  rng = np.random.default_rng(1)
  blogp = []
  for t in trajs:
    p = 1.0 - 10.0 ** -rng.uniform(0.05, 4.0, t.action_mask.shape)
    t.behavior_logp = np.where(t.action_mask, np.log(p), 0.0).astype(np.float32)
    blogp.append(t.behavior_logp.astype(np.float64))
  delta = 1.0
  learner = Learner(tiny_config(**{"objective.delta": delta, "log.dir": str(tmp_path)}),
                    model=model)
  m = learner.update(trajs, lags=[0] * 8)
  learner.close()
  p_all = np.exp(np.concatenate([b[k] for b, k in zip(blogp, mask)]))
  q_all = np.exp(np.concatenate([a[k] for a, k in zip(lp, mask)]))
  d_all = np.array([bern_kl(p, q) for p, q in zip(p_all, q_all)])
  bins = np.digitize(p_all, [0.5, 0.9, 0.99, 0.999])
  names = ("p0_50", "p50_90", "p90_99", "p99_999", "p999_1")
  assert set(bins) == set(range(len(names)))
  assert 0 < (d_all > delta).mean() < 1
  for k, name in enumerate(names):
    sel = bins == k
    assert m[f"d_by_p/{name}/tokens"] == pytest.approx(sel.mean(), abs=1e-6)
    assert m[f"d_by_p/{name}/token_kl"] == pytest.approx(d_all[sel].mean(), rel=2e-3)
    assert m[f"d_by_p/{name}/over_delta"] == pytest.approx((d_all[sel] > delta).mean(),
                                                           abs=1e-6)
