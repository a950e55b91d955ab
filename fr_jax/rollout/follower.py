"""Following the learner's weights: one rule for every producer (a rollout worker, the gateway).

A producer heartbeats; the learner's answer carries its current version (and, for a server
fleet, the HF directory that holds it). When that version differs from the engine's (newer,
or older after a learner restart), or the engine failed since the last load (a restarted
server comes back with the weights it was launched with), the follower loads it: the
parameters themselves from the client for the embedded engine (`weights="arrays"`), or the
directory through the engine's `update_weights` for a server (`weights="hf"`; a heartbeat
without a directory yet loads nothing). In a server fleet fed by weight relays there is no
directory: the relays load the servers, and for a LoRA run, whose versions are adapters the
requests must name, the follower asks the server which one it holds
(`ServerEngine.follow_adapter`). A load that fails raises, and is tried again at the next
heartbeat.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("fr_jax.rollout")

WEIGHT_MODES = ("arrays", "hf")


class WeightFollower:
  """Loads the learner's weights into `engine` when a heartbeat says they changed. `swap`
  runs the engine's update (default: at once; the gateway passes its engine thread's queue,
  so that the swap falls between batches)."""

  def __init__(self, client, engine, weights: str, name: str,
               swap: Callable[[Callable[[], None]], None] | None = None):
    if weights not in WEIGHT_MODES:
      raise ValueError(f"weights={weights!r}: choose arrays (embedded) or hf (a server)")
    self.client, self.engine, self.weights, self.name = client, engine, weights, name
    self.swap = swap or (lambda fn: fn())
    self.reload = False  # load at the next heartbeat, whatever the version

  def engine_failed(self) -> None:
    """The engine failed: a server may have restarted on its launch weights."""
    self.reload = True

  def follow(self, hb: dict | None) -> bool:
    """Loads the version heartbeat reply `hb` names, if the engine needs it; True if loaded."""
    if hb is None or (hb["version"] == self.engine.version and not self.reload):
      return False
    if self.weights == "hf":
      if not hb.get("hf_dir"):  # relays load the servers
        if getattr(self.engine, "follows_adapters", False):
          changed = self.engine.follow_adapter()
          self.reload = False
          return changed
        return False
      self.swap(lambda: self.engine.update_weights(hb["hf_dir"], hb["version"]))
      self.reload = False
      return True
    got = self.client.get_weights(hb["version"])
    if got is None:
      return False
    v, params, _ = got
    self.swap(lambda: self.engine.update_weights(params, v))
    self.reload = False
    log.info("%s: weights -> version %d", self.name, v)
    return True
