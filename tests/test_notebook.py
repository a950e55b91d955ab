"""notebooks/quickstart.ipynb runs end to end (fast mode: the tiny model), in its own process."""

import os
import subprocess
import sys


def test_quickstart_notebook_runs():
  env = dict(os.environ, FR_JAX_NOTEBOOK_FAST="1", JAX_PLATFORMS="cpu", XLA_FLAGS="")
  out = subprocess.run([sys.executable, "tests/run_notebook.py", "notebooks/quickstart.ipynb"],
                       capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "NOTEBOOK OK" in out.stdout
  assert "action tokens of" in out.stdout  # the coloured trajectory was rendered
  assert "'updates': 3" in out.stdout
