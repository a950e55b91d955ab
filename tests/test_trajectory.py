"""Trajectory validation: every refusal reason, each from a minimal bad record."""

import math
import time

import numpy as np
import pytest

from fr_jax.trajectory import (
  LOGP_FLOOR,
  MAX_STRING_BYTES,
  REASONS,
  Trajectory,
  TrajectoryError,
  record_key,
  rejection_reason,
  validate,
)


def good(**over):
  kw = dict(
      prompt_id="p0",
      prompt_tokens=np.array([1, 2, 3], np.int32),
      # model turn (2 tokens), tool output (2 tokens, not actions), model turn (1 token)
      completion_tokens=np.array([10, 11, 50, 51, 12], np.int32),
      action_mask=np.array([True, True, False, False, True]),
      behavior_logp=np.array([-0.5, -1.0, 0.0, 0.0, -0.1], np.float32),
      reward=1.0,
      policy_version=3,
      finish_reason="stop",
      num_tool_calls=1,
      num_turns=2,
      env="arith",
  )
  kw.update(over)
  return Trajectory(**kw)


def test_good_record_passes_and_reports_counts():
  t = validate(good())
  assert t.length == 8
  assert t.num_action_tokens == 3
  assert t.policy_version.tolist() == [3] * 5
  assert t.min_policy_version == 3
  assert not t.truncated
  assert validate(good(finish_reason="length")).truncated


def test_min_policy_version_counts_action_tokens_only():
  t = good(policy_version=np.array([4, 4, 2, 2, 5], np.int32))
  assert t.min_policy_version == 4  # the tool-output tokens (version 2) are not actions


CASES = {
    "nonfinite_behavior_logp": dict(behavior_logp=np.array([-0.5, np.nan, 0, 0, -0.1],
                                                           np.float32)),
    "positive_behavior_logp": dict(behavior_logp=np.array([-0.5, 0.2, 0, 0, -0.1], np.float32)),
    "length_mismatch": dict(action_mask=np.array([True, True, False, False])),
    "no_action_tokens": dict(action_mask=np.zeros(5, bool),
                             behavior_logp=np.zeros(5, np.float32)),
    "nonfinite_reward": dict(reward=math.inf),
    "nonzero_logp_off_action": dict(behavior_logp=np.array([-0.5, -1.0, -0.3, 0, -0.1],
                                                           np.float32)),
    "bad_field": dict(finish_reason="timeout"),
    # float32 max is 3.4028235e38: 4e38 is finite as a Python float, not as a float32.
    "reward_out_of_range": dict(reward=4e38),
    "behavior_logp_below_floor": dict(behavior_logp=np.array([-0.5, -50.5, 0, 0, -0.1],
                                                             np.float32)),
    "field_too_long": dict(env="e" * (MAX_STRING_BYTES + 1)),
}


@pytest.mark.parametrize("reason", sorted(CASES))
def test_each_reason(reason):
  t = good(**CASES[reason])
  with pytest.raises(TrajectoryError) as e:
    validate(t)
  assert e.value.reason == reason
  assert "p0" in str(e.value)  # the message names the record
  assert rejection_reason(t) == reason


def test_too_long_names_length_and_limit():
  with pytest.raises(TrajectoryError, match="length 8 .* maximum 7") as e:
    validate(good(), max_length=7)
  assert e.value.reason == "too_long"
  validate(good(), max_length=8)  # the limit is inclusive


# Each malformed field, with the one reason and the message validate gives it.
@pytest.mark.parametrize("over,reason,message", [
    (dict(prompt_tokens=np.array([], np.int32)), "bad_field", "prompt_tokens is empty"),
    (dict(completion_tokens=np.array([10, -11, 50, 51, 12])), "bad_field",
     "completion_tokens holds a negative value -11"),
    (dict(behavior_logp=np.array([[-0.5, -1.0, 0, 0, -0.1]])), "bad_field",
     r"behavior_logp must be 1-D, got shape \(1, 5\)"),
    (dict(action_mask=np.array([1, 1, 0, 0, 1])), "bad_field", "action_mask must be bool"),
    (dict(reward="high"), "nonfinite_reward", "reward 'high' is not a number"),
])
def test_bad_fields(over, reason, message):
  t = good(**over)
  assert rejection_reason(t) == reason
  with pytest.raises(TrajectoryError, match=message):
    validate(t)


def test_limits_against_the_model():
  t = good()  # largest token id 51, lowest action log-prob -1.0, reward 1.0
  assert rejection_reason(t, vocab_size=52) is None
  assert rejection_reason(t, vocab_size=51) == "token_out_of_vocab"
  with pytest.raises(TrajectoryError, match="token id 51; the model's vocabulary has 51"):
    validate(t, vocab_size=51)
  assert rejection_reason(t, logp_floor=-1.0) is None  # the floor is inclusive
  assert rejection_reason(t, logp_floor=-0.99) == "behavior_logp_below_floor"
  assert rejection_reason(t, max_abs_reward=1.0) is None
  assert rejection_reason(good(reward=-1.5), max_abs_reward=1.0) == "reward_out_of_range"
  assert LOGP_FLOOR == -50.0 and rejection_reason(good(reward=3.4e38)) is None
  assert rejection_reason(good(prompt_id="p" * MAX_STRING_BYTES)) is None
  # bytes, not characters: 512 two-byte characters are 1,024 bytes, 513 are too many
  assert rejection_reason(good(env="\u00e9" * 512)) is None
  assert rejection_reason(good(env="\u00e9" * 513)) == "field_too_long"
  assert rejection_reason(good(policy_version=-1)) == "bad_field"


def test_record_key_splits_producer_and_sequence():
  assert record_key("worker-3/ab12cd34/17") == ("worker-3/ab12cd34", 17)
  assert record_key("t3") == ("t3", 0)  # no sequence part: a producer of its own
  assert record_key("a/b") == ("a/b", 0)
  assert record_key("a/\u00b2") == ("a/\u00b2", 0)  # a unicode digit is not a sequence number
  assert record_key("a/" + "9" * 19) == ("a/" + "9" * 19, 0)  # nor are 19 digits


def test_all_reasons_are_covered():
  assert set(CASES) | {"too_long", "token_out_of_vocab"} | set(ROUTING_CASES) == set(REASONS)


def test_nan_reward_and_non_trajectory():
  assert rejection_reason(good(reward=float("nan"))) == "nonfinite_reward"
  with pytest.raises(TrajectoryError):
    validate({"reward": 1})


# --- routing replay: routed_experts [P + C - 1, sparse layers, k] ---
ROUTING = (2, 3, 8)  # sparse layers, k, experts


def routed(dtype=np.int8, n=7, layers=2, k=3, num_experts=8, seed=0):
  """Valid expert ids: k distinct of num_experts per (position, layer), as a router picks."""
  rng = np.random.default_rng(seed)
  return np.argsort(rng.random((n, layers, num_experts)), axis=-1)[..., :k].astype(dtype)


def with_id(r, index, value):
  r = r.copy()
  r[index] = value
  return r


def first_duplicate(r):
  """(position, layer, expert) of the first repeated id, by a plain loop: the reference."""
  for pos in range(r.shape[0]):
    for layer in range(r.shape[1]):
      seen = set()
      for e in r[pos, layer].tolist():
        if e in seen:
          return pos, layer, e
        seen.add(e)
  return None


# Each bad routed_experts with its reason and message; good() has P + C - 1 = 7 read positions.
ROUTING_CASES = {
    "missing_routing": [(None, "no routed_experts, but the learner replays routing")],
    "bad_routing": [
        (routed(layers=3), r"shape \(7, 3, 3\); the model routes \[7, 2 sparse layers, 3"),
        (routed(k=2), r"shape \(7, 2, 2\); the model routes"),
        (routed(n=8), r"shape \(8, 2, 3\); expected \[length - 1 = 7"),
        (routed(n=6), r"shape \(6, 2, 3\); expected \[length - 1 = 7"),
        (routed()[:, 0], r"shape \(7, 3\); expected"),
        (routed().astype(np.float32), "must hold integers, got dtype float32"),
        (routed().astype(bool), "must hold integers, got dtype bool"),
        (with_id(routed(), (4, 1, 2), -1), r"routed_experts\[4, 1, 2\] = -1; expert ids must "
         r"be in \[0, 8\)"),
        (with_id(routed(), (6, 0, 0), 8), r"routed_experts\[6, 0, 0\] = 8"),
        (with_id(routed(np.int16), (0, 1, 1), 300), r"routed_experts\[0, 1, 1\] = 300"),
        (with_id(routed(), (3, 1), [5, 2, 5]),
         r"routed_experts\[3, 1\] = \[5, 2, 5\] picks expert 5 twice"),
        (with_id(routed(), (5, 0), [1, 1, 1]), r"routed_experts\[5, 0\] = \[1, 1, 1\] picks "
         "expert 1 twice"),
    ],
}


@pytest.mark.parametrize("reason,r,message", [
    (reason, r, message) for reason, cases in ROUTING_CASES.items() for r, message in cases])
def test_each_routing_reason(reason, r, message):
  t = good(routed_experts=r)
  assert rejection_reason(t, routing=ROUTING) == reason
  with pytest.raises(TrajectoryError, match=message) as e:
    validate(t, routing=ROUTING)
  assert "p0" in str(e.value)


@pytest.mark.parametrize("dtype,num_experts", [(np.int8, 128), (np.int16, 129),
                                               (np.int16, 300)])
def test_good_routing_is_accepted_in_its_compact_dtype(dtype, num_experts):
  r = routed(dtype, num_experts=num_experts)
  r[0, 0] = [num_experts - 1, 0, 1]  # both ends of the range
  t = good(routed_experts=r)
  assert t.routed_experts.dtype == dtype  # not upcast
  assert validate(t, routing=(2, 3, num_experts)) is t
  assert rejection_reason(t, routing=(2, 3, num_experts - 1)) == "bad_routing"


def test_routed_experts_from_a_list_becomes_an_array():
  t = good(routed_experts=routed().tolist())
  assert isinstance(t.routed_experts, np.ndarray) and t.routed_experts.shape == (7, 2, 3)
  assert good().routed_experts is None


def test_an_moe_learner_without_replay_checks_routing_whenever_it_is_there():
  # Not required (no replay), but packed when present: shape, range and distinctness hold.
  assert rejection_reason(good(), routing=ROUTING, require_routing=False) is None
  assert rejection_reason(good(routed_experts=routed()), routing=ROUTING,
                          require_routing=False) is None
  for bad in (routed(layers=2, k=4), with_id(routed(), (0, 0), [9, 9, 1]),
              with_id(routed(), (3, 1), [0, 1, ROUTING[2]])):
    assert rejection_reason(good(routed_experts=bad), routing=ROUTING,
                            require_routing=False) == "bad_routing"


def test_without_routing_only_the_layout_is_checked():
  # A dense learner (it drops routing at admission): no routed_experts is fine, and present
  # ones are only checked to be integer [length - 1, ., .].
  assert rejection_reason(good()) is None
  assert rejection_reason(good(routed_experts=routed())) is None
  assert rejection_reason(good(routed_experts=routed(layers=5, k=1))) is None
  assert rejection_reason(good(routed_experts=with_id(routed(), (0, 0), [9, 9, -4]))) is None
  for bad in (routed(n=8), routed()[:, 0], routed().astype(np.float64)):
    assert rejection_reason(good(routed_experts=bad)) == "bad_routing"


def test_the_first_duplicate_named_matches_a_plain_loop():
  rng = np.random.default_rng(1)
  for trial in range(20):
    r = routed(n=7, layers=2, k=4, num_experts=6, seed=trial)
    for _ in range(int(rng.integers(1, 4))):  # one to three duplicates anywhere
      pos, layer, a, b = (int(rng.integers(0, m)) for m in (7, 2, 4, 4))
      r[pos, layer, a] = r[pos, layer, b]
    want = first_duplicate(r)
    got = rejection_reason(good(routed_experts=r), routing=(2, 4, 6))
    if want is None:
      assert got is None
      continue
    pos, layer, e = want
    with pytest.raises(TrajectoryError, match=rf"routed_experts\[{pos}, {layer}\] = "
                       rf"\[[0-9, ]*\] picks expert {e} twice"):
      validate(good(routed_experts=r), routing=(2, 4, 6))


def test_routing_validation_of_a_long_record_is_vectorised():
  # 16k tokens, 48 sparse layers x 8 of 128 experts (6.3 MB of int8): milliseconds, not the
  # seconds a Python loop over positions would take.
  P, C, layers, k, E = 1024, 15360, 48, 8, 128
  rng = np.random.default_rng(0)
  start = rng.integers(0, E - k, (P + C - 1, layers, 1))
  r = ((start + np.arange(k)) % E).astype(np.int8)  # k consecutive ids: distinct
  t = good(prompt_tokens=np.ones(P, np.int32), completion_tokens=np.ones(C, np.int32),
           action_mask=np.ones(C, bool), behavior_logp=np.full(C, -0.5, np.float32),
           routed_experts=r)
  validate(t, routing=(layers, k, E))
  best = min(_timed(lambda: validate(t, routing=(layers, k, E))) for _ in range(3))
  assert best < 0.25, f"{best * 1e3:.0f} ms"
  r[P + C - 2, layers - 1, k - 1] = r[P + C - 2, layers - 1, 0]  # the very last row
  assert rejection_reason(t, routing=(layers, k, E)) == "bad_routing"


def _timed(fn):
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0
