"""The notebooks run end to end in fast mode (tiny models), each in its own process."""

import os
import subprocess
import sys


def _run(path: str) -> str:
  env = dict(os.environ, FR_JAX_NOTEBOOK_FAST="1", JAX_PLATFORMS="cpu", XLA_FLAGS="")
  out = subprocess.run([sys.executable, "tests/run_notebook.py", path], capture_output=True,
                       text=True, env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "NOTEBOOK OK" in out.stdout
  return out.stdout


def test_quickstart_notebook_runs():
  out = _run("notebooks/quickstart.ipynb")
  assert "action tokens of" in out  # the coloured trajectory was rendered
  assert "'updates': 3" in out


def test_ablations_notebook_fast_mode_runs_a_comparison_end_to_end():
  out = _run("notebooks/ablations.ipynb")
  assert "comparisons: ['fast']" in out
  # The table has both arms with intervals, and the claim row was judged.
  assert "| signed | " in out and "| positive_only | " in out
  assert "end.accuracy" in out and "->" in out
  assert "figures drawn for 1 comparisons" in out
