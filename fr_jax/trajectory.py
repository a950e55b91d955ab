"""The Trajectory record: the contract between rollout workers and the learner.

A record holds one prompt and everything generated after it (model and tool turns
interleaved). Per completion token it carries:

* `action_mask`: True only for tokens the policy sampled;
* `behavior_logp`: the engine's log-prob of the sampled token under the distribution that
  sampled it (temperature applied), 0 where action_mask is False;
* `policy_version`: the policy version that produced the token (it may change mid-trajectory
  when a weight update lands between turns).

Mixture-of-experts models with routing replay also carry, per position the model reads,
`routed_experts`: int8/int16 [P + C - 1, sparse layers, k], the ids of the k experts the
engine routed that position to in each sparse layer (`ModelConfig.moe_layers`), so the learner
scores with the same experts. Row j is the routing of input token j (prompt, then completion);
the last token is only ever a target and has no row, as in `fr_jax/packing.py`. It stays in
the engine's compact dtype (`ModelConfig.routing_dtype`); None when routing was not recorded.

`validate()` refuses a malformed record with a named reason (`TrajectoryError.reason`, one of
`REASONS`), never a bare assert. Besides the shape of the record it checks what the learner can
digest: token ids inside the model's vocabulary, a reward that is finite in float32, behaviour
log-probs above a floor (so exp(log pi - log mu) stays finite), bounded string fields, and,
for an MoE learner, routed_experts (required when it replays routing, else optional) of the
model's shape, in range and with k distinct experts per position and layer.
It runs once per record, where the record is admitted (the learner service, `launch.sft`, the
replication driver); `Learner.update` takes admitted records as they are.

A record's id is `producer/seq`: the producer (a worker and its start nonce) numbers its records
0, 1, 2, ... and sends them in that order. `record_key` splits an id; the learner keeps one
watermark per producer instead of every id it has seen.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

FINISH_REASONS = ("stop", "length", "abort")
F32_MAX = float(np.finfo(np.float32).max)
# A sampled token never has log-prob below about -31 under float32 Gumbel-max sampling over a
# 150k vocabulary; -50 leaves margin and keeps rho = exp(log pi - log mu) <= e^50, finite.
LOGP_FLOOR = -50.0
MAX_STRING_BYTES = 1024  # prompt_id, traj_id, env

REASONS = (
    "bad_field",  # wrong type/rank/dtype, unknown finish reason, negative id, empty prompt
    "length_mismatch",  # per-token arrays disagree in length
    "no_action_tokens",
    "nonfinite_behavior_logp",
    "positive_behavior_logp",
    "nonzero_logp_off_action",  # a non-action token carries a nonzero behaviour log-prob
    "nonfinite_reward",
    "too_long",  # prompt + completion longer than the configured maximum
    "token_out_of_vocab",  # a token id >= the model's vocabulary size
    "reward_out_of_range",  # finite as a float64 but not as a float32
    "behavior_logp_below_floor",  # an action's behaviour log-prob below LOGP_FLOOR
    "field_too_long",  # a string field longer than MAX_STRING_BYTES
    "missing_routing",  # the learner replays routing but the record has no routed_experts
    # routed_experts of the wrong rank, length, dtype or (sparse layers, k), an expert id
    # outside [0, num_experts), or an expert picked twice for one position and layer
    "bad_routing",
)


# Admission answers that are not answers: nothing was recorded, the sender tries again later
# (a full queue; an admission log that cannot be written, e.g. a full disk).
RETRY_REASONS = ("queue_full", "log_unavailable")


class TrajectoryError(ValueError):
  """A refused record. `reason` is one of `REASONS`; the message names the bad value."""

  def __init__(self, reason: str, message: str):
    assert reason in REASONS, reason
    super().__init__(f"[{reason}] {message}")
    self.reason = reason


@dataclasses.dataclass
class Trajectory:
  """One rollout. Arrays are NumPy; lengths: prompt P, completion C."""

  prompt_id: str
  prompt_tokens: np.ndarray  # int32 [P]
  completion_tokens: np.ndarray  # int32 [C]
  action_mask: np.ndarray  # bool [C]
  behavior_logp: np.ndarray  # float32 [C], <= 0 on actions, 0 elsewhere
  reward: float
  policy_version: np.ndarray  # int32 [C], version that produced each token
  finish_reason: str = "stop"  # stop | length | abort
  num_tool_calls: int = 0
  num_turns: int = 1
  env: str = ""
  traj_id: str = ""  # "producer/seq" (see record_key); filled from prompt_id when empty
  # int8/int16 [P + C - 1, sparse layers, k]: routing replay (module docstring); None: none
  routed_experts: np.ndarray | None = None

  def __post_init__(self):
    self.prompt_tokens = np.asarray(self.prompt_tokens)
    self.completion_tokens = np.asarray(self.completion_tokens)
    self.action_mask = np.asarray(self.action_mask)
    self.behavior_logp = np.asarray(self.behavior_logp)
    pv = np.asarray(self.policy_version)
    if pv.ndim == 0:  # one version for the whole trajectory
      pv = np.full(self.completion_tokens.shape, int(pv), np.int32)
    self.policy_version = pv
    if self.routed_experts is not None:  # kept in the engine's compact dtype
      self.routed_experts = np.asarray(self.routed_experts)
    self.prompt_id = str(self.prompt_id)
    if not self.traj_id:
      self.traj_id = self.prompt_id

  @property
  def length(self) -> int:
    """Prompt plus completion tokens."""
    return int(self.prompt_tokens.shape[0] + self.completion_tokens.shape[0])

  @property
  def num_action_tokens(self) -> int:
    return int(np.count_nonzero(self.action_mask))

  @property
  def truncated(self) -> bool:
    return self.finish_reason == "length"

  @property
  def min_policy_version(self) -> int:
    """The oldest policy version among action tokens (defines the trajectory's lag)."""
    v = self.policy_version[self.action_mask.astype(bool)]
    return int(v.min()) if v.size else int(self.policy_version.min(initial=0))

  def policy_lag(self, version: int) -> int:
    """Updates between the oldest policy that sampled an action token and `version` (the
    learner's): the one definition of a record's lag."""
    return version - self.min_policy_version

  @property
  def tokens(self) -> np.ndarray:
    """prompt + completion, int32 [P + C]."""
    return np.concatenate([self.prompt_tokens, self.completion_tokens]).astype(np.int32)


def _fail(reason, traj, message):
  name = traj.traj_id if len(traj.traj_id) <= 80 else traj.traj_id[:80] + "..."
  raise TrajectoryError(reason, f"trajectory {name!r}: {message}")


def record_key(traj_id: str) -> tuple[str, int]:
  """`producer/seq` -> (producer, seq). An id without a numeric last part is a producer of
  its own with seq 0."""
  head, sep, tail = traj_id.rpartition("/")
  if sep and tail.isascii() and tail.isdigit() and len(tail) <= 18:
    return head, int(tail)
  return traj_id, 0


def _check_routing(traj: Trajectory, routing: tuple[int, int, int] | None, required: bool):
  """routed_experts against the record's length and, for an MoE learner, `routing` =
  (sparse layers, k, num_experts); `required` when it replays routing. Vectorised: a
  16k-token record of 48 layers x 8 experts takes about 10 ms."""
  r = traj.routed_experts
  if r is None:
    if routing is not None and required:
      _fail("missing_routing", traj, f"no routed_experts, but the learner replays routing "
            f"(sparse layers, k, experts) = {tuple(routing)}: run the engine with routing "
            "replay on (Request.routed_experts_start)")
    return
  n = traj.length - 1
  if not isinstance(r, np.ndarray) or r.ndim != 3 or r.shape[0] != n:
    shape = getattr(r, "shape", type(r).__name__)
    _fail("bad_routing", traj, f"routed_experts has shape {shape}; expected [length - 1 = {n}, "
          "sparse layers, k] (one row per position the model reads)")
  if not np.issubdtype(r.dtype, np.integer):
    _fail("bad_routing", traj, f"routed_experts must hold integers, got dtype {r.dtype}")
  if routing is None:
    return
  layers, k, num_experts = (int(x) for x in routing)
  if r.shape[1:] != (layers, k):
    _fail("bad_routing", traj, f"routed_experts has shape {r.shape}; the model routes "
          f"[{n}, {layers} sparse layers, {k} experts per token]")
  if not r.size:
    return
  if int(r.min()) < 0 or int(r.max()) >= num_experts:
    bad = (r < 0) | (r.astype(np.int64) >= num_experts)
    i = tuple(int(x) for x in np.unravel_index(np.argmax(bad), r.shape))
    _fail("bad_routing", traj, f"routed_experts[{i[0]}, {i[1]}, {i[2]}] = {r[i]}; expert ids "
          f"must be in [0, {num_experts})")
  # k ids per (position, layer) must differ: compare each id column with the ones before it
  # (k(k-1)/2 vectorised comparisons over contiguous columns; k is small).
  cols = np.ascontiguousarray(np.moveaxis(r, -1, 0).reshape(k, -1))
  if any((cols[j] == cols[:j]).any() for j in range(1, k)):
    dup = np.zeros(cols.shape[1], bool)
    for j in range(1, k):
      dup |= (cols[j] == cols[:j]).any(axis=0)
    pos, layer = divmod(int(np.argmax(dup)), layers)
    ids = r[pos, layer].tolist()
    twice = next(e for j, e in enumerate(ids) if e in ids[:j])
    _fail("bad_routing", traj, f"routed_experts[{pos}, {layer}] = {ids} picks expert {twice} "
          "twice; the k experts of a position and layer must be distinct")


def validate(traj: Trajectory, *, max_length: int | None = None,
             vocab_size: int | None = None, logp_floor: float = LOGP_FLOOR,
             max_abs_reward: float = F32_MAX,
             routing: tuple[int, int, int] | None = None,
             require_routing: bool = True) -> Trajectory:
  """Checks a record; returns it unchanged or raises `TrajectoryError` with a named reason.
  `vocab_size` (the model's) bounds token ids; `logp_floor` bounds behaviour log-probs of
  actions from below; |reward| must not exceed `max_abs_reward`. `routing` = (sparse layers,
  k, num_experts) for an MoE learner: routed_experts, whenever present, must have shape
  [length - 1, sparse layers, k] with k distinct ids in [0, num_experts) per position and
  layer (so its size is bounded by the record's length), and with `require_routing` (the
  learner replays the engine's routing) it must be present. Without `routing` (a dense
  learner, which strips routing at admission), routed_experts is only checked to be an
  integer [length - 1, ., .] array."""
  if not isinstance(traj, Trajectory):
    raise TrajectoryError("bad_field", f"expected a Trajectory, got {type(traj).__name__}")
  for name in ("prompt_id", "traj_id", "env"):
    v = getattr(traj, name)
    if not isinstance(v, str):
      _fail("bad_field", traj, f"{name} must be a string, got {type(v).__name__}")
    n = len(v.encode("utf-8", "surrogatepass"))
    if n > MAX_STRING_BYTES:
      _fail("field_too_long", traj, f"{name} is {n} bytes; the limit is {MAX_STRING_BYTES}")
  arrays = {
      "prompt_tokens": traj.prompt_tokens, "completion_tokens": traj.completion_tokens,
      "action_mask": traj.action_mask, "behavior_logp": traj.behavior_logp,
      "policy_version": traj.policy_version,
  }
  for name, a in arrays.items():
    if a.ndim != 1:
      _fail("bad_field", traj, f"{name} must be 1-D, got shape {a.shape}")
  for name in ("prompt_tokens", "completion_tokens", "policy_version"):
    if arrays[name].size and not np.issubdtype(arrays[name].dtype, np.integer):
      _fail("bad_field", traj, f"{name} must hold integers, got dtype {arrays[name].dtype}")
  if traj.action_mask.size and traj.action_mask.dtype != np.bool_:
    _fail("bad_field", traj, f"action_mask must be bool, got dtype {traj.action_mask.dtype}")
  if traj.behavior_logp.size and not np.issubdtype(traj.behavior_logp.dtype, np.floating):
    _fail("bad_field", traj, f"behavior_logp must be float, got {traj.behavior_logp.dtype}")
  if traj.finish_reason not in FINISH_REASONS:
    _fail("bad_field", traj,
          f"finish_reason={traj.finish_reason!r}; expected one of {FINISH_REASONS}")
  if traj.prompt_tokens.size == 0:
    _fail("bad_field", traj, "prompt_tokens is empty; the first action needs a context token")
  for name in ("prompt_tokens", "completion_tokens", "policy_version"):
    if arrays[name].size and arrays[name].min() < 0:
      _fail("bad_field", traj, f"{name} holds a negative value {arrays[name].min()}")
  if vocab_size is not None:
    for name in ("prompt_tokens", "completion_tokens"):
      if arrays[name].size and arrays[name].max() >= vocab_size:
        _fail("token_out_of_vocab", traj, f"{name} holds token id {arrays[name].max()}; "
              f"the model's vocabulary has {vocab_size}")

  C = traj.completion_tokens.shape[0]
  for name in ("action_mask", "behavior_logp", "policy_version"):
    if arrays[name].shape[0] != C:
      _fail("length_mismatch", traj,
            f"{name} has {arrays[name].shape[0]} entries but completion_tokens has {C}")

  if max_length is not None and traj.length > max_length:
    _fail("too_long", traj, f"length {traj.length} (prompt {traj.prompt_tokens.shape[0]} + "
          f"completion {C}) exceeds the configured maximum {max_length}")
  _check_routing(traj, routing, require_routing)

  mask = traj.action_mask
  if not mask.any():
    _fail("no_action_tokens", traj, "no token has action_mask=True; nothing to learn from")

  blogp = traj.behavior_logp
  bad = ~np.isfinite(blogp)
  if bad.any():
    i = int(np.argmax(bad))
    _fail("nonfinite_behavior_logp", traj, f"behavior_logp[{i}] = {blogp[i]}")
  pos = mask & (blogp > 0)
  if pos.any():
    i = int(np.argmax(pos))
    _fail("positive_behavior_logp", traj,
          f"behavior_logp[{i}] = {blogp[i]} > 0; log-probs must be <= 0")
  low = mask & (blogp < logp_floor)
  if low.any():
    i = int(np.argmax(low))
    _fail("behavior_logp_below_floor", traj,
          f"behavior_logp[{i}] = {blogp[i]} < {logp_floor}; no sampler draws such a token")
  off = ~mask & (blogp != 0)
  if off.any():
    i = int(np.argmax(off))
    _fail("nonzero_logp_off_action", traj,
          f"behavior_logp[{i}] = {blogp[i]} on a non-action token; it must be 0")

  try:
    reward = float(traj.reward)
  except (TypeError, ValueError):
    _fail("nonfinite_reward", traj, f"reward {traj.reward!r} is not a number")
  if not math.isfinite(reward):
    _fail("nonfinite_reward", traj, f"reward = {reward}")
  if abs(reward) > max_abs_reward:
    _fail("reward_out_of_range", traj, f"reward = {reward:g}; |reward| must be <= "
          f"{max_abs_reward:g} (float32 arithmetic in the update)")
  return traj


def rejection_reason(traj: Trajectory, **limits) -> str | None:
  """The reason `validate(traj, **limits)` would refuse `traj`, or None if it is accepted."""
  try:
    validate(traj, **limits)
  except TrajectoryError as e:
    return e.reason
  return None
