"""Environments (procedural tasks with verifiable rewards) and the sandboxed Python tool."""

from __future__ import annotations


def make(name: str, **kwargs):
  """An environment by name: arithmetic, tool_arithmetic, countdown, textworld or digits
  (keyword settings passed on)."""
  from fr_jax.envs.arithmetic import Arithmetic, Countdown, ToolArithmetic
  from fr_jax.envs.digits import Digits
  from fr_jax.envs.textworld import TextWorld
  envs = {"arithmetic": Arithmetic, "countdown": Countdown, "textworld": TextWorld,
          "digits": Digits, "tool_arithmetic": ToolArithmetic}
  if name not in envs:
    raise ValueError(f"unknown env {name!r}; choose one of {sorted(envs)}")
  return envs[name](**kwargs)
