"""Weight publication: the snapshot of the learner's parameters that workers load.

Updates donate the live parameter buffers, so a published version is a copy
(`Learner.snapshot_params`: on device, or in host memory when the learner spans processes),
taken between updates and handed out by version (`weights(min_version)`), never the live state.
With an HF export directory each publication is also written as HF safetensors for SGLang
fleets (`vNNNNNNNN`, the last two kept).
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path


class Publisher:
  def __init__(self, learner, hf_export_dir: str = ""):
    self.learner = learner
    self.hf_export_dir = hf_export_dir
    self.hf_dir = ""  # the newest export, for SGLang fleets
    self._lock = threading.Lock()
    self._published: tuple[int, object] = (-1, None)

  @property
  def version(self) -> int:
    """The published version (-1 before the first publication)."""
    with self._lock:
      return self._published[0]

  def publish(self, version: int) -> None:
    """Snapshots the learner's current parameters as `version` (call between updates)."""
    params = self.learner.snapshot_params()
    if self.hf_export_dir:
      path = Path(self.hf_export_dir) / f"v{version:08d}"
      self.learner.export_hf(path, params)
      self.hf_dir = str(path)
      for old in sorted(Path(self.hf_export_dir).glob("v*"))[:-2]:  # keep the last two
        shutil.rmtree(old, ignore_errors=True)
    with self._lock:
      self._published = (version, params)

  def weights(self, min_version: int = 0):
    """(version, params) of the published weights if version >= min_version, else None."""
    with self._lock:
      v, p = self._published
    return (v, p) if v >= min_version else None
