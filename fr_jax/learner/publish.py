"""Weight publication: the snapshot of the learner's parameters that workers load.

Updates donate the live parameter buffers, so a published version is a copy
(`Learner.snapshot_params`: on device, or in host memory when the learner spans processes),
taken between updates and handed out by version (`weights(min_version)`), never the live state.
With a shard sink (`Learner.shard_sink`, set by launch.learner for weight relays), each
learner process also keeps its own pieces of each version in the servers' dtype
(`fr_jax.transport.shards`).
With `keep` > 1 the last `keep` versions stay available by number (`weights_at`), for a
worker that samples at a fixed lag (`rollout.fixed_lag`).
With an HF export directory each publication is also written as HF safetensors for SGLang
fleets, as a whole directory `vNNNNNNNN` (`durable.write_version`: a reader sees it whole or
not at all). Pruning keeps the version just written and the previous publication (servers
may still be loading it); after a restart, which has no previous publication, the newest
other version on disk (what the fleet may still serve). A restarted learner's version is
below the ones it wrote before; it is never the one pruned.
LoRA over the wire (`lora_weights`): once a worker has asked for a LoRA run's versions as
adapters (GetWeights' `form`), each publication also keeps the adapters as host copies, and
the frozen base once, so that a worker fetches the base one time and then the adapters'
bytes only. Until the next publication after that first ask, workers get the merged model.
"""

from __future__ import annotations

import collections
import threading

from fr_jax import durable
from fr_jax.models import lora


class Publisher:
  def __init__(self, learner, hf_export_dir: str = "", keep: int = 1):
    if keep < 1:
      raise ValueError(f"keep={keep}: at least the newest version is kept")
    self.learner = learner
    self.hf_export_dir = hf_export_dir
    self.hf_dir = ""  # the newest export, for SGLang fleets
    self._exported = None  # the previous export's version (None: none by this process)
    self._lock = threading.Lock()
    self._kept: collections.OrderedDict = collections.OrderedDict()  # version -> params
    self.keep = keep
    self.lora_wanted = False  # a worker asked for adapters (`lora_weights`)
    self._lora: dict = {}  # version -> the adapters, flat host copies
    self._lora_base = None  # the frozen base, flat host copies (taken once)

  @property
  def version(self) -> int:
    """The published version (-1 before the first publication)."""
    with self._lock:
      return self._newest()[0]

  def _newest(self):
    """(version, params) of the newest publication, (-1, None) before the first (locked)."""
    return next(reversed(self._kept.items()), (-1, None))

  def publish(self, version: int) -> None:
    """Snapshots the learner's current parameters as `version` (call between updates). With
    a shard sink every process hands it its own pieces (`Learner.publish_shards`); a learner
    over several processes then gathers nothing unless it also exports HF files, and
    `weights()` gives (version, None)."""
    sink = getattr(self.learner, "shard_sink", None)
    if sink is not None:
      self.learner.publish_shards(version=version)
    whole = sink is None or self.learner.group is None or bool(self.hf_export_dir)
    params = self.learner.snapshot_params() if whole else None
    if self.hf_export_dir:
      if self._exported is None:
        durable.clean_partial(self.hf_export_dir)
      path = durable.write_version(self.hf_export_dir, version,
                                   lambda d: self.learner.export_hf(d, params))
      self.hf_dir = str(path)
      durable.prune(self.hf_export_dir, version, keep=2, also=self._exported)
      self._exported = version
    lora_now = None
    if self.lora_wanted and self.learner.group is None and lora.has_adapters(
        self.learner.params):
      lora_now = self.learner.lora_snapshot(with_base=self._lora_base is None)
    with self._lock:
      for v in [v for v in self._kept if v >= version]:  # a restored learner went back
        del self._kept[v]
      self._kept[version] = params
      while len(self._kept) > self.keep:
        self._kept.popitem(last=False)
      if lora_now is not None:
        adapters, base = lora_now
        self._lora_base = self._lora_base if base is None else base
        self._lora[version] = adapters
      self._lora = {v: a for v, a in self._lora.items() if v in self._kept}

  def lora_weights(self, min_version: int, form: str):
    """(version, flat host arrays) of the newest version if >= min_version: with form "lora"
    the frozen base and the adapters, with "adapters" the adapters alone; None if this
    version has none at hand (not a LoRA run, or no worker had asked before it was
    published: the caller sends the merged model). Asking marks them wanted."""
    if form not in ("lora", "adapters"):
      raise ValueError(f"form={form!r}: lora or adapters")
    self.lora_wanted = True
    with self._lock:
      v, _ = self._newest()
      adapters = self._lora.get(v)
      if v < min_version or adapters is None:
        return None
      return v, ({**self._lora_base, **adapters} if form == "lora" else dict(adapters))

  def weights(self, min_version: int = 0):
    """(version, params) of the published weights if version >= min_version, else None."""
    with self._lock:
      v, p = self._newest()
    return (v, p) if v >= min_version else None

  def weights_at(self, version: int):
    """(status, params): ("ok", the params published as `version`), ("not_yet", None)
    before it is published, or ("gone", None) once it is older than the last `keep`."""
    with self._lock:
      if version in self._kept:
        return "ok", self._kept[version]
      return ("not_yet" if version > self._newest()[0] else "gone"), None
