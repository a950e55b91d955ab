"""An ALFWorld-like text household: rooms of receptacles holding objects, and goals such as
"put a clean mug in cabinet 2". Multi-turn: each model turn is one command, the environment
answers with an observation. Reward 1 when the goal holds, else 0.

Layouts (which receptacles exist, where objects start) come from a layout id. Training and the
"seen" test split use layout ids 0..seen_layouts-1 (with disjoint goals); the "test_unseen"
split uses layouts never seen in training.

Commands: go to X | open X | close X | take O from X | put O in/on X | clean O with sinkbasin 1
| heat O with microwave 1 | cool O with fridge 1 | look | inventory.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from fr_jax.envs.base import Task, split_of

OPENABLE = {"cabinet", "drawer", "fridge", "microwave"}
OBJECTS = ["mug", "cup", "apple", "potato", "plate", "bowl", "egg", "tomato", "bread", "spoon"]
GOALS = ("place", "clean", "heat", "cool")
_ADJ = {"clean": "clean", "heat": "hot", "cool": "cool"}
SPLITS = ("train", "test", "test_unseen")

SYSTEM = ("You are in a household. Reach the goal by giving one command per turn, and nothing "
          "else. Commands: go to X, open X, close X, take O from X, put O in X, "
          "clean O with sinkbasin 1, heat O with microwave 1, cool O with fridge 1, look, "
          "inventory.")


def _layout(layout_id: int, seed: int) -> dict:
  rng = np.random.default_rng([seed, 77, layout_id])
  recs = ["fridge 1", "microwave 1", "sinkbasin 1"]
  for kind, most in (("cabinet", 4), ("countertop", 2), ("drawer", 3), ("shelf", 2),
                     ("table", 1)):
    recs += [f"{kind} {i}" for i in range(1, int(rng.integers(1, most + 1)) + 1)]
  holders = [r for r in recs if not r.startswith(("sinkbasin", "microwave"))]
  objs = {f"{name} 1": holders[int(rng.integers(len(holders)))]
          for name in rng.permutation(OBJECTS)[: int(rng.integers(5, 9))]}
  return {"receptacles": sorted(recs), "objects": objs}


@dataclasses.dataclass
class TextWorld:
  seed: int = 0
  seen_layouts: int = 40
  unseen_layouts: int = 20
  train_size: int = 100_000
  test_size: int = 200
  name: str = "textworld"
  tools: tuple = ()
  interactive: bool = True
  system_prompt: str = SYSTEM

  def split_size(self, split: str) -> int:
    if split not in SPLITS:
      raise ValueError(f"split={split!r}: choose one of {SPLITS}")
    return self.train_size if split == "train" else self.test_size

  def _draw(self, rng, layout_id: int) -> Task:
    lay = _layout(layout_id, self.seed)
    obj = sorted(lay["objects"])[int(rng.integers(len(lay["objects"])))]
    goal = GOALS[int(rng.integers(len(GOALS)))]
    targets = [r for r in lay["receptacles"] if r != lay["objects"][obj]
               and not r.startswith(("sinkbasin", "microwave", "fridge"))]
    target = targets[int(rng.integers(len(targets)))]
    kind = obj.split()[0]
    desc = f"put a {_ADJ[goal] + ' ' if goal in _ADJ else ''}{kind} in {target}"
    key = f"{self.name}:{layout_id}:{goal}:{obj}:{target}"
    prompt = (f"You are in the middle of a room. Looking quickly around you, you see "
              f"{', '.join('a ' + r for r in lay['receptacles'])}.\nYour task is to: {desc}.")
    return Task(self.name, key, prompt, {"object": obj, "goal": goal, "target": target},
                {"layout": layout_id})

  def task(self, split: str, index: int) -> Task:
    self.split_size(split)
    if split == "test_unseen":
      rng = np.random.default_rng([self.seed, 3, index])
      return self._draw(rng, 10_000 + int(rng.integers(self.unseen_layouts)))
    rng = np.random.default_rng([self.seed, 1 if split == "train" else 2, index])
    while True:
      t = self._draw(rng, int(rng.integers(self.seen_layouts)))
      if split_of(t.task_id, 0.2) == split:
        return t

  def reward(self, task: Task, final_text: str) -> float:
    raise ValueError("textworld is interactive: the reward comes from its Episode")

  def start(self, task: Task) -> Household:
    return Household(task, _layout(task.meta["layout"], self.seed))


class Household:
  """One episode's state; `observe(action)` applies a command."""

  def __init__(self, task: Task, layout: dict):
    self.task = task
    self.recs = list(layout["receptacles"])
    self.where = dict(layout["objects"])  # object -> receptacle, or "hand"
    self.state = {o: set() for o in self.where}  # clean / hot / cool
    self.opened: set[str] = set()
    self.at: str | None = None
    self.done = False

  def _contents(self, r):
    items = sorted(o for o, w in self.where.items() if w == r)
    return ", ".join("a " + o for o in items) if items else "nothing"

  def _holding(self):
    return next((o for o, w in self.where.items() if w == "hand"), None)

  def _goal_met(self) -> bool:
    g = self.task.answer
    kind = g["object"].split()[0]
    need = _ADJ.get(g["goal"])
    return any(o.split()[0] == kind and w == g["target"] and (need is None or need in self.state[o])
               for o, w in self.where.items())

  def observe(self, action_text: str) -> tuple[str, bool]:
    obs = self._apply(_normalise(action_text))
    if self._goal_met():
      self.done = True
      obs += " You have completed the task."
    return obs, self.done

  def reward(self) -> float:
    return float(self._goal_met())

  def _apply(self, cmd: str) -> str:
    m = re.fullmatch(r"go to (.+)", cmd)
    if m and m.group(1) in self.recs:
      r = self.at = m.group(1)
      if not self._accessible(r):
        return f"You arrive at {r}. The {r} is closed."
      return f"You arrive at {r}. On the {r}, you see {self._contents(r)}."
    m = re.fullmatch(r"(open|close) (.+)", cmd)
    if m and m.group(2) == self.at and self.at.split()[0] in OPENABLE:
      r = self.at
      if m.group(1) == "open":
        self.opened.add(r)
        return f"You open the {r}. In it, you see {self._contents(r)}."
      self.opened.discard(r)
      return f"You close the {r}."
    m = re.fullmatch(r"take (.+) from (.+)", cmd)
    if m and m.group(2) == self.at and self.where.get(m.group(1)) == self.at:
      if self._holding() is None and self._accessible(self.at):
        self.where[m.group(1)] = "hand"
        return f"You pick up the {m.group(1)} from the {self.at}."
    m = re.fullmatch(r"put (.+) (?:in|on|in/on) (.+)", cmd)
    if m and m.group(2) == self.at and self.where.get(m.group(1)) == "hand":
      if self._accessible(self.at):
        self.where[m.group(1)] = self.at
        return f"You put the {m.group(1)} in/on the {self.at}."
    m = re.fullmatch(r"(clean|heat|cool) (.+) with (sinkbasin 1|microwave 1|fridge 1)", cmd)
    tool = {"clean": "sinkbasin 1", "heat": "microwave 1", "cool": "fridge 1"}
    if m and m.group(3) == tool[m.group(1)] == self.at and self.where.get(m.group(2)) == "hand":
      self.state[m.group(2)].add(_ADJ[m.group(1)])
      return f"You {m.group(1)} the {m.group(2)} using the {self.at}."
    if cmd == "look":
      where = f"at {self.at}" if self.at else "in the middle of a room"
      return f"You are {where}. You see {', '.join('a ' + r for r in self.recs)}."
    if cmd == "inventory":
      h = self._holding()
      return f"You are carrying: a {h}." if h else "You are not carrying anything."
    return "Nothing happens."

  def _accessible(self, r: str) -> bool:
    return r.split()[0] not in OPENABLE or r in self.opened


def _normalise(text: str) -> str:
  """The command in a model turn: its last non-empty line, lower-cased, without
  punctuation around it or a leading '>'/'Action:'."""
  lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
  cmd = lines[-1] if lines else ""
  cmd = re.sub(r"^(>|action:|command:)\s*", "", cmd.lower()).strip(" .!`'\"")
  return re.sub(r"\s+", " ", cmd.replace("in/on", "in"))
