"""Which records make an update non-finite: the search behind the service's quarantine.

A step whose loss or gradient is not finite applies nothing (the update's guard) and reports
its records; the learner service (`LearnerService._quarantine`) then dead-letters the ones
this search names and gives the rest back to the queue. A record alone may well be finite (a
huge reward alone has advantage 0), so the probes always remove records and score what is
left with its own normalisers, as the next update would, never a record on its own.
"""

from __future__ import annotations

from collections.abc import Callable


def minimal_offenders(n: int, finite_without: Callable[[set], bool]) -> list[int]:
  """Indices of a smallest set among records 0..n-1 whose removal makes the batch finite,
  by bisection over removals: about 2 log2(n) probes per offender. `finite_without(removed)`
  tells whether the batch without the `removed` indices is finite (True for an empty rest).
  Empty if the whole batch is finite."""

  def minimize(cands: list[int], base: set) -> list[int]:
    # finite_without(base | cands) holds; finite_without(base) does not.
    if len(cands) == 1:
      return cands
    left, right = cands[:len(cands) // 2], cands[len(cands) // 2:]
    if finite_without(base | set(left)):
      return minimize(left, base)
    if finite_without(base | set(right)):
      return minimize(right, base)
    found = minimize(left, base | set(right))  # offenders on both sides
    return found + minimize(right, base | set(found))

  if n == 0 or finite_without(set()):
    return []
  return minimize(list(range(n)), set())
