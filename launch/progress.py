"""A progress bar over updates: reward, acceptance rate, tokens/s, lag, queue depth, and the
last held-out accuracy (with its update, and its task count when it is a slice)."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
  def __init__(self, total: int, initial: int = 0):
    self.bar = tqdm(total=total, initial=initial, desc="updates", unit="upd",
                    file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

  def update(self, m: dict, service, held_out: dict | None = None) -> None:
    """`held_out`: the last held-out evaluation, {version, accuracy[, n]} (None: none)."""
    self.bar.n = service.version
    extra = {}
    if held_out is not None:
      n = f", {held_out['n']} tasks" if held_out.get("n") else ""
      extra["held_out"] = f"{held_out['accuracy']:.3f} (v{held_out['version']}{n})"
    self.bar.set_postfix(reward=f"{m['reward_mean']:.3f}", accept=f"{m['acceptance_rate']:.2f}",
                         tok_s=f"{m['tokens_per_s']:.0f}", lag=m["policy_lag_max"],
                         queue=len(service.queue), **extra, refresh=False)
    self.bar.refresh()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.bar.close()
