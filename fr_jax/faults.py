"""Fault-injection points for the chaos run (`make chaos`); off unless FR_JAX_FAULT_DIR is set.

A point is on while a file of its name exists in $FR_JAX_FAULT_DIR, so a harness switches
faults on and off in a running process by creating and removing files. Each point raises the
real failure the code around it must survive (the same exception type and errno), at the place
it would occur. With the variable unset, `active` is one string test.

Points:
* `admission_log_enospc`: an admission-log append writes half its frame, then fails with
  ENOSPC, as a disk that fills up mid-write does.
"""

from __future__ import annotations

import os

_DIR = os.environ.get("FR_JAX_FAULT_DIR", "")
POINTS = ("admission_log_enospc",)


def active(point: str) -> bool:
  assert point in POINTS, point
  return bool(_DIR) and os.path.exists(os.path.join(_DIR, point))
