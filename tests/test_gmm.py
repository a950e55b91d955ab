"""fr_jax.models.gmm: the grouped expert matmuls (Pallas-Triton kernels, interpret mode on this
CPU) against a NumPy per-group reference, forward and both gradients, and the tile schedule's
invariants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fr_jax.models import gmm

# (rows M, K, N, group sizes): K and N above one block (TK, TN) and not multiples of it; groups
# longer than a row tile, empty groups, every row in one group, rows past the groups.
CASES = {
    "mixed": (200, 150, 200, [70, 0, 1, 64, 0, 45]),  # 180 of 200 rows
    "one_group": (96, 40, 24, [0, 96, 0]),
    "all_empty": (33, 20, 17, [0, 0, 0, 0]),
    "ragged_tail": (130, 64, 128, [3, 5, 120]),  # 128 of 130 rows
}


def reference(lhs, rhs, sizes, dy):
  """out = lhs_g @ rhs_g per group (rows past the groups 0) and the gradients of
  sum(out * dy), by the hand: dlhs_g = dy_g @ rhs_g^T, drhs_g = lhs_g^T @ dy_g."""
  lhs, rhs, dy = (np.asarray(a, np.float64) for a in (lhs, rhs, dy))
  out, dlhs, drhs = np.zeros((len(lhs), rhs.shape[2])), np.zeros_like(lhs), np.zeros_like(rhs)
  r = 0
  for g, n in enumerate(sizes):
    rows = slice(r, r + n)
    out[rows] = lhs[rows] @ rhs[g]
    dlhs[rows] = dy[rows] @ rhs[g].T
    drhs[g] = lhs[rows].T @ dy[rows]
    r += n
  return out, dlhs, drhs


def operands(M, K, N, sizes, seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  lhs = rng.standard_normal((M, K)).astype(dtype)
  rhs = rng.standard_normal((len(sizes), K, N)).astype(dtype)
  dy = rng.standard_normal((M, N)).astype(dtype)
  return lhs, rhs, np.asarray(sizes, np.int32), dy


@pytest.mark.parametrize("case", CASES)
def test_forward_and_gradients_equal_the_per_group_reference(case):
  M, K, N, sizes = CASES[case]
  lhs, rhs, sizes, dy = operands(M, K, N, sizes)
  out, vjp = jax.vjp(lambda a, b: gmm.gmm(a, b, sizes), lhs, rhs)
  dlhs, drhs = vjp(jnp.asarray(dy))
  want = reference(lhs, rhs, sizes, dy)
  for got, ref in zip((out, dlhs, drhs), want):
    scale = max(1.0, np.abs(ref).max())
    assert np.abs(np.asarray(got, np.float64) - ref).max() <= 1e-5 * scale
  # Rows past the groups are exactly 0, and so is their input gradient; an empty group's
  # weight gradient is exactly 0.
  tail = slice(int(sizes.sum()), M)
  assert not np.asarray(out)[tail].any() and not np.asarray(dlhs)[tail].any()
  assert not np.asarray(drhs)[sizes == 0].any()


def test_equals_ragged_dot_under_jit_in_bfloat16():
  """The learner's dtypes: bf16 operands, f32 results and accumulation; the gradients come
  back in the operands' dtype."""
  M, K, N, sizes = CASES["mixed"]
  lhs, rhs, sizes, dy = operands(M, K, N, sizes, seed=1)
  lhs, rhs = jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16)

  def loss(f, a, b):
    return jnp.sum(f(a, b) * dy)

  ours = jax.jit(jax.value_and_grad(lambda a, b: loss(
      lambda x, w: gmm.gmm(x, w, sizes), a, b), (0, 1)))(lhs, rhs)
  peer = jax.jit(jax.value_and_grad(lambda a, b: loss(
      lambda x, w: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32),
      a, b), (0, 1)))(lhs, rhs)
  assert ours[1][0].dtype == ours[1][1].dtype == jnp.bfloat16
  np.testing.assert_allclose(ours[0], peer[0], rtol=1e-5)
  for a, b in zip(ours[1], peer[1]):  # one bf16 rounding of f32 sums apart at most
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.abs(a - b).max() <= 2 ** -7 * np.abs(b).max()


@pytest.mark.parametrize("sizes", [[0, 0, 7], [64, 64], [1, 0, 63, 65, 0, 2], [0, 0, 0]])
def test_row_tiles_cover_each_row_once_inside_its_group(sizes):
  M, tm = 200, 64
  sizes = np.asarray(sizes, np.int32)
  group, first, end = (np.asarray(a) for a in gmm.tiles(jnp.asarray(sizes), M, tm))
  assert len(group) == gmm.num_tiles(M, len(sizes), tm)
  owner = np.concatenate([np.repeat(np.arange(len(sizes)), sizes),
                          np.full(M - sizes.sum(), len(sizes))])  # G: rows past the groups
  seen = np.zeros(M, int)
  for g, a, b in zip(group, first, end):
    assert 0 <= b - a <= tm
    seen[a:b] += 1
    assert (owner[a:b] == g).all()
  assert (seen == 1).all()
