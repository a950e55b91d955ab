"""Compiled learner programs shared by every `Learner` of a process (`PROGRAMS`): tests and
launches build many learners with equal configs, and each would otherwise compile the same
update again. The key is the learner's (`Learner._program_key`)."""

from __future__ import annotations

import collections
import threading


class Programs:
  """The compiled update and accumulate programs of every `Learner` in this process, shared:
  two learners with the same step config, optimizer settings and argument shapes, dtypes and
  shardings (hence mesh) run the same program, and only the first compiles it. The key holds
  everything the program depends on (`Learner._program_key`); the `kept` most recently used
  programs stay."""

  def __init__(self, kept: int = 64):
    self.kept = kept
    self.compiles = 0  # programs compiled in this process (the tests read it)
    self._programs: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()

  def get(self, key, compile_fn):
    """(executable, compiled_now): the program under `key`, compiled by `compile_fn()` the
    first time."""
    with self._lock:
      if key in self._programs:
        self._programs.move_to_end(key)
        return self._programs[key], False
    exe = compile_fn()  # outside the lock: a learner in another thread may compile meanwhile
    with self._lock:
      self.compiles += 1
      self._programs[key] = exe
      while len(self._programs) > self.kept:
        self._programs.popitem(last=False)
    return exe, True

  def clear(self) -> None:
    with self._lock:
      self._programs.clear()

  def __len__(self) -> int:
    return len(self._programs)


PROGRAMS = Programs()
