"""Orbax checkpoints: asynchronous saves every N updates, keeping K.

Each save holds the TrainState (parameters, optimizer state, step = policy version, skipped
count) and a JSON record with the run config, the prompt/trajectory iterator's state (grain's
`get_state()`), and anything else the caller adds. `restore()` returns both, with arrays
placed on the shardings of a template state, so a restart continues exactly where the run
stopped.

`latest_step()` includes an asynchronous save still being written; `committed_step()` does
not. Anything that may only happen once a step is safely on disk (compacting the admission
log) asks the latter: a crash during the write leaves only Orbax's temporary folder, and a
restart comes back from the step before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  def __init__(self, directory: str, *, every: int = 50, keep: int = 3,
               async_save: bool = True):
    if every < 1 or keep < 1:
      raise ValueError(f"checkpoint every={every} and keep={keep} must be >= 1")
    self.dir = Path(directory).absolute()
    self.every = every
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    self.manager = ocp.CheckpointManager(self.dir, options=options)

  def latest_step(self) -> int | None:
    """The newest step saved or being saved."""
    return self.manager.latest_step()

  def committed_step(self) -> int | None:
    """The newest step whose save has finished (`committed_steps`)."""
    steps = committed_steps(self.dir)
    return steps[-1] if steps else None

  def should_save(self, step: int) -> bool:
    return step > 0 and step % self.every == 0

  def save(self, step: int, state, meta: dict, *, force: bool = False) -> bool:
    """Starts a (possibly asynchronous) save; returns whether one was started."""
    if not force and not self.should_save(step):
      return False
    return self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=force)

  def restore(self, template_state, step: int | None = None) -> tuple[Any, dict, int]:
    """(state, meta, step) of `step` (default: the latest). Raises FileNotFoundError if none."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.dir}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template_state)
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"], step

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def committed_steps(directory) -> list[int]:
  """The steps in `directory` whose save has finished, oldest first: Orbax writes into a
  temporary folder and renames it to the bare step number when the checkpoint is complete."""
  d = Path(directory)
  if not d.is_dir():
    return []
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and p.is_dir())


def restore_params(step_dir) -> tuple[Any, dict]:
  """(parameters as host NumPy arrays, the step's meta record) of one saved step, reading
  only `state.params`: an Orbax partial restore, no optimizer state, no device copy
  (`launch.export`, `launch.evaluate`). ValueError for a step not a learner's train state."""
  import numpy as np
  from etils import epath
  state = epath.Path(step_dir) / "state"
  handler = ocp.PyTreeCheckpointHandler()
  try:
    tree = handler.metadata(state).tree
    if "params" not in tree:
      raise ValueError(f"{state} holds {sorted(tree)}, not a train state with params")
    item = {"params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype),
                                   tree["params"])}
    as_numpy = {"params": jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray),
                                       tree["params"])}
    params = handler.restore(state, args=ocp.args.PyTreeRestore(
        item=item, restore_args=as_numpy, partial_restore=True))["params"]
  finally:
    handler.close()
  meta = ocp.JsonCheckpointHandler().restore(epath.Path(step_dir) / "meta")
  if not isinstance(meta, dict) or "config" not in meta:
    raise ValueError(f"{step_dir}/meta has no run config: not a checkpoint written by the "
                     "learner")
  return params, meta
