"""Adaptive rollouts-in-flight (off by default): additive increase, multiplicative decrease,
steered by the trust rejection rate and the policy lag the learner sees."""

from __future__ import annotations

import logging

log = logging.getLogger("fr_jax.service")


class InflightController:
  """Adaptive rollouts-in-flight (off by default): additive increase, multiplicative decrease.

  After each update it sees the trust rejection rate (1 - acceptance rate) and the max policy
  lag. Above the rejection target or the lag bound, in-flight rollouts shrink by `decrease`;
  comfortably below both (rejection < target / 2, lag < bound), they grow by one. Fewer
  rollouts in flight means fresher data: lower lag and fewer trust-gate rejections. Every
  adjustment is logged and kept in `history`.
  """

  def __init__(self, initial: int, *, target_rejection: float = 0.1, max_lag: int = 4,
               minimum: int = 1, maximum: int = 256, decrease: float = 0.75):
    if not minimum <= initial <= maximum:
      raise ValueError(f"in-flight initial={initial} not in [{minimum}, {maximum}]")
    self.value, self.target, self.max_lag = initial, target_rejection, max_lag
    self.minimum, self.maximum, self.decrease = minimum, maximum, decrease
    self.history: list[dict] = []

  def observe(self, version: int, acceptance_rate: float, lag_max: int) -> int:
    rejection = 1.0 - acceptance_rate
    new = self.value
    if rejection > self.target or lag_max > self.max_lag:
      new = max(self.minimum, int(self.value * self.decrease))
      why = (f"rejection {rejection:.3f} > {self.target}" if rejection > self.target else
             f"lag {lag_max} > {self.max_lag}")
    elif rejection < self.target / 2 and lag_max < self.max_lag:
      new = min(self.maximum, self.value + 1)
      why = f"rejection {rejection:.3f} < {self.target / 2:.3f} and lag {lag_max} < {self.max_lag}"
    if new != self.value:
      log.info("in-flight %d -> %d at version %d (%s)", self.value, new, version, why)
      self.history.append(dict(version=version, old=self.value, new=new, reason=why))
      self.value = new
    return self.value
