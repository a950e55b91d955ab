"""Verifiable numeric tasks: arithmetic and templated word problems, and a countdown puzzle.

Both offer the sandboxed Python tool. Train and test tasks are disjoint by construction
(`split_of` on the task key); the test split is a fixed, duplicate-free list.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import json
import operator
import re

import numpy as np

from fr_jax.envs.base import SingleAnswerEnv, Task, last_number, procedural_task, split_of

TOOL_SYSTEM = (
    "You can run Python to compute. To call it, write exactly:\n"
    "<tool_call>\n{\"name\": \"python\", \"arguments\": {\"code\": \"print(12 * 34)\"}}\n"
    "</tool_call>\n"
    "The output comes back in <tool_response>...</tool_response>. "
    "Give the final answer as a number on the last line.")

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_WORD = [
    ("{name} has {a} apples and buys {b} more. How many apples does {name} have now?", "+"),
    ("A box holds {a} pens. {b} pens are taken out. How many pens are left in the box?", "-"),
    ("There are {a} rows of chairs with {b} chairs in each row. How many chairs are there?",
     "*"),
    ("{name} read {a} pages on Monday and {b} pages on Tuesday. How many pages in total?", "+"),
]
_NAMES = ["Tom", "Ana", "Lee", "Sara", "Omar", "Mia"]


@dataclasses.dataclass
class Arithmetic(SingleAnswerEnv):
  """`What is A op B?` and word problems; difficulty = operand digits (1-4)."""

  difficulty: int = 2
  ops: str = "+-*"
  word_fraction: float = 0.25
  seed: int = 0
  train_size: int = 100_000
  test_size: int = 500
  tools: tuple = ("python",)
  use_tool_prompt: bool = True
  name: str = "arithmetic"
  interactive: bool = False

  def __post_init__(self):
    if not 1 <= self.difficulty <= 4:
      raise ValueError(f"difficulty={self.difficulty} must be 1-4 (operand digits)")
    bad = set(self.ops) - set(_OPS)
    if bad or not self.ops:
      raise ValueError(f"ops={self.ops!r}: use a non-empty subset of '+-*'")
    self._test: list[Task] | None = None

  @property
  def system_prompt(self) -> str:
    return TOOL_SYSTEM if self.use_tool_prompt else ""

  def _draw(self, rng) -> Task:
    d = self.difficulty
    op = self.ops[int(rng.integers(len(self.ops)))]
    lo, hi = 10 ** (d - 1) if d > 1 else 1, 10**d
    a, b = int(rng.integers(lo, hi)), int(rng.integers(lo, hi))
    if op == "*":  # keep products tractable: second factor one digit shorter
      b = int(rng.integers(1 if d <= 2 else 10 ** (d - 2), 10 ** max(d - 1, 1)))
    if op == "-" and b > a:
      a, b = b, a
    word = rng.random() < self.word_fraction
    if word:  # every op in _OPS has a template
      templates = [t for t, t_op in _WORD if t_op == op]
      tmpl = templates[int(rng.integers(len(templates)))]
      text = tmpl.format(a=a, b=b, name=_NAMES[int(rng.integers(len(_NAMES)))])
    else:
      text = f"What is {a} {op.replace('*', 'x')} {b}?"
    text += " Answer with just the number."
    key = f"{self.name}:{d}:{a}{op}{b}:{int(word)}"
    return Task(self.name, key, text, _OPS[op](a, b), {"a": a, "b": b, "op": op, "word": word})

  def task(self, split: str, index: int) -> Task:
    """Train tasks as `procedural_task` draws them; the test split is built here, so that too
    few distinct test tasks raise instead of looping forever."""
    if split != "test":  # procedural_task checks the split
      return procedural_task(self._draw, self.seed, split, index, [], self.test_size)
    if self._test is None:
      rng = np.random.default_rng([self.seed, 2])
      seen, out = set(), []
      for _ in range(self.test_size * 200):
        t = self._draw(rng)
        if split_of(t.task_id) == "test" and t.task_id not in seen:
          seen.add(t.task_id)
          out.append(t)
          if len(out) == self.test_size:
            break
      if len(out) < self.test_size:
        raise ValueError(f"only {len(out)} distinct test tasks exist at difficulty "
                         f"{self.difficulty}; lower test_size")
      self._test = out
    return self._test[index]

  def reward(self, task: Task, final_text: str) -> float:
    got = last_number(final_text)
    return float(got is not None and abs(got - float(task.answer)) < 1e-6)


# --- when to call the tool: mixed difficulty, a priced tool ----------------------------------

# Short on purpose (every trajectory carries it): the call format is the warm start's to teach.
TOOL_COST_SYSTEM = ("You may call a Python tool; each call costs {cost} points. "
                    "Answer with just the number.")
_EASY_TEXT = ["What is {a} + {b}?", "What is {a} plus {b}?", "Compute {a} + {b}.",
              "Add {a} and {b}.", "{name} has {a} apples and gets {b} more. How many apples?",
              "{name} read {a} pages, then {b} more. How many pages?"]
_HARD_TEXT = ["What is {a} x {b}?", "What is {a} times {b}?", "Compute {a} * {b}.",
              "Multiply {a} by {b}.", "{name} buys {a} boxes of {b} pens. How many pens?",
              "A hall has {a} rows of {b} seats. How many seats?"]
LEVELS = ("easy", "hard")
# Difficulty bins for `ToolArithmetic(levels=...)` (issue 60): name -> (operator, what it
# asks); `ToolArithmetic._operands` draws them. "easy" and "hard" are the original two, the
# others fill the continuum between them.
BINS = {
    "easy": ("+", "1 + 1 digits, the sum below 10 (no carry)"),
    "add1c": ("+", "1 + 1 digits, the sum 10 or more (a carry)"),
    "add2": ("+", "2 + 2 digits"),
    "mul21": ("*", "2 digits x 1 digit (2-9)"),
    "hard": ("*", "3 digits x 2 digits"),
}
CONTINUUM = ("easy", "add1c", "add2", "mul21", "hard")


@dataclasses.dataclass
class ToolArithmetic(SingleAnswerEnv):
  """When is the tool worth its price? Easy items (1-digit + 1-digit with a 1-digit sum: a
  model answers them directly) and hard items (3-digit x 2-digit: about 0% without the
  tool), with the Python tool offered at `tool_cost` reward per call. The reward is 1 for a
  correct final answer minus `tool_cost` per call (the agent loop charges it,
  `Env.tool_cost`), so the best policy calls the tool on hard items and answers easy ones
  directly.

  Each item is phrased one of six ways (two are word problems with a name), so the held-out
  split is disjoint in wording from training; easy items cover only the 36 sums of two
  digits 1-9 below 10, so a held-out easy item asks a fact that training items ask in other
  words. (Sums up to 18 were tried first: SmolLM2-135M answered 37 of the 81 right, greedy,
  so for it the tool beat a direct answer on easy items too.) `task.meta`
  holds the item's `level`, which evaluations group by. `demonstration()` writes the SFT
  warm start's conversations (`launch.sft`).

  `levels` (issue 60; names, or one comma-separated string) draws from difficulty bins
  instead, each as likely (`BINS`; e.g.
  `CONTINUUM`: sums without and with a carry, 2 + 2 digits, 2 x 1 digits, 3 x 2 digits), so
  that the right choice depends on the model's own skill, not on two surface forms; the test
  split holds the bins in turn. Empty (the default): the two levels by `hard_fraction`, as
  before. With `tools=()` the system turn offers no tool (`launch.evaluate --calibration`:
  accuracy without it)."""

  hard_fraction: float = 0.5
  levels: tuple = ()
  tool_cost: float = 0.1
  seed: int = 0
  train_size: int = 100_000
  test_size: int = 100
  tools: tuple = ("python",)
  name: str = "tool_arithmetic"
  interactive: bool = False

  def __post_init__(self):
    if not 0 <= self.hard_fraction <= 1 or not 0 <= self.tool_cost < 1:
      raise ValueError(f"hard_fraction={self.hard_fraction} must be in [0, 1] and "
                       f"tool_cost={self.tool_cost} in [0, 1)")
    if isinstance(self.levels, str):  # "easy,add1c,..." (a config flag)
      self.levels = tuple(x.strip() for x in self.levels.split(",") if x.strip())
    self.levels = tuple(self.levels)
    bad = [lv for lv in self.levels if lv not in BINS]
    if bad or len(set(self.levels)) != len(self.levels):
      raise ValueError(f"levels={self.levels}: distinct names from {list(BINS)}")
    self._test: list[Task] = []

  @property
  def system_prompt(self) -> str:
    if not self.tools:
      return "Answer with just the number."
    return TOOL_COST_SYSTEM.replace("{cost}", f"{self.tool_cost:g}")

  @staticmethod
  def _operands(rng, level: str) -> tuple[int, int]:
    """A level's operands (`BINS`); "easy" and "hard" drawn as they always were."""
    if level == "easy":  # a in 1-8, then b keeping the sum below 10
      a = int(rng.integers(1, 9))
      return a, int(rng.integers(1, 10 - a))
    if level == "hard":
      return int(rng.integers(100, 1000)), int(rng.integers(10, 100))
    if level == "add1c":  # a in 1-9, then b in 10-a .. 9
      a = int(rng.integers(1, 10))
      return a, int(rng.integers(10 - a, 10))
    if level == "add2":
      return int(rng.integers(10, 100)), int(rng.integers(10, 100))
    return int(rng.integers(10, 100)), int(rng.integers(2, 10))  # mul21

  def _draw(self, rng, hard: bool | None = None, level: str | None = None) -> Task:
    if level is None and self.levels:
      level = self.levels[int(rng.integers(len(self.levels)))]
    if level is None:
      if hard is None:
        hard = bool(rng.random() < self.hard_fraction)
      level = LEVELS[int(hard)]
    op = BINS[level][0]
    a, b = self._operands(rng, level)
    texts = _HARD_TEXT if op == "*" else _EASY_TEXT
    k = int(rng.integers(len(texts)))
    name = _NAMES[int(rng.integers(len(_NAMES)))] if "{name}" in texts[k] else ""
    key = f"{self.name}:{level}:{a}{op}{b}:{k}:{name}"
    return Task(self.name, key, texts[k].format(a=a, b=b, name=name), _OPS[op](a, b),
                {"level": level, "a": a, "b": b, "op": op})

  def task(self, split: str, index: int) -> Task:
    """Train tasks as `procedural_task` draws them; the test split holds each level in
    proportion (item i is hard when floor((i + 1) * hard_fraction) grows at i; with `levels`,
    item i is of level i mod their number), distinct items whose keys hash to test, so any
    prefix of it is balanced too."""
    if split != "test":  # procedural_task checks the split
      return procedural_task(self._draw, self.seed, split, index, self._test, self.test_size)
    if not self._test:
      rng, seen = np.random.default_rng([self.seed, 2]), set()
      for i in range(self.test_size):
        hard = int((i + 1) * self.hard_fraction) > int(i * self.hard_fraction)
        level = self.levels[i % len(self.levels)] if self.levels else None
        for _ in range(100_000):
          t = self._draw(rng, hard, level)
          if split_of(t.task_id) == "test" and t.task_id not in seen:
            break
        else:
          raise ValueError(f"too few distinct test items; lower test_size={self.test_size}")
        seen.add(t.task_id)
        self._test.append(t)
    return self._test[index]

  # 1 for the right number on the last line, else 0 (the tool's price is the loop's).
  reward = Arithmetic.reward

  def demonstration(self, task: Task, use_tool: bool) -> list[dict]:
    """A correct conversation for `task`: a tool call, its output and the answer, or the
    answer alone. Messages in the SFT format (`fr_jax.sft`)."""
    m = task.meta
    msgs = [{"role": "system", "content": self.system_prompt},
            {"role": "user", "content": task.prompt}]
    if use_tool:
      code = f"print({m['a']} {m['op']} {m['b']})"
      msgs += [{"role": "assistant", "content": tool_call_text(code)},
               {"role": "tool", "content": f"{task.answer}\n"}]  # what print() writes
      return msgs + [{"role": "assistant", "content": str(task.answer)}]
    return msgs + [{"role": "assistant", "content": f"{self.direct_prefix(task)} {task.answer}"}]

  def direct_prefix(self, task: Task) -> str:
    """How a direct answer begins: it restates the problem (SmolLM2-135M, sampled, got 1-digit
    sums right about 20% of the time as a bare number after a warm start on bare numbers).
    The calibration's forced pass (`fr_jax.evaluate`) starts replies with it."""
    m = task.meta
    return f"{m['a']} {dict(zip('+*', '+x'))[m['op']]} {m['b']} ="


def tool_call_text(code: str) -> str:
  """A model turn calling the Python tool on `code`, in the Hermes format the agent loop
  parses."""
  return ("<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}})
          + "\n</tool_call>")


# --- countdown -------------------------------------------------------------------------------

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}
_EXPR_LINE = re.compile(r"[\d\s+\-*/()x×]+")


def eval_expression(text: str) -> tuple[float | None, list[int]]:
  """Value and number literals of an arithmetic expression (+ - * / and parentheses only);
  (None, []) if it is anything else."""
  text = text.replace("×", "*").replace("x", "*")
  try:
    tree = ast.parse(text.strip(), mode="eval")
  except SyntaxError:
    return None, []
  nums: list[int] = []

  def ev(node):
    if isinstance(node, ast.Expression):
      return ev(node.body)
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
      return _BIN[type(node.op)](ev(node.left), ev(node.right))
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
      nums.append(node.value)
      return node.value
    raise ValueError("not allowed")

  try:
    return float(ev(tree)), nums
  except (ValueError, ZeroDivisionError, TypeError):
    return None, []


@dataclasses.dataclass
class Countdown(SingleAnswerEnv):
  """Reach the target with + - * / using each given number at most once."""

  numbers: int = 4
  max_number: int = 25
  seed: int = 0
  train_size: int = 100_000
  test_size: int = 500
  tools: tuple = ("python",)
  name: str = "countdown"
  interactive: bool = False

  def __post_init__(self):
    self._test: list[Task] = []

  system_prompt = ("Combine the given numbers with +, -, * and / (each number at most once) "
                   "to reach the target. Put the expression alone on the last line, e.g. "
                   "(3 + 5) * 2.")

  def _draw(self, rng) -> Task:
    nums = [int(x) for x in rng.integers(1, self.max_number + 1, self.numbers)]
    # A reachable target: fold a random order of the numbers with random operators.
    order = list(rng.permutation(nums))
    value = order[0]
    for x in order[1:]:
      op = "+-*"[int(rng.integers(3))]
      cand = _OPS[op](value, x)
      value = cand if 0 < cand <= 1000 else value + x
    key = f"{self.name}:{sorted(nums)}:{value}"
    text = f"Numbers: {', '.join(map(str, nums))}. Target: {value}."
    return Task(self.name, key, text, int(value), {"numbers": nums})

  def task(self, split, index):
    return procedural_task(self._draw, self.seed, split, index, self._test, self.test_size)

  def reward(self, task: Task, final_text: str) -> float:
    lines = [line for line in final_text.strip().splitlines() if line.strip()]
    expr = lines[-1].split("=")[0] if lines else ""
    if not _EXPR_LINE.fullmatch(expr.strip() or "?"):
      return 0.0
    value, used = eval_expression(expr)
    if value is None or abs(value - task.answer) > 1e-9:
      return 0.0
    # Each given number at most once: `used` is a sub-multiset of the numbers.
    return float(not collections.Counter(used) - collections.Counter(task.meta["numbers"]))
