"""`digits`: a small interactive task a tiny byte-level model can learn in minutes, used by
the replication runner (`experiments/replication/`) to test the method's mechanisms on CPU.

A task is a four-letter key and a secret digit d. The model answers with a turn whose first
digit is its answer (letters before it are "filler"; the turn ends with the stop token).
Reward 1 if that digit is d, else 0. An episode cut by the token limit earns 0, so filler that
runs on makes a long failure.

* `tool=False` (copy): the prompt shows the digit ("key: abcd 7"); the model must copy it.
* `tool=True` (lookup): the prompt shows only the key. A turn that starts with "?" is a tool
  call: the environment answers "= d" and the episode goes on (up to the agent's turn limit).
  Without calling, the model can only guess (1 in 10).

`demonstration` writes example conversations for a supervised warm start (random filler
length, some too long to finish within the limit; a chosen rate of correct answers), so that
reinforcement learning starts from a model that knows the format and has habits to change
(length, tool use), as it does from an instruct model.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from fr_jax.envs.base import Task, check_split, procedural_task, stable_hash

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_DIGIT = re.compile(r"\d")
TOOL_PREFIX = "?"


def first_digit(text: str) -> int | None:
  m = _DIGIT.search(text)
  return None if m is None else int(m.group(0))


class DigitsEpisode:
  """One episode: tool calls answered with the secret, the first non-call turn scored."""

  def __init__(self, task: Task, tool: bool):
    self.task, self.tool = task, tool
    self.tool_calls = 0
    self.answered: int | None = None
    self.done = False

  def observe(self, action_text: str) -> tuple[str, bool]:
    if self.tool and action_text.startswith(TOOL_PREFIX):
      self.tool_calls += 1
      return f"= {self.task.answer}", False
    self.answered = first_digit(action_text)
    self.done = True
    return "", True

  def reward(self) -> float:
    return float(self.done and self.answered == self.task.answer)


@dataclasses.dataclass
class Digits:
  tool: bool = False
  seed: int = 0
  train_size: int = 100_000
  test_size: int = 200
  name: str = "digits"
  interactive: bool = True
  system_prompt: str = ""

  @property
  def tools(self) -> tuple:
    return ("lookup",) if self.tool else ()

  def __post_init__(self):
    self._test: list[Task] = []

  def split_size(self, split: str) -> int:
    check_split(split)
    return self.train_size if split == "train" else self.test_size

  def _draw(self, rng) -> Task:
    key = "".join(_LETTERS[i] for i in rng.integers(0, 26, 4))
    d = int(rng.integers(0, 10))
    prompt = f"key: {key}" if self.tool else f"key: {key} {d}"
    return Task(self.name, f"{self.name}:{int(self.tool)}:{key}:{d}", prompt, d, {"key": key})

  def task(self, split: str, index: int) -> Task:
    return procedural_task(self._draw, self.seed, split, index, self._test, self.test_size)

  def reward(self, task: Task, final_text: str) -> float:
    return float(first_digit(final_text) == task.answer)

  def start(self, task: Task) -> DigitsEpisode:
    return DigitsEpisode(task, self.tool)

  def demonstration(self, task: Task, use_tool: bool, *, correct_rate: float = 0.6,
                    max_filler: int = 4) -> list[dict]:
    """An imperfect example episode as a conversation (`fr_jax.sft`): with the tool (and
    `use_tool`) a call first, whose answer comes back as a user turn, as the agent loop renders
    an interactive environment's observation; then filler letters (length uniform in
    [0, max_filler]) and a digit, the task's with probability `correct_rate`, else a random
    one. Filler and correctness are drawn from the task's id: a task always gets the same
    demonstration."""
    rng = np.random.default_rng(stable_hash(task.task_id) % 2**32)
    msgs = [{"role": "user", "content": task.prompt}]
    if self.tool and use_tool:
      msgs += [{"role": "assistant", "content": TOOL_PREFIX},
               {"role": "user", "content": f"= {task.answer}"}]
    filler = "".join(_LETTERS[i] for i in rng.integers(0, 26, int(rng.integers(0, max_filler + 1))))
    d = task.answer if rng.random() < correct_rate else int(rng.integers(0, 10))
    return msgs + [{"role": "assistant", "content": f"{filler} {d}" if filler else str(d)}]
