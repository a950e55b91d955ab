"""fr_jax.objective against hand-derived vectors and the NumPy reference (tests/np_reference)."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fr_jax import objective as obj
from tests import np_reference as ref

ln = math.log


def _loss_and_grad(fn, logp, *args, **kw):
  (loss, aux), g = jax.value_and_grad(lambda lp: fn(lp, *args, **kw), has_aux=True)(
      jnp.asarray(logp, jnp.float32))
  return float(loss), np.asarray(g), jax.tree.map(np.asarray, aux)


# --- the two hand vectors ---------------------------------------------------------------

GRAD_CASE = dict(
    # row 0: q = (1/2, 1/4), p = (1/2, 1/8) -> rho = (1, 2);  row 1: q = p = 0.8 -> rho = 1.
    logp=[[ln(0.5), ln(0.25), 0.0], [ln(0.8), 0.0, 0.0]],
    behavior_logp=[[ln(0.5), ln(0.125), 0.0], [ln(0.8), 0.0, 0.0]],
    rewards=[1.0, 0.0],  # mean 1/2 -> A = (+1/2, -1/2)
    action_mask=[[True, True, False], [True, False, False]],  # T = (2, 1)
)


@pytest.mark.parametrize("reduction,advantage,want_loss,want_grad", [
    # L = -(1/2)[(1/2)/2 (1 ln 1/2 + 2 ln 1/4) + (-1/2)/1 ln 0.8]
    ("sample_mean", "batch_centered",
     -0.5 * (0.25 * (ln(0.5) + 2 * ln(0.25)) - 0.5 * ln(0.8)),
     [[-0.125, -0.25, 0.0], [0.25, 0.0, 0.0]]),
    # token mean: weights A_i / sum_j T_j = A_i / 3
    ("token_mean", "batch_centered",
     -((0.5 / 3) * (ln(0.5) + 2 * ln(0.25)) - (0.5 / 3) * ln(0.8)),
     [[-1 / 6, -1 / 3, 0.0], [1 / 6, 0.0, 0.0]]),
    # positive only: A = R = (1, 0)
    ("sample_mean", "positive_only",
     -0.5 * (0.5 * (ln(0.5) + 2 * ln(0.25))),
     [[-0.25, -0.5, 0.0], [0.0, 0.0, 0.0]]),
])
def test_gradient_vector_by_hand(reduction, advantage, want_loss, want_grad):
  c = GRAD_CASE
  loss, g, aux = _loss_and_grad(
      obj.flash_reinforce_loss, c["logp"], c["behavior_logp"], c["rewards"], c["action_mask"],
      delta=math.inf, reduction=reduction, advantage=advantage)
  assert loss == pytest.approx(want_loss, abs=1e-6)
  np.testing.assert_allclose(g, want_grad, atol=1e-6)
  assert aux["ratio_max"] == pytest.approx(2.0, rel=1e-6)
  assert aux["ratio_mean"] == pytest.approx(4 / 3, rel=1e-6)  # (1 + 2 + 1) / 3 tokens
  assert aux["acceptance_rate"] == 1.0


def test_constant_length_gradient_by_hand():
  """constant_length with L = 4: every trajectory's weight is A_i / (B L) = A_i / 8, whatever
  its length (sample_mean gave the 2-token row half the 1-token row's per-token weight)."""
  c = GRAD_CASE
  loss, g, _ = _loss_and_grad(
      obj.flash_reinforce_loss, c["logp"], c["behavior_logp"], c["rewards"], c["action_mask"],
      delta=math.inf, reduction="constant_length", length_norm=4.0)
  assert loss == pytest.approx(-((0.5 / 8) * (ln(0.5) + 2 * ln(0.25)) - (0.5 / 8) * ln(0.8)),
                               abs=1e-6)
  np.testing.assert_allclose(g, [[-1 / 16, -1 / 8, 0.0], [1 / 16, 0.0, 0.0]], atol=1e-6)
  with pytest.raises(ValueError, match="length_norm > 0"):
    obj.flash_reinforce_loss(c["logp"], c["behavior_logp"], c["rewards"], c["action_mask"],
                             reduction="constant_length")


def test_gate_vector_by_hand():
  # row 0: p = q = 1/2 twice -> D = 0.  row 1: (p=1/2, q=0.6) and (p = q = 0.9) ->
  # D = [1/2 ln(0.5/0.6) + 1/2 ln(0.5/0.4)] / 2.  row 2: p = q = 0.9 -> D = 0.
  d_row1 = (0.5 * ln(0.5 / 0.6) + 0.5 * ln(0.5 / 0.4)) / 2
  assert d_row1 == pytest.approx(0.0102055, abs=1e-6)
  logp = [[ln(0.5), ln(0.5)], [ln(0.6), ln(0.9)], [ln(0.9), 0.0]]
  blogp = [[ln(0.5), ln(0.5)], [ln(0.5), ln(0.9)], [ln(0.9), 0.0]]
  mask = [[True, True], [True, True], [True, False]]
  rewards = [1.0, 1.0, 0.0]  # mean 2/3: the rejected row still counts -> A = (1/3, 1/3, -2/3)
  A = [1 / 3, 1 / 3, -2 / 3]

  loss, g, aux = _loss_and_grad(obj.flash_reinforce_loss, logp, blogp, rewards, mask,
                                delta=3e-3)
  np.testing.assert_allclose(aux["seq_kl"], [0.0, d_row1, 0.0], atol=1e-6)
  np.testing.assert_array_equal(aux["admitted"], [True, False, True])
  np.testing.assert_allclose(aux["advantages"], A, atol=1e-6)
  assert aux["acceptance_rate"] == pytest.approx(2 / 3)
  # B = 3 even though row 1 is rejected; all admitted rows have rho = 1.
  want = -(1 / 3) * (A[0] / 2 * (ln(0.5) + ln(0.5)) + A[2] / 1 * ln(0.9))
  assert loss == pytest.approx(want, abs=1e-6)
  np.testing.assert_allclose(
      g, [[-(1 / 3) * A[0] / 2] * 2, [0.0, 0.0], [-(1 / 3) * A[2], 0.0]], atol=1e-6)

  # The bound is inclusive: with delta = 0, D = 0 rows are admitted, row 1 is not.
  _, _, aux0 = _loss_and_grad(obj.flash_reinforce_loss, logp, blogp, rewards, mask, delta=0.0)
  np.testing.assert_array_equal(aux0["admitted"], [True, False, True])
  # Just above D_1 admits row 1; delta = inf admits all.
  for delta in (0.0103, math.inf):
    _, _, a = _loss_and_grad(obj.flash_reinforce_loss, logp, blogp, rewards, mask, delta=delta)
    np.testing.assert_array_equal(a["admitted"], [True, True, True])
  # Token-local gate at 0.02: row 1's first token has d = 0.0204 > 0.02, its second d = 0.
  _, gt, at = _loss_and_grad(obj.flash_reinforce_loss, logp, blogp, rewards, mask,
                             delta=0.02, trust="token")
  assert at["token_acceptance_rate"] == pytest.approx(4 / 5)
  np.testing.assert_allclose(gt[1], [0.0, -(1 / 3) * A[1] / 2], atol=1e-6)
  # Just above that token's d = 0.0204 it is admitted with its weight rho = 0.6 / 0.5; the
  # other rows are as before. The NumPy reference agrees on both sides of the gate.
  _, gu, au = _loss_and_grad(obj.flash_reinforce_loss, logp, blogp, rewards, mask,
                             delta=0.021, trust="token")
  assert au["token_acceptance_rate"] == 1.0
  np.testing.assert_allclose(gu[1], [-(1 / 3) * A[1] / 2 * (0.6 / 0.5), -(1 / 3) * A[1] / 2],
                             atol=1e-6)
  np.testing.assert_allclose(gu[[0, 2]], gt[[0, 2]], atol=1e-7)
  for delta, got in ((0.02, gt), (0.021, gu)):
    _, want_g, _ = ref.flash_reinforce(logp, blogp, rewards, mask, delta=delta, trust="token")
    np.testing.assert_allclose(got, want_g, atol=1e-6)


def test_clamp_at_probability_one():
  # p = q = 1 both clamp to 1 - 1e-6, so d = 0; p = 1, q = 1/2 is a large finite KL.
  logp = [[0.0, ln(0.5)]]
  blogp = [[0.0, 0.0]]
  _, _, aux = _loss_and_grad(obj.flash_reinforce_loss, logp, blogp, [1.0], [[True, False]])
  assert aux["seq_kl"][0] == pytest.approx(0.0, abs=1e-6)
  _, _, aux = _loss_and_grad(obj.flash_reinforce_loss, [[ln(0.5)]], [[0.0]], [1.0], [[True]])
  p, q = 1 - 1e-6, 0.5
  want = p * ln(p / q) + (1 - p) * ln((1 - p) / (1 - q))
  assert aux["seq_kl"][0] == pytest.approx(want, rel=1e-4)


# --- random cases against the NumPy reference -----------------------------------------------

def random_case(rng, B=6, T=9, drift=0.15):
  mask = rng.random((B, T)) < 0.7
  mask[:, 0] = True  # every row has >= 1 action token
  blogp = np.log(rng.uniform(0.02, 1.0, (B, T)))
  # Learner log-probs drift from the behaviour ones by a per-row amount, capped at 0.
  scale = rng.uniform(0.0, drift, (B, 1))
  logp = np.minimum(blogp + scale * rng.standard_normal((B, T)), -1e-3)
  blogp = np.where(mask, blogp, 0.0)
  rewards = rng.integers(0, 2, B).astype(np.float64) + 0.25 * rng.standard_normal(B)
  return logp, blogp, rewards, mask


def _safe_delta(values, rng):
  """A delta between two observed values, away from all of them (f32 vs f64 safety)."""
  v = np.sort(np.asarray(values))
  gaps = np.diff(v)
  k = int(np.argmax(gaps[1:-1])) + 1 if len(gaps) > 2 else int(np.argmax(gaps))
  return float((v[k] + v[k + 1]) / 2)


VARIANTS = list(itertools.product(
    ["sample_mean", "token_mean", "constant_length"],
    ["sequence", "token", "none", "sequence_negative"], ["batch_centered", "positive_only"]))


@pytest.mark.parametrize("reduction,trust,advantage", VARIANTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_numpy_reference(reduction, trust, advantage, seed):
  rng = np.random.default_rng(seed)
  logp, blogp, rewards, mask = random_case(rng)
  if trust in ("sequence", "sequence_negative"):
    _, _, a = ref.flash_reinforce(logp, blogp, rewards, mask, delta=math.inf,
                                  advantage=advantage)
    gated = [d for d, adv in zip(a["seq_kl"], a["advantages"])  # the ones it can gate
             if trust == "sequence" or adv < 0]
    delta = _safe_delta(gated if len(gated) > 1 else a["seq_kl"], rng)
  else:
    ds = [ref.bern_kl(math.exp(blogp[i, t]), math.exp(logp[i, t]))
          for i, t in zip(*np.nonzero(mask))]
    delta = _safe_delta(ds, rng)
  kw = dict(delta=delta, reduction=reduction, trust=trust, advantage=advantage,
            length_norm=7.0 if reduction == "constant_length" else None)
  want_loss, want_grad, want = ref.flash_reinforce(logp, blogp, rewards, mask, **kw)
  loss, g, aux = _loss_and_grad(obj.flash_reinforce_loss, logp, blogp, rewards, mask, **kw)

  if trust == "sequence_negative":  # only negative advantages are ever gated
    assert all(adv < 0 for adv, ok in zip(want["advantages"], want["admitted"]) if not ok)
    assert not all(want["admitted"]) or sum(a < 0 for a in want["advantages"]) < 2
  elif trust != "none":  # the case must exercise both sides of the gate
    assert 0 < want["token_acceptance_rate"] < 1
  assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
  np.testing.assert_allclose(g, want_grad, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(aux["advantages"], want["advantages"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(aux["seq_kl"], want["seq_kl"], rtol=1e-3, atol=2e-6)
  np.testing.assert_array_equal(aux["admitted"], want["admitted"])
  for k in ("acceptance_rate", "token_acceptance_rate", "ratio_mean", "ratio_max", "ratio_min"):
    assert float(aux[k]) == pytest.approx(want[k], rel=1e-5), k


def test_bf16_inputs_are_promoted():
  rng = np.random.default_rng(3)
  logp, blogp, rewards, mask = random_case(rng)
  lp16 = jnp.asarray(logp, jnp.bfloat16)
  bl16 = jnp.asarray(blogp, jnp.bfloat16)
  loss, aux = obj.flash_reinforce_loss(lp16, bl16, rewards, mask, delta=math.inf)
  assert loss.dtype == jnp.float32
  want, _, _ = ref.flash_reinforce(np.asarray(lp16, np.float64), np.asarray(bl16, np.float64),
                                   rewards, mask, delta=math.inf)
  assert float(loss) == pytest.approx(want, rel=1e-5)


def test_bad_choice_names_the_value():
  with pytest.raises(ValueError, match="reduction='mean'"):
    obj.flash_reinforce_loss(jnp.zeros((1, 1)), jnp.zeros((1, 1)), jnp.zeros(1),
                             jnp.ones((1, 1), bool), reduction="mean")
  with pytest.raises(ValueError, match="trust='seq'"):
    obj.flash_reinforce_loss(jnp.zeros((1, 1)), jnp.zeros((1, 1)), jnp.zeros(1),
                             jnp.ones((1, 1), bool), trust="seq")


def test_jit_with_static_variant():
  rng = np.random.default_rng(4)
  logp, blogp, rewards, mask = random_case(rng)
  f = jax.jit(obj.flash_reinforce_loss, static_argnames=("reduction", "trust", "advantage"))
  loss, _ = f(logp, blogp, rewards, mask, delta=1e-2, trust="token")
  want, _, _ = ref.flash_reinforce(logp, blogp, rewards, mask, delta=1e-2, trust="token")
  assert float(loss) == pytest.approx(want, rel=1e-5)


# --- GRPO baseline and PPO-clip ---------------------------------------------------------------

def test_group_advantages_by_hand():
  # group 0: (1, 0, 1) mean 2/3, unbiased std sqrt(1/3); group 1: (0.5,) -> 0.
  r, g = [1.0, 0.0, 1.0, 0.5], [0, 0, 0, 1]
  s = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)
  want = [(1 / 3) / (s + 1e-6), (-2 / 3) / (s + 1e-6), (1 / 3) / (s + 1e-6), 0.0]
  np.testing.assert_allclose(obj.group_advantages(r, g), want, rtol=1e-5)
  np.testing.assert_allclose(obj.group_advantages(r, g, normalize_std=False),
                             [1 / 3, -2 / 3, 1 / 3, 0.0], atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_group_advantages_random(seed):
  rng = np.random.default_rng(seed)
  r = rng.standard_normal(16)
  g = rng.integers(0, 5, 16)
  for norm in (True, False):
    np.testing.assert_allclose(obj.group_advantages(r, g, norm),
                               ref.group_advantages(r, g, norm), rtol=1e-4, atol=1e-5)


def test_ppo_clip_by_hand():
  # Ratios e^{0.5} = 1.65 (A > 0: clipped at 1.2, no grad) and e^{-0.1} = 0.905 (inside).
  logp = [[-0.5, -1.0]]
  old = [[-1.0, -0.9]]
  loss, g, aux = _loss_and_grad(obj.ppo_clip_loss, logp, old, [2.0], [[True, True]])
  want = -(1 / 2) * (1.2 * 2.0 + math.exp(-0.1) * 2.0)
  assert loss == pytest.approx(want, rel=1e-6)
  np.testing.assert_allclose(g, [[0.0, -(1 / 2) * math.exp(-0.1) * 2.0]], rtol=1e-6)
  assert aux["clip_fraction"] == pytest.approx(0.5)


@pytest.mark.parametrize("reduction", ["sample_mean", "token_mean", "constant_length"])
@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_clip_random(reduction, seed):
  rng = np.random.default_rng(seed)
  logp, blogp, _, mask = random_case(rng, drift=0.4)
  old = np.where(mask, blogp, 0.0)
  adv = rng.standard_normal(logp.shape[0])
  L = 9.0 if reduction == "constant_length" else None
  want_loss, want_grad = ref.ppo_clip(logp, old, adv, mask, eps=0.2, eps_high=0.28,
                                      reduction=reduction, length_norm=L)
  loss, g, _ = _loss_and_grad(obj.ppo_clip_loss, logp, old, adv, mask, clip_eps=0.2,
                              clip_eps_high=0.28, reduction=reduction, length_norm=L)
  assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
  np.testing.assert_allclose(g, want_grad, rtol=1e-5, atol=1e-7)
