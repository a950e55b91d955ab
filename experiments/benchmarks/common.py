"""Helpers shared by the benchmarks: JSON-line output, median timing, the machine record."""

import json
import os
import platform
import statistics
import time


def emitter(bench: str):
  """A function printing one JSON line {"bench": bench, "kind": kind, ...}."""
  def emit(kind, **kw):
    print(json.dumps({"bench": bench, "kind": kind, **kw}), flush=True)
  return emit


def timed(fn, repeats: int, warmup: int = 1):
  """(median seconds, all seconds) of `repeats` calls after `warmup` untimed calls."""
  for _ in range(warmup):
    fn()
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts), ts


def cpu_model() -> str:
  """The CPU's model name (/proc/cpuinfo), or the platform's processor string."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor()


def machine() -> dict:
  import jax
  return {"platform": platform.platform(), "cpu": cpu_model(), "python": platform.python_version(),
          "cpu_count": os.cpu_count(), "jax": jax.__version__,
          "backend": jax.default_backend(), "device": str(jax.devices()[0])}


def torch_matmul_peak(n: int = 2048, repeats: int = 5) -> float:
  """FLOP/s of an n x n f32 matmul in torch (its default threads): the peer's own kernel peak,
  to read a speed ratio against the two libraries' matmuls."""
  import torch
  a = torch.randn(n, n)
  torch.mm(a, a)
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    torch.mm(a, a)
    ts.append(time.perf_counter() - t0)
  return 2 * n**3 / statistics.median(ts)
