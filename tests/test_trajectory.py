"""Trajectory validation: every refusal reason, each from a minimal bad record."""

import math

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
  assert set(CASES) | {"too_long", "token_out_of_vocab"} == set(REASONS)


def test_nan_reward_and_non_trajectory():
  assert rejection_reason(good(reward=float("nan"))) == "nonfinite_reward"
  with pytest.raises(TrajectoryError):
    validate({"reward": 1})
