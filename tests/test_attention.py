"""The attention paths against the naive reference (scores and the [L, S] mask in full), for
outputs and gradients, f32, at most 1e-5: many segments per row, one segment filling a row,
padding, lengths that are not whole blocks, GQA and MHA, caches; and the whole decoder
(Qwen2 biases, Qwen3 q/k-norm) with flash against naive.

Modes: the flash kernel is plain JAX, tested on the CPU backend as it runs everywhere; the
Pallas GPU kernel (`pallas_gpu`) and the Pallas TPU splash kernel (`splash_tpu`) run here in
Pallas interpret mode (their Triton and Mosaic lowerings need the accelerator: `make
device-check` runs the GPU one compiled)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fr_jax.models import attention as A
from fr_jax.models import decoder, registry
from fr_jax.models.flash import flash_attention
from tests.helpers import forward

TOL = 1e-5


def qkv(rng, B, L, S, H, KVH, hd):
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
  return f(B, L, H, hd), f(B, S, KVH, hd), f(B, S, KVH, hd)


def rows(L, *lengths_per_row):
  """Segment ids [R, L]: each row's segments 1, 2, ... of the given lengths, then 0 padding."""
  seg = np.zeros((len(lengths_per_row), L), np.int32)
  for r, lengths in enumerate(lengths_per_row):
    at = 0
    for s, n in enumerate(lengths, 1):
      seg[r, at:at + n] = s
      at += n
  return jnp.asarray(seg)


def check(vis, q, k, v, **kw):
  """flash == naive for outputs and the gradients of a random projection of them."""
  naive = lambda q, k, v: A.attention(q, k, v, A.dense_mask(vis), jnp.float32)  # noqa: E731
  flash = lambda q, k, v: flash_attention(q, k, v, *vis, **kw)  # noqa: E731
  np.testing.assert_allclose(flash(q, k, v), naive(q, k, v), atol=TOL, rtol=0)
  w = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape), jnp.float32)
  loss = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2)))  # noqa
  for g_f, g_n, name in zip(loss(flash)(q, k, v), loss(naive)(q, k, v), "qkv"):
    np.testing.assert_allclose(g_f, g_n, atol=TOL, rtol=0, err_msg=f"d{name}")


@pytest.mark.parametrize("H,KVH", [(4, 2), (3, 3), (8, 1)])
def test_packed_rows_many_segments_and_padding(H, KVH):
  L = 200  # not a whole number of blocks of 32 or 48
  seg = rows(L, [37, 1, 60, 2, 50, 30], [200], [120, 33], [5] * 40)
  q, k, v = qkv(np.random.default_rng(H), 4, L, L, H, KVH, 16)
  check(A.packed_visibility(seg), q, k, v, block_q=48, block_k=32)


def test_one_segment_filling_a_row_in_one_block_and_many():
  seg = rows(96, [96])
  q, k, v = qkv(np.random.default_rng(1), 1, 96, 96, 4, 2, 8)
  for bq, bk in [(96, 96), (32, 8)]:
    check(A.packed_visibility(seg), q, k, v, block_q=bq, block_k=bk)


def test_a_padded_row_and_a_row_of_only_padding():
  seg = rows(64, [10], [])  # row 1 is all segment 0: padding attends to padding, causally
  q, k, v = qkv(np.random.default_rng(2), 2, 64, 64, 2, 1, 8)
  check(A.packed_visibility(seg), q, k, v, block_q=16, block_k=16)


def test_cache_queries_at_positions():
  """Prefill of T queries at positions p0..p0+T-1 over a cache of S slots (slots <= position),
  different start positions per row, as the engine's prefill into a cache."""
  B, T, S = 3, 40, 100
  pos = jnp.asarray(np.array([0, 17, 55])[:, None] + np.arange(T)[None, :], jnp.int32)
  q, k, v = qkv(np.random.default_rng(3), B, T, S, 4, 2, 8)
  check(A.cache_visibility(pos, S), q, k, v, block_q=16, block_k=16)


def test_bf16_compute_stays_close():
  seg = rows(128, [70, 58])
  q, k, v = qkv(np.random.default_rng(4), 1, 128, 128, 4, 2, 16)
  vis = A.packed_visibility(seg)
  ref = A.attention(q, k, v, A.dense_mask(vis), jnp.bfloat16)
  out = flash_attention(q, k, v, *vis, cd=jnp.bfloat16, block_q=32, block_k=32)
  np.testing.assert_allclose(out, ref, atol=3e-2)


@pytest.mark.parametrize("kernel,H,KVH", [
    (A.pallas_gpu_attention, 4, 2), (A.splash_tpu_attention, 4, 2),
    (A.splash_tpu_attention, 3, 3)])
def test_pallas_kernels_in_interpret_mode(kernel, H, KVH):
  """Packed rows (GQA and MHA, many segments, padding, a length that is not a whole
  128-block), Pallas interpret mode."""
  L = 200
  seg = rows(L, [70, 110], [200])
  q, k, v = qkv(np.random.default_rng(8), 2, L, L, H, KVH, 16)
  vis = A.packed_visibility(seg)
  pallas = lambda q, k, v: kernel(q, k, v, seg, jnp.float32)  # noqa: E731
  naive = lambda q, k, v: A.attention(q, k, v, A.dense_mask(vis), jnp.float32)  # noqa: E731
  np.testing.assert_allclose(pallas(q, k, v), naive(q, k, v), atol=TOL, rtol=0)
  w = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape), jnp.float32)
  grads = lambda f: jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(q, k, v)  # noqa
  for g_p, g_n, name in zip(grads(pallas), grads(naive), "qkv"):
    np.testing.assert_allclose(g_p, g_n, atol=TOL, rtol=0, err_msg=f"d{name}")


def test_auto_uses_naive_for_one_block_and_flash_above():
  assert A.resolve("auto", 256, backend="cpu") == "naive"
  assert A.resolve("auto", 257, backend="cpu") == "flash"
  assert A.resolve("auto", 8, backend="gpu") == "pallas_gpu"  # packed rows on a GPU
  assert A.resolve("auto", 8, backend="tpu") == "splash_tpu"  # packed rows on a TPU
  assert A.resolve("auto", 300, packed=False, backend="gpu") == "flash"  # a cache prefill
  assert A.resolve("auto", 300, packed=False, backend="tpu") == "flash"
  assert A.resolve("pallas_gpu", 300, packed=False) == "flash"
  assert A.resolve("splash_tpu", 300, packed=False) == "flash"
  assert A.resolve("naive", 10_000) == "naive" and A.resolve("flash", 8) == "flash"
  with pytest.raises(ValueError, match="attention='cudnnn'"):
    A.resolve("cudnnn", 8)


def test_flash_memory_is_linear_in_length():
  """The compiled backward's temporaries (XLA memory analysis): doubling L roughly doubles
  them for flash, and roughly quadruples them for the naive path."""
  def temp(impl, L):
    q, k, v = (jax.ShapeDtypeStruct((1, L, 4, 32), jnp.float32) for _ in range(3))
    vis = A.packed_visibility(jnp.ones((1, L), jnp.int32))
    f = lambda q, k, v: jnp.sum(A.attend(q, k, v, vis, jnp.float32, impl))  # noqa: E731
    c = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, k, v).compile()
    return c.memory_analysis().temp_size_in_bytes
  f1, f2 = temp("flash", 2048), temp("flash", 4096)
  n1, n2 = temp("naive", 2048), temp("naive", 4096)
  assert f2 / f1 < 2.5, (f1, f2)
  assert n2 / n1 > 3.5, (n1, n2)
  assert f2 < n2 / 8, (f2, n2)


@pytest.mark.parametrize("name,impl", [  # Llama: the common part
    ("tiny-qwen2", "flash"), ("tiny-qwen3", "flash"), ("tiny-qwen3", "splash_tpu")])
def test_decoder_forward_and_grads_equal_naive(name, impl):
  """Whole-model packed scoring: every layer's attention by `impl` against naive (Qwen2 q/k/v
  biases, Qwen3 q/k RMSNorm, GQA), outputs and parameter gradients (splash_tpu: interpret
  mode)."""
  m = registry.load(name, seed=3)
  L = 160
  seg = rows(L, [50, 1, 70, 20], [160])
  pos = jnp.asarray(np.concatenate([np.arange(n) for n in [50, 1, 70, 20, 19]])[None]
                    .repeat(2, 0)[:, :L])
  pos = pos.at[1].set(jnp.arange(L))
  toks = jnp.asarray(np.random.default_rng(5).integers(0, 250, (2, L)), jnp.int32)

  def loss(params, impl):
    cfg = m.config.replace(attention=impl)
    h, _ = forward(params, cfg, toks, pos, seg)
    return jnp.sum(h * jnp.sin(jnp.arange(h.shape[-1]))), h

  (l_f, h_f), g_f = jax.value_and_grad(loss, has_aux=True)(m.params, impl)
  (l_n, h_n), g_n = jax.value_and_grad(loss, has_aux=True)(m.params, "naive")
  np.testing.assert_allclose(h_f, h_n, atol=TOL, rtol=0)
  flat_f, flat_n = jax.tree.leaves(g_f), jax.tree.leaves(g_n)
  for a, b in zip(flat_f, flat_n):
    np.testing.assert_allclose(a, b, atol=TOL * max(1.0, float(jnp.abs(b).max())), rtol=0)


def test_cached_prefill_longer_than_a_block_uses_flash_and_equals_packed_naive():
  """Engine prefill of a 300-token prompt into a cache (auto: flash, over the cache's slots
  up to each position) gives the hidden states of the packed forward by the naive path."""
  m = registry.load("tiny-qwen3", seed=4)
  T, S = 300, 320
  assert A.resolve("auto", T, packed=False, backend="cpu") == "flash"
  toks = jnp.asarray(np.random.default_rng(6).integers(0, 250, (2, T)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(T), (2, T))
  cache = decoder.init_cache(m.config, 2, S)
  h_cache, _ = forward(m.params, m.config, toks, pos, cache=cache)
  h_naive, _ = forward(m.params, m.config.replace(attention="naive"), toks, pos,
                               jnp.ones_like(toks))
  np.testing.assert_allclose(h_cache, h_naive, atol=TOL, rtol=0)
