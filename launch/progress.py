"""A progress bar over updates: reward, acceptance rate, tokens/s, lag, queue depth."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
  def __init__(self, total: int, initial: int = 0):
    self.bar = tqdm(total=total, initial=initial, desc="updates", unit="upd",
                    file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

  def update(self, m: dict, service) -> None:
    self.bar.n = service.version
    self.bar.set_postfix(reward=f"{m['reward_mean']:.3f}", acc=f"{m['acceptance_rate']:.2f}",
                         tok_s=f"{m['tokens_per_s']:.0f}", lag=m["policy_lag_max"],
                         queue=len(service.queue), refresh=False)
    self.bar.refresh()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.bar.close()
