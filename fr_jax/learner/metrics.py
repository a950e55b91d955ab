"""Metric sinks: one JSON object per line (`metrics.jsonl`) and TensorBoard event files,
written with the `tensorboard` package alone (no TensorFlow)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from fr_jax import durable


def _scalar(v):
  try:
    return float(v)
  except (TypeError, ValueError):
    return None


class MetricsWriter:
  """Writes scalar metrics per step to `<dir>/metrics.jsonl` and `<dir>/tb/`."""

  def __init__(self, directory: str | None):
    self.dir = Path(directory) if directory else None
    self._jsonl = self._tb = None
    if self.dir:
      self.dir.mkdir(parents=True, exist_ok=True)
      self._jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)
      self._tb = EventFileWriter(str(self.dir / "tb"))

  def write(self, step: int, metrics: dict, prefix: str = "") -> None:
    if not self.dir:
      return
    row = {"step": int(step), "time": time.time()}
    values = []
    for k, v in metrics.items():
      f = _scalar(v)
      k = f"{prefix}{k}"
      if f is None:
        row[k] = v  # lists, strings: JSONL only
        continue
      row[k] = f if math.isfinite(f) else str(f)
      values.append(summary_pb2.Summary.Value(tag=k, simple_value=f))
    self._jsonl.write(json.dumps(row) + "\n")
    self._tb.add_event(event_pb2.Event(wall_time=row["time"], step=int(step),
                                       summary=summary_pb2.Summary(value=values)))

  def forget_after(self, step: int) -> None:
    """Drops the metrics.jsonl rows past `step`: a run resumed from the checkpoint at `step`
    redoes those updates and writes their rows again. (TensorBoard readers keep the newest
    event per step.)"""
    if not self.dir:
      return
    path = self.dir / "metrics.jsonl"
    self._jsonl.flush()
    rows = [r for r in read_jsonl(path) if r["step"] <= step]  # a torn last line goes too
    self._jsonl.close()
    durable.write_file(path, "".join(json.dumps(r) + "\n" for r in rows))
    self._jsonl = open(path, "a", buffering=1)

  def flush(self):
    if self._tb:
      self._tb.flush()

  def close(self):
    if self._jsonl:
      self._jsonl.close()
      self._tb.close()
      self._jsonl = self._tb = None


def read_jsonl(path) -> list[dict]:
  """The rows of a JSONL file. A last line cut short (a crash mid-write) is left out; a bad
  line anywhere else raises."""
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  rows = []
  for i, line in enumerate(lines):
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      if i + 1 < len(lines) or line.endswith("\n"):
        raise
  return rows
