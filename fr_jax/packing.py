"""Ragged trajectories -> fixed-shape packed batches with segment ids.

Each trajectory (prompt + completion, n tokens) becomes one segment of n-1 positions in the
*target frame*: position j holds input token x_j and target x_{j+1}, so the model's logits at
j score the target directly. `action_mask` and `behavior_logp` are shifted into that frame.
The last token is only ever a target, so it costs no position.

Segments are placed first-fit-decreasing into rows of `row_len` positions. Rows are grouped
into micro-batches whose row counts come from a small fixed set (`row_buckets`), so the update
compiles at most once per bucket. Every micro-batch of a bucket has the same static number of
segment slots, S = rows * max_segments_per_row.

The LM head need only score the positions the objective reads, the action targets.
`action_index` [R, K] names them per row (in order, then padded with the row's other
positions, so that every index is distinct): K is the smallest of `head_buckets` (fractions of
`row_len`) that holds the row with the most action positions, so a bucket of rows compiles at
most once per head bucket. When none holds it (or `head_buckets` is empty), `action_index` is
None and the head scores every position.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from fr_jax.trajectory import Trajectory


class PackingError(ValueError):
  """A batch that cannot be packed with the configured buckets."""


@dataclasses.dataclass(frozen=True)
class PackingSpec:
  """Bucket shapes: micro-batches are [R, row_len] for R in row_buckets."""

  row_len: int = 4096
  row_buckets: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
  max_segments_per_row: int = 32
  head_buckets: tuple[float, ...] = ()  # fractions of row_len in (0, 1), ascending

  def __post_init__(self):
    if self.row_len < 1:
      raise PackingError(f"row_len={self.row_len} must be >= 1")
    b = tuple(self.row_buckets)
    if not b or any(r < 1 for r in b) or list(b) != sorted(set(b)):
      raise PackingError(f"row_buckets={b} must be distinct positive ints in ascending order")
    if self.max_segments_per_row < 1:
      raise PackingError(f"max_segments_per_row={self.max_segments_per_row} must be >= 1")
    h = tuple(self.head_buckets)
    if any(not 0 < f < 1 for f in h) or list(h) != sorted(set(h)):
      raise PackingError(f"head_buckets={h} must be distinct fractions in (0, 1), ascending")

  def head_width(self, actions: int) -> int | None:
    """Positions per row the head scores when a row has at most `actions` action positions:
    the smallest head bucket's width (ceil(fraction * row_len)) that holds them, else None
    (every position)."""
    for f in self.head_buckets:
      k = math.ceil(f * self.row_len)
      if k >= actions:
        return k
    return None

  @property
  def max_rows(self) -> int:
    return self.row_buckets[-1]

  @property
  def max_trajectory_length(self) -> int:
    """Longest prompt + completion that fits one row (n tokens use n-1 positions)."""
    return self.row_len + 1

  def num_segments(self, rows: int) -> int:
    return rows * self.max_segments_per_row

  def shapes(self) -> list[tuple[int, int, int]]:
    """Every (R, L, S) a micro-batch can have: the set of compiled shapes."""
    return [(r, self.row_len, self.num_segments(r)) for r in self.row_buckets]


class PackedBatch(NamedTuple):
  """One fixed-shape micro-batch (a pytree of NumPy arrays; device_put it as a whole)."""

  tokens: np.ndarray  # int32 [R, L] input tokens
  targets: np.ndarray  # int32 [R, L] next tokens, scored by the logits at the same position
  positions: np.ndarray  # int32 [R, L] position within the trajectory (0 on padding)
  segment_ids: np.ndarray  # int32 [R, L] 0 = padding, s = slot s-1
  action_mask: np.ndarray  # bool [R, L] the target was sampled by the policy
  behavior_logp: np.ndarray  # float32 [R, L] engine log-prob of the target (0 off-action)
  rewards: np.ndarray  # float32 [S]
  segment_valid: np.ndarray  # bool [S] slot holds a trajectory
  traj_index: np.ndarray  # int32 [S] index into the packed list, -1 for empty slots
  policy_version: np.ndarray  # int32 [S] oldest behaviour version among the action tokens
  # int [R, L, sparse layers, k]: the experts the engine routed each input token to (MoE
  # models whose records carry them; `pack(routing=...)`), else None. Padding positions get
  # experts 0..k-1.
  routes: np.ndarray | None = None
  # int32 [R, K]: per row, the action positions in order, then the row's other positions up
  # to K (`PackingSpec.head_width`); None: the head scores every position.
  action_index: np.ndarray | None = None

  @property
  def head_width(self) -> int:
    """Positions per row the LM head scores."""
    return self.tokens.shape[1] if self.action_index is None else self.action_index.shape[1]

  @property
  def shape(self) -> tuple[int, int, int]:
    return (*self.tokens.shape, self.rewards.shape[0])


class Packed(NamedTuple):
  batches: list[PackedBatch]
  real_tokens: int  # positions holding a trajectory token
  buffer_tokens: int  # all positions of all micro-batches

  @property
  def efficiency(self) -> float:
    return self.real_tokens / max(self.buffer_tokens, 1)


def first_fit_decreasing(lengths: Sequence[int], capacity: int, max_items: int) -> list[list[int]]:
  """Bins of item indices: longest first, each into the first bin with room (and item slots)."""
  order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  room = np.zeros((0,), np.int64)
  count = np.zeros((0,), np.int64)
  bins: list[list[int]] = []
  for i in order:
    n = lengths[i]
    fits = np.flatnonzero((room >= n) & (count < max_items))
    if fits.size:
      b = int(fits[0])
    else:
      b = len(bins)
      bins.append([])
      room = np.append(room, capacity)
      count = np.append(count, 0)
    bins[b].append(i)
    room[b] -= n
    count[b] += 1
  return bins


def _bucket_for(rows: int, spec: PackingSpec) -> int:
  for r in spec.row_buckets:
    if r >= rows:
      return r
  return spec.max_rows


def pack(trajs: Sequence[Trajectory], spec: PackingSpec,
         routing: tuple[int, int] | None = None) -> Packed:
  """Packs `trajs` into as few bucket-shaped micro-batches as first-fit-decreasing allows.

  Micro-batches hold `spec.max_rows` rows each, except the last, which takes the smallest
  bucket that holds the remaining rows. The records were admitted: `trajectory.validate`
  against the learner's `record_limits` (at most `spec.max_trajectory_length` tokens, a
  prompt and an action) is length's one check. `traj_index` of each slot indexes into
  `trajs`. `routing` = (sparse layers, k) packs every record's `routed_experts` into `routes`
  (each must carry them, [length - 1, layers, k]: admission checked); None leaves `routes`
  None.
  """
  if not trajs:
    raise PackingError("cannot pack an empty list of trajectories")
  lengths = [t.length - 1 for t in trajs]
  rows = first_fit_decreasing(lengths, spec.row_len, spec.max_segments_per_row)
  batches = []
  for start in range(0, len(rows), spec.max_rows):
    chunk = rows[start:start + spec.max_rows]
    batches.append(_fill(trajs, chunk, _bucket_for(len(chunk), spec), spec, routing))
  real = int(sum(lengths))
  buffer = sum(b.tokens.size for b in batches)
  return Packed(batches, real, buffer)


def _fill(trajs, rows, R, spec, routing=None) -> PackedBatch:
  L, S = spec.row_len, spec.num_segments(R)
  tokens = np.zeros((R, L), np.int32)
  targets = np.zeros((R, L), np.int32)
  positions = np.zeros((R, L), np.int32)
  segment_ids = np.zeros((R, L), np.int32)
  action_mask = np.zeros((R, L), bool)
  behavior_logp = np.zeros((R, L), np.float32)
  rewards = np.zeros((S,), np.float32)
  valid = np.zeros((S,), bool)
  traj_index = np.full((S,), -1, np.int32)
  version = np.zeros((S,), np.int32)
  routes = None
  if routing is not None:
    dtype = np.result_type(*[t.routed_experts.dtype for t in trajs])
    routes = np.broadcast_to(np.arange(routing[1], dtype=dtype), (R, L, *routing)).copy()
  slot = 0
  for r, members in enumerate(rows):
    col = 0
    for i in members:
      t = trajs[i]
      seq = t.tokens
      n = seq.shape[0] - 1
      P = t.prompt_tokens.shape[0]
      span = slice(col, col + n)
      tokens[r, span] = seq[:-1]
      targets[r, span] = seq[1:]
      positions[r, span] = np.arange(n)
      segment_ids[r, span] = slot + 1
      # Completion token k is the target at position P - 1 + k.
      comp = slice(col + P - 1, col + n)
      action_mask[r, comp] = t.action_mask
      behavior_logp[r, comp] = np.where(t.action_mask, t.behavior_logp, 0.0)
      rewards[slot] = t.reward
      valid[slot] = True
      traj_index[slot] = i
      version[slot] = t.min_policy_version
      if routes is not None:
        routes[r, span] = t.routed_experts
      slot += 1
      col += n
  return PackedBatch(tokens, targets, positions, segment_ids, action_mask, behavior_logp,
                     rewards, valid, traj_index, version, routes,
                     action_index(action_mask, spec.head_width(action_mask.sum(1).max())))


def action_index(action_mask: np.ndarray, width: int | None) -> np.ndarray | None:
  """[R, width] int32: each row's action positions in order, then its other positions (a
  stable sort of the positions, actions first); None for width None."""
  if width is None:
    return None
  return np.argsort(~action_mask, axis=1, kind="stable")[:, :width].astype(np.int32)
