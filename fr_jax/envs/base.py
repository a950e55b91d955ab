"""The environment interface, answer parsing helpers, and prompts through grain.

An environment generates tasks procedurally from (seed, split, index), so every split is
reproducible, and train and held-out splits are disjoint by construction: each task has a
stable key whose hash decides its split. Single-answer environments score the final model
turn (`reward`); interactive ones (`interactive = True`) also `start` an `Episode` that turns
each model action into an observation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any, Protocol

import grain
import numpy as np

SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class Task:
  env: str
  task_id: str  # stable and unique within the env
  prompt: str  # the user turn
  answer: Any  # ground truth, JSON-able
  meta: dict = dataclasses.field(default_factory=dict)


class Episode(Protocol):
  """An interactive episode: the model acts, the environment answers. An episode that offers
  tools may also keep a `tool_calls` count, which the agent loop records."""

  def observe(self, action_text: str) -> tuple[str, bool]:
    """(observation text, done) after the model's action."""

  def reward(self) -> float:
    ...


class Env(Protocol):
  name: str
  system_prompt: str
  tools: tuple[str, ...]  # e.g. ("python",)
  interactive: bool

  def split_size(self, split: str) -> int:
    ...

  def task(self, split: str, index: int) -> Task:
    ...

  def reward(self, task: Task, final_text: str) -> float:
    ...

  def start(self, task: Task) -> Episode | None:
    ...


class SingleAnswerEnv:
  """What single-answer environments with a train and a test split share: split sizes from
  their `train_size` and `test_size`, and no episode to start."""

  def split_size(self, split: str) -> int:
    check_split(split)
    return self.train_size if split == "train" else self.test_size

  def start(self, task: Task) -> None:
    return None


def stable_hash(key: str) -> int:
  return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def split_of(key: str, test_fraction: float = 0.1) -> str:
  """Deterministic split membership of a task key: disjoint train/test by construction."""
  return "test" if (stable_hash(key) % 10_000) < test_fraction * 10_000 else "train"


def check_split(split: str):
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: choose one of {SPLITS}")


def procedural_task(draw, seed: int, split: str, index: int, test: list, test_size: int):
  """Task `index` of `split` from a generator `draw(rng) -> Task`. A train task is the first
  draw from rng([seed, 1, index]) whose key hashes to train; the test split is the first
  `test_size` distinct tasks drawn from rng([seed, 2]) whose keys hash to test, built once
  into the caller's `test` list."""
  check_split(split)
  if split == "test":
    if not test:
      rng = np.random.default_rng([seed, 2])
      seen = set()
      while len(test) < test_size:
        t = draw(rng)
        if split_of(t.task_id) == "test" and t.task_id not in seen:
          seen.add(t.task_id)
          test.append(t)
    return test[index]
  rng = np.random.default_rng([seed, 1, index])
  while True:
    t = draw(rng)
    if split_of(t.task_id) == "train":
      return t


_INT = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def last_number(text: str) -> float | None:
  """The answer in a reply: the content of the last \\boxed{...} if any, else the last
  number in the text (commas as thousands separators allowed)."""
  boxed = _BOXED.findall(text)
  pool = boxed[-1] if boxed else text
  nums = _INT.findall(pool)
  if not nums:
    return None
  try:
    return float(nums[-1].replace(",", ""))
  except ValueError:
    return None


def prompt_dataset(env: Env, split: str, *, seed: int = 0, shard_index: int = 0,
                   num_shards: int = 1, epochs: int = 1_000_000) -> grain.MapDataset:
  """Tasks of `split`, reshuffled every epoch, each used once per epoch, sharded per worker
  (shard k takes every num_shards-th element). Its iterator state can be checkpointed."""
  check_split(split)
  n = env.split_size(split)
  if not 0 <= shard_index < num_shards:
    raise ValueError(f"shard_index={shard_index} must be in [0, num_shards={num_shards})")
  cache: dict[int, np.ndarray] = {}

  def task_index(j: int) -> int:
    epoch, k = divmod(int(j), n)
    if epoch not in cache:
      cache.clear()
      cache[epoch] = np.random.default_rng([seed, epoch]).permutation(n)
    return int(cache[epoch][k])

  ds = grain.MapDataset.range(n * epochs)[shard_index::num_shards]
  return ds.map(lambda j: env.task(split, task_index(j)))
