"""Executes a notebook's code cells in order in one namespace, like a kernel would (no
Jupyter needed): python tests/run_notebook.py notebooks/quickstart.ipynb"""

import json
import sys

import matplotlib

matplotlib.use("Agg")


def main(path):
  nb = json.load(open(path))
  ns = {"__name__": "__main__"}
  for i, cell in enumerate(nb["cells"]):
    if cell["cell_type"] != "code":
      continue
    src = "".join(cell["source"])
    print(f"--- cell {i}", flush=True)
    exec(compile(src, f"{path}:cell{i}", "exec"), ns)
  print("NOTEBOOK OK", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
