r"""The smallest number of 8-GPU nodes of each kind that fits each paper recipe, found
with `launch.compile_check`, and the memory per device of the action-only LM head there.

  .venv-gpu/bin/python -m experiments.benchmarks.fit_table \
      | tee -a experiments/benchmarks/results/compile_check.jsonl

For every recipe and kind it tries node counts `--nodes` (KIND-NODESx8) in order, each first
with the recipe's own micro-batch and then with one row per device, and stops at the first
that fits with the full head (every position scored: a verdict that holds for any batch).
There (for `--head_kinds`) it compiles again with the head over `--action_fractions`'
buckets. Every compile prints one JSON line: compile_check's, plus the recipe, the command
that reproduces it, and `kind` "fit" for the attempts of the search, "head" for the head rows.
`docs/scale.md` has the table. Each compile runs in its own process (`--python`, default this
one), as a user would run it.

`--expert=1,8` repeats each attempt with that expert axis (`--config.mesh.expert`, MoE
recipes; fsdp divided by it, so that the recipe's mesh keeps its device count), and
`--every` compiles every node count and row count instead of stopping at the first fit:

  .venv-gpu/bin/python -m experiments.benchmarks.fit_table --recipes=qwen3_30b_a3b_tool \
      --kinds=h100,h200 --nodes=1,2 --rows=0 --expert=1,8 --every --action_fractions=
"""

import importlib
import json
import subprocess
import sys
import time

from absl import app, flags

from experiments.benchmarks.common import emitter

flags.DEFINE_list("recipes", ["qwen25_math_1p5b", "r1_distill_1p5b_longcot",
                              "qwen25_7b_tool", "qwen3_30b_a3b_tool"], "experiments.configs")
flags.DEFINE_list("kinds", ["h100", "h200", "a100-80g", "b200"],
                  "GPU kinds (launch.compile_check.GPU_KINDS)")
flags.DEFINE_list("nodes", ["1", "2", "4"], "node counts to try, in order")
flags.DEFINE_integer("gpus_per_node", 8, "GPUs per node")
flags.DEFINE_list("action_fractions", ["0.25"], "head rows at the fitting size")
flags.DEFINE_list("head_kinds", None, "the kinds that get head rows (default: the first)")
flags.DEFINE_string("python", sys.executable, "the interpreter that runs compile_check")
flags.DEFINE_list("expert", ["1"], "expert-axis sizes to compile each attempt with (MoE)")
flags.DEFINE_list("rows", ["0", "1"], "rows per device to try, in order (0: the recipe's)")
flags.DEFINE_bool("every", False, "compile every node and row count; no search")
flags.DEFINE_list("extra", [], "more compile_check flags for every attempt")
F = flags.FLAGS


def recipe_mesh(recipe: str):
  return importlib.import_module(f"experiments.configs.{recipe}").get_config().mesh


def compile_check(recipe: str, topology: str, extra: list[str]) -> dict:
  args = [f"--config=experiments/configs/{recipe}.py", f"--topology={topology}", *extra]
  command = " ".join(["python -m launch.compile_check", *args])
  t0 = time.perf_counter()
  r = subprocess.run([F.python, "-m", "launch.compile_check", *args], capture_output=True,
                     text=True)
  if r.returncode:
    return {"recipe": recipe, "command": command, "error": r.stderr.strip()[-600:],
            "wall_s": round(time.perf_counter() - t0, 1)}
  out = json.loads(r.stdout.strip().splitlines()[-1])
  return {"recipe": recipe, "command": command, **out}


def main(argv):
  del argv
  emit = emitter("compile_check")
  for recipe in F.recipes:
    for kind in F.kinds:
      fitted = None
      for nodes in F.nodes:
        for rows in F.rows:
          topology = f"{kind}-{nodes}x{F.gpus_per_node}"
          for expert in F.expert:
            extra = [f"--rows_per_device={rows}", *F.extra]
            if expert != "1":  # the recipe's devices, expert of them per group
              fsdp = max(1, recipe_mesh(recipe).fsdp // int(expert))
              extra += [f"--config.mesh.expert={expert}", f"--config.mesh.fsdp={fsdp}"]
            row = compile_check(recipe, topology, extra)
            emit("fit", **row)
            if row.get("fits") and not fitted:
              fitted = (topology, extra)
          if fitted and not F.every:
            break
        if fitted and not F.every:
          break
      if not fitted or kind not in (F.head_kinds or F.kinds[:1]):
        continue
      for f in F.action_fractions:
        emit("head", **compile_check(recipe, fitted[0], [*fitted[1], f"--action_fraction={f}"]))


if __name__ == "__main__":
  app.run(main)
