"""The embedded engine: behaviour log-probs == teacher-forced scoring, continuous batching ==
one at a time, no recompiles after warm-up, weight swaps between decode steps."""

import jax
import numpy as np
import pytest
from scipy.special import log_softmax

from fr_jax.models import decoder, registry
from fr_jax.rollout.embedded import EmbeddedEngine
from fr_jax.rollout.engine import Request
from tests.helpers import forward, teacher_forced


@pytest.fixture(scope="module")
def tiny():
  return registry.load("tiny-qwen3", seed=21)


def requests(n, rng, **kw):
  out = []
  for i in range(n):
    P = int(rng.integers(1, 40))
    out.append(Request(f"r{i}", rng.integers(0, 256, P).tolist(),
                       max_new_tokens=int(rng.integers(1, 20)), seed=i, **kw))
  return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced_scoring(tiny, temperature):
  eng = EmbeddedEngine(tiny.config, tiny.params, num_slots=4, max_len=128)
  rng = np.random.default_rng(0)
  reqs = requests(6, rng, temperature=temperature)
  for r in reqs:
    r.max_new_tokens = 24
  for r, c in zip(reqs, eng.generate(reqs)):
    assert c.finish_reason == "length" and len(c.token_ids) == 24
    np.testing.assert_allclose(c.logprobs, teacher_forced(tiny.params, tiny.config,
                                                          r.prompt_ids, c.token_ids,
                                                          temperature), atol=1e-4)


def test_continuous_batching_equals_one_at_a_time(tiny):
  eng = EmbeddedEngine(tiny.config, tiny.params, num_slots=3, max_len=96)
  rng = np.random.default_rng(1)
  reqs = requests(10, rng, temperature=1.0, top_p=0.9)
  batched = eng.generate(reqs)
  alone = [eng.generate([r])[0] for r in reqs]
  for b, a in zip(batched, alone):
    assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-6)
  assert [c.request_id for c in batched] == [r.request_id for r in reqs]
  # Different seeds really sample differently.
  other = eng.generate([Request("x", reqs[0].prompt_ids, 19, seed=999)])[0]
  assert other.token_ids != batched[0].token_ids[:19] or len(batched[0].token_ids) < 5


def test_no_recompiles_after_warmup_over_100_requests(tiny):
  eng = EmbeddedEngine(tiny.config, tiny.params, num_slots=4, max_len=128)
  warm = [Request(f"w{b}", [1] * b, 2) for b in (1, 17, 33, 65)]  # one prompt per bucket
  c0 = eng.compile_counts  # (jit caches are per process: count differences)
  eng.generate(warm)
  before = eng.compile_counts
  rng = np.random.default_rng(2)
  reqs = requests(100, rng, temperature=0.8)
  outs = eng.generate(reqs)
  assert len(outs) == 100 and all(c.token_ids for c in outs)
  assert eng.compile_counts == before
  assert before["prefill"] - c0["prefill"] <= len(eng.buckets)
  assert before["decode"] - c0["decode"] <= len(eng.windows)


def test_stop_tokens_and_limits(tiny):
  eng = EmbeddedEngine(tiny.config, tiny.params, num_slots=2, max_len=40)
  r = Request("a", [5, 6, 7], max_new_tokens=30, temperature=0.0)
  greedy = eng.generate([r])[0].token_ids
  stop = greedy[3]
  c = eng.generate([Request("b", [5, 6, 7], 30, temperature=0.0, stop_token_ids=(stop,))])[0]
  assert c.finish_reason == "stop" and c.token_ids == greedy[:greedy.index(stop) + 1]
  c = eng.generate([Request("c", list(range(30)), 100, temperature=0.0)])[0]
  assert c.finish_reason == "length" and 30 + len(c.token_ids) == 41  # cache full
  with pytest.raises(ValueError, match="empty prompt"):
    eng.generate([Request("d", [], 3)])
  with pytest.raises(ValueError, match="outside"):
    eng.generate([Request("e", [300], 3)])


def mixed_cache_logprobs(old, new, cfg, prompt, out, n_old, temperature):
  """Log-probs of out[n_old:] for a request whose weights changed after it sampled out[:n_old]:
  the tokens fed before the swap (prompt + out[:n_old-1]) hold old-weight K/V, computed here
  by the old weights in one chunk into a fresh cache; the new weights then run the remaining
  fed tokens (out[n_old-1:-1]) over that cache in one chunk."""
  fed_old = list(prompt) + list(out[:n_old - 1])
  fed_new = list(out[n_old - 1:-1])
  cache = decoder.init_cache(cfg, 1, len(fed_old) + len(fed_new))
  _, cache = forward(old, cfg, np.array([fed_old]), np.arange(len(fed_old))[None],
                             cache=cache)
  h, _ = forward(new, cfg, np.array([fed_new]),
                         len(fed_old) + np.arange(len(fed_new))[None], cache=cache)
  z = np.asarray(decoder.logits_from_hidden(new, cfg, h), np.float64)[0] / temperature
  return log_softmax(z, -1)[np.arange(len(fed_new)), out[n_old:]]


def test_weights_swap_between_decode_steps(tiny):
  other = registry.load("tiny-qwen3", seed=22)
  eng = EmbeddedEngine(tiny.config, tiny.params, num_slots=2, max_len=64)
  r = Request("s", [3, 1, 4, 1, 5], max_new_tokens=12, temperature=1.0, seed=7)
  eng.generate([r])
  compiles = eng.compile_counts
  steps = []

  def hook():  # called once per scheduler step, between decode steps
    steps.append(1)
    if len(steps) == 5:
      eng.update_weights(other.params, 1)
    return False

  c = eng.generate([r], should_abort=hook)[0]
  # Step 1 prefills and decodes (tokens 0-1), steps 2-4 decode tokens 2-4 with the old
  # weights; the swap comes before step 5.
  assert c.versions == [0] * 5 + [1] * 7
  assert eng.compile_counts == compiles
  lp0 = teacher_forced(tiny.params, tiny.config, r.prompt_ids, c.token_ids, 1.0)
  np.testing.assert_allclose(c.logprobs[:5], lp0[:5], atol=1e-4)
  # The request continues in place: the new weights decode over the slot's cache, whose
  # entries for the prompt and tokens 0-3 the old weights wrote.
  mixed = mixed_cache_logprobs(tiny.params, other.params, tiny.config, r.prompt_ids,
                               c.token_ids, 5, 1.0)
  np.testing.assert_allclose(c.logprobs[5:], mixed, atol=1e-4)
  # That is not what a re-prefill by the new weights (SGLang's resume) gives.
  lp1 = teacher_forced(other.params, other.config, r.prompt_ids, c.token_ids, 1.0)
  assert np.abs(mixed - lp1[5:]).max() > 1e-2
  # The slot's entries are old-weight ones, so the next turn reuses none of them.
  before = dict(eng.stats)
  nxt = r.prompt_ids + c.token_ids + [9, 2]
  c2 = eng.generate([Request("s2", nxt, 4, seed=8)])[0]
  assert eng.stats["reused_tokens"] == before["reused_tokens"]
  assert eng.stats["prefill_tokens"] - before["prefill_tokens"] == len(nxt)
  np.testing.assert_allclose(c2.logprobs, teacher_forced(other.params, other.config, nxt,
                                                         c2.token_ids, 1.0), atol=1e-4)


def test_abort_keeps_partial_tokens(tiny):
  eng = EmbeddedEngine(tiny.config, tiny.params, num_slots=2, max_len=64)
  n = []
  reqs = [Request("a", [1, 2], 50), Request("b", [3], 50), Request("c", [4], 50)]
  outs = eng.generate(reqs, should_abort=lambda: n.append(1) or len(n) > 4)
  assert [c.finish_reason for c in outs] == ["abort"] * 3
  assert len(outs[0].token_ids) >= 4 and outs[2].token_ids == []
  jax.block_until_ready(eng.cache)


# --- prefix reuse across turns -------------------------------------------------------------

def run_sessions(eng, prompts, appended, turns, max_new=6, temperature=1.0):
  """Multi-turn sessions: each turn generates, then appends that session's scripted tokens
  (a tool response and the next header). Returns per session the list of (prompt, completion)
  per turn."""
  ctx = [list(p) for p in prompts]
  out = [[] for _ in prompts]
  for t in range(turns):
    reqs = [Request(f"s{i}t{t}", ctx[i], max_new, temperature=temperature, seed=100 * i + t)
            for i in range(len(prompts))]
    for i, c in enumerate(eng.generate(reqs)):
      out[i].append((list(ctx[i]), c))
      ctx[i] += c.token_ids + appended[i][t]
  return out


def scripted(rng, n_sessions, turns):
  prompts = [rng.integers(0, 256, int(rng.integers(5, 30))).tolist() for _ in range(n_sessions)]
  appended = [[rng.integers(0, 256, int(rng.integers(1, 12))).tolist() for _ in range(turns)]
              for _ in range(n_sessions)]
  return prompts, appended


def test_prefix_reuse_is_exact_and_prefills_only_the_new_tokens(tiny):
  rng = np.random.default_rng(5)
  prompts, appended = scripted(rng, 4, 4)
  reuse = EmbeddedEngine(tiny.config, tiny.params, num_slots=4, max_len=160)
  fresh = EmbeddedEngine(tiny.config, tiny.params, num_slots=4, max_len=160, prefix_reuse=False)
  a = run_sessions(reuse, prompts, appended, 4)
  b = run_sessions(fresh, prompts, appended, 4)
  expect_prefill = 0
  for sa, sb in zip(a, b):
    for t, ((pa, ca), (pb, cb)) in enumerate(zip(sa, sb)):
      assert pa == pb and ca.token_ids == cb.token_ids
      np.testing.assert_allclose(ca.logprobs, cb.logprobs, atol=1e-4)
      # The independent reference: teacher-forced scoring of the whole context.
      np.testing.assert_allclose(ca.logprobs, teacher_forced(tiny.params, tiny.config, pa,
                                                             ca.token_ids, 1.0), atol=1e-4)
      # Turn t > 0 holds the previous context and all but the last generated token.
      expect_prefill += len(pa) if t == 0 else len(pa) - (len(sa[t - 1][0])
                                                          + len(sa[t - 1][1].token_ids) - 1)
  assert reuse.stats["prefill_tokens"] == expect_prefill
  assert fresh.stats["prefill_tokens"] == sum(len(p) for s in b for p, _ in s)
  assert reuse.stats["evictions"] == 0


def test_eviction_is_lru_and_stays_exact(tiny):
  # Three sessions on two slots, one session per generate call, round robin: each turn the
  # least recently used slot goes, which is always the one the next session needs.
  rng = np.random.default_rng(6)
  prompts, appended = scripted(rng, 3, 3)
  eng = EmbeddedEngine(tiny.config, tiny.params, num_slots=2, max_len=128)
  ctx = [list(p) for p in prompts]
  for t in range(3):
    for i in range(3):
      before = dict(eng.stats)
      c = eng.generate([Request(f"s{i}t{t}", ctx[i], 5, seed=i)])[0]
      np.testing.assert_allclose(c.logprobs, teacher_forced(tiny.params, tiny.config, ctx[i],
                                                            c.token_ids, 1.0), atol=1e-4)
      if t > 0 or i == 2:  # slots full: evicted, so the whole context is prefilled
        assert eng.stats["evictions"] == before.get("evictions", 0) + 1
        assert eng.stats["prefill_tokens"] - before["prefill_tokens"] == len(ctx[i])
      ctx[i] += c.token_ids + appended[i][t]
  # Two sessions on two slots: no eviction, every later turn reuses.
  eng2 = EmbeddedEngine(tiny.config, tiny.params, num_slots=2, max_len=128)
  run_sessions(eng2, prompts[:2], appended[:2], 3)
  assert eng2.stats["evictions"] == 0 and eng2.stats["reused_tokens"] > 0


def test_weight_swap_retires_prefixes(tiny):
  other = registry.load("tiny-qwen3", seed=22)
  rng = np.random.default_rng(7)
  prompts, appended = scripted(rng, 2, 2)
  eng = EmbeddedEngine(tiny.config, tiny.params, num_slots=2, max_len=128)
  first = run_sessions(eng, prompts, appended, 1)
  eng.update_weights(other.params, 1)
  before = eng.stats["prefill_tokens"]
  ctx = [p + c.token_ids + appended[i][0] for i, [(p, c)] in enumerate(first)]
  outs = eng.generate([Request(f"n{i}", ctx[i], 6, seed=i) for i in range(2)])
  assert eng.stats["prefill_tokens"] - before == sum(len(x) for x in ctx)  # nothing reused
  for x, c in zip(ctx, outs):
    np.testing.assert_allclose(c.logprobs, teacher_forced(other.params, other.config, x,
                                                          c.token_ids, 1.0), atol=1e-4)


def test_idle_slots_keep_their_entries_while_others_decode(tiny):
  # Session A finishes after 1 token; B decodes 40 more steps beside A's idle slot. A's next
  # turn reuses its slot and must still be exact.
  eng = EmbeddedEngine(tiny.config, tiny.params, num_slots=2, max_len=128)
  pa, pb = list(range(3, 20)), list(range(30, 40))
  ca, cb = eng.generate([Request("a", pa, 1, seed=1), Request("b", pb, 40, seed=2)])
  nxt = pa + ca.token_ids + [7, 8, 9]
  before = eng.stats["reused_tokens"]
  c = eng.generate([Request("a2", nxt, 8, seed=3)])[0]
  assert eng.stats["reused_tokens"] - before == len(pa)
  np.testing.assert_allclose(c.logprobs, teacher_forced(tiny.params, tiny.config, nxt,
                                                        c.token_ids, 1.0), atol=1e-4)


def test_no_recompiles_across_turns_sessions_and_evictions(tiny):
  eng = EmbeddedEngine(tiny.config, tiny.params, num_slots=3, max_len=300)
  c0 = eng.compile_counts  # (jit caches are per process: count differences)
  eng.warmup()  # every prefill bucket and decode window
  before = eng.compile_counts
  assert eng.windows == [128, 300]
  assert before["decode"] - c0["decode"] <= len(eng.windows)
  assert before["prefill"] - c0["prefill"] <= len(eng.buckets)
  rng = np.random.default_rng(8)
  prompts, appended = scripted(rng, 5, 6)  # 5 sessions on 3 slots: evictions every turn
  out = run_sessions(eng, prompts, appended, 6, max_new=20)
  assert max(len(p) + len(c.token_ids) for s in out for p, c in s) > 128  # a second window
  eng.update_weights(registry.load("tiny-qwen3", seed=23).params, 1)
  run_sessions(eng, prompts[:3], appended[:3], 2)
  assert eng.stats["evictions"] > 0 and eng.stats["reused_tokens"] > 0
  assert eng.compile_counts == before
