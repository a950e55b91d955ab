"""The notebooks run end to end in fast mode (tiny models), each in its own Jupyter kernel.

nbclient executes the notebook as Jupyter would (cells in order, one kernel, figures through
the kernel's inline backend); nbformat reads it. The kernel is always this interpreter (the
.venv's python): the kernel spec manager searches no kernel directories, so `python3` is
ipykernel's built-in spec, whose command is `sys.executable -m ipykernel_launcher`. A
`python3` kernel.json installed elsewhere (~/.local/share/jupyter, /usr/share/jupyter, or the
one ipykernel's wheel drops in the venv, which runs whatever `python` is on PATH) cannot take
its place.
"""

import os
import sys
import time
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from tests import XLA_TEST_FLAGS

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_TIMEOUT_S = 600  # the whole notebook, kernel start included


def _text(nb) -> str:
  """Everything the code cells printed or displayed as text, in order."""
  parts = []
  for cell in nb.cells:
    for out in cell.get("outputs", []):
      if out.output_type == "stream":
        parts.append(out.text)
      elif out.output_type in ("display_data", "execute_result"):
        parts.append(out.data.get("text/plain", ""))
        parts.append(out.data.get("text/html", ""))
  return "\n".join(parts)


def _run(path: str):
  """Executes `path` (relative to the repository root) in a fresh kernel; returns the
  executed notebook and its text output. A failing cell raises nbclient's
  CellExecutionError, which carries the cell's traceback."""
  nb = nbformat.read(ROOT / path, as_version=4)
  # Appended here, not in the notebook: which interpreter ran the cells.
  nb.cells.append(nbformat.v4.new_code_cell("import sys; print('KERNEL', sys.executable)"))
  ksm = KernelSpecManager(kernel_dirs=[])  # ipykernel's built-in python3 spec only
  km = KernelManager(kernel_name="python3", kernel_spec_manager=ksm)
  assert km.kernel_spec.argv[0] == sys.executable, km.kernel_spec.argv
  deadline = time.monotonic() + NOTEBOOK_TIMEOUT_S
  client = NotebookClient(nb, km=km, kernel_name="python3", startup_timeout=120,
                          timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
                          resources={"metadata": {"path": str(ROOT)}})
  env = dict(os.environ, FR_JAX_NOTEBOOK_FAST="1", JAX_PLATFORMS="cpu", XLA_FLAGS=XLA_TEST_FLAGS)
  client.execute(env=env)
  out = _text(nb)
  assert f"KERNEL {sys.executable}\n" in out
  return nb, out


def _figures(nb) -> int:
  return sum("image/png" in out.get("data", {}) for cell in nb.cells
             for out in cell.get("outputs", []))


def test_quickstart_notebook_runs():
  nb, out = _run("notebooks/quickstart.ipynb")
  assert "action tokens of" in out  # the coloured trajectory was rendered
  assert "color:#2e8b57" in out  # ... as HTML, with the sampled tokens in green
  assert "'updates': 3" in out
  assert _figures(nb) == 1  # reward and acceptance rate


def test_ablations_notebook_fast_mode_runs_a_comparison_end_to_end():
  nb, out = _run("notebooks/ablations.ipynb")
  assert "comparisons: ['fast']" in out
  # The table has both arms with intervals, and the claim row was judged.
  assert "| signed | " in out and "| positive_only | " in out
  assert "end.accuracy" in out and "->" in out
  assert "figures drawn for 1 comparisons" in out
  assert _figures(nb) == 2  # accuracy per arm, training curves
