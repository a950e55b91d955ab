"""Means with Student-t 95% confidence intervals, paired differences across seeds, and the
verdict on a claimed direction. The t quantile comes from scipy.stats."""

from __future__ import annotations

import math
from collections.abc import Sequence

import scipy.stats


def t975(df: int) -> float:
  """The Student-t quantile t_{0.975, df}: the half-width factor of a two-sided 95% interval
  with `df` degrees of freedom (scipy.stats.t, exact for every df)."""
  if df < 1:
    raise ValueError(f"df={df}: a confidence interval needs at least 2 values")
  return float(scipy.stats.t.ppf(0.975, df))


def mean_ci(values: Sequence[float]) -> dict:
  """{mean, lo, hi, half, n}: the sample mean and its two-sided 95% t interval (a single
  value gets a zero-width interval, marked n=1)."""
  x = [float(v) for v in values]
  n = len(x)
  if n == 0:
    raise ValueError("no values")
  m = sum(x) / n
  if n == 1:
    return dict(mean=m, lo=m, hi=m, half=0.0, n=1)
  sd = math.sqrt(sum((v - m) ** 2 for v in x) / (n - 1))
  half = t975(n - 1) * sd / math.sqrt(n)
  return dict(mean=m, lo=m - half, hi=m + half, half=half, n=n)


def paired(a: Sequence[float], b: Sequence[float]) -> dict:
  """mean_ci of a_i - b_i (the same seed gives both arms the same warm start and prompts)."""
  if len(a) != len(b):
    raise ValueError(f"paired values need equal lengths, got {len(a)} and {len(b)}")
  return mean_ci([x - y for x, y in zip(a, b)])


def verdict(diff: dict, expect_positive: bool) -> str:
  """Does a paired difference (first arm minus second) go the way the paper says?

  reproduces: the 95% interval excludes 0 on the paper's side; same direction, not
  significant: the mean is on the paper's side but the interval includes 0; no effect /
  opposite direction: the mean is on the other side (or 0) and the interval includes 0;
  contradicts: the interval excludes 0 on the other side.
  """
  sign = 1.0 if expect_positive else -1.0
  lo, hi, m = sign * diff["lo"], sign * diff["hi"], sign * diff["mean"]
  lo, hi = min(lo, hi), max(lo, hi)
  if lo > 0:
    return "reproduces"
  if hi < 0:
    return "contradicts"
  return "same direction, not significant" if m > 0 else "not reproduced (no effect)"
