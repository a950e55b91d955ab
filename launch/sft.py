r"""Supervised warm start: train on chat conversations before RL.

  python -m launch.sft --config=experiments/configs/cpu_agent.py --run_dir=runs/agent_sft
  python -m launch.sft --config=experiments/configs/cpu_agent.py --run_dir=runs/my_sft \
      --config.sft.data=my_conversations.jsonl --config.sft.steps=200

The data is JSONL, one `{"messages": [...]}` per line (the format is in `fr_jax/sft.py`); with
`sft.data` empty the env writes `sft.examples` demonstrations (`env.demonstration`), saved as
run_dir/sft_data.jsonl first. Each conversation is rendered by the same chat template and
agent-loop layout as a rollout, and the loss is on assistant tokens only
(`objective.loss=sft`). The learner is the RL learner: the same model code, AdamW, Orbax
checkpoints every `sft.checkpoint_every` steps (Ctrl-C stops with a checkpoint; the same
command resumes with exactly the batches the uninterrupted run would have used), metrics in
run_dir/metrics.jsonl and TensorBoard, and at the end an HF safetensors export in
run_dir/export that RL starts from with `--config.model.name=hf:RUN_DIR/export`.
`launch.train` runs this first, into run_dir/sft, when `sft.steps > 0`.

A progress bar shows the loss (mean negative log-likelihood per assistant token); the last
stdout line is the summary as JSON.
"""

import copy
import json
import os
import sys
import time

from launch import common


def learner_config(c):
  """The run config turned into the warm start's learner config."""
  s = copy.deepcopy(c)
  with s.unlocked():
    s.objective.loss = "sft"
    s.objective.temperature = 1.0  # the likelihood of the data, not of a tempered policy
    s.objective.reduction = c.sft.reduction
    s.batch_size, s.minibatches = c.sft.batch_size, 1
    s.optim.lr, s.optim.warmup_frac = c.sft.lr, c.sft.warmup_frac
    s.optim.total_steps = max(c.sft.steps, 1)
    s.checkpoint.every = c.sft.checkpoint_every
  return s


def warm_start(c, model, out_dir: str, *, stop=None, progress: bool = True,
               on_step=None) -> dict:
  """Runs (or resumes, or finds finished) the warm start of `c.sft` in `out_dir`. Returns
  the summary; summary["params"] holds the trained parameters (on device). `stop` (an Event)
  ends it after the current step with a checkpoint; `on_step(step, metrics)` is called after
  each step."""
  from fr_jax import envs, sft
  from fr_jax.learner.learner import Learner
  from fr_jax.trajectory import TrajectoryError, validate
  t0 = time.time()
  os.makedirs(out_dir, exist_ok=True)
  data = c.sft.data
  if not data:  # generated once, then read back like any user's file
    data = os.path.join(out_dir, "sft_data.jsonl")
    if not os.path.exists(data):
      env = envs.make(c.env.name, **c.env.kwargs.to_dict())
      sft.write_jsonl(data, sft.demonstrations(env, c.sft.examples, seed=c.sft.seed,
                                               tool_fraction=c.sft.tool_fraction))
  convs = sft.read_jsonl(data)
  records = [sft.render(model.tokenizer, m, c.agent.template, f"sft:{i}")
             for i, m in enumerate(convs)]
  lc = learner_config(c)
  with lc.unlocked():
    lc.checkpoint.dir = os.path.join(out_dir, "checkpoints")
    lc.log.dir = out_dir
  learner = Learner(lc, model=model)
  for i, r in enumerate(records):
    try:
      validate(r, **learner.record_limits)
    except TrajectoryError as e:
      raise sft.SFTDataError(f"{data}: conversation {i + 1}: {e} (raise packing.row_len or "
                             "shorten it)") from None
  learner.restore()
  start = learner.version
  bar = None
  if progress and start < c.sft.steps:
    from tqdm import tqdm
    bar = tqdm(total=c.sft.steps, initial=start, desc="sft steps", unit="step",
               file=sys.stderr, dynamic_ncols=True)
  first = last = None
  try:
    for k in range(start, c.sft.steps):
      if stop is not None and stop.is_set():
        break
      idx = sft.batch_indices(len(records), c.sft.batch_size, k, c.sft.seed)
      m = learner.update([records[i] for i in idx], log_ids=False)
      first = m["loss"] if first is None else first
      last = m["loss"]
      learner.save()
      if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{m['tokens_per_s']:.0f}")
      if on_step is not None:
        on_step(learner.version, m)
    learner.save(force=True)
    done = learner.version >= c.sft.steps
    export = os.path.join(out_dir, "export")
    if done and _export_step(export) != learner.version:
      _export(learner, export)
    params = learner.snapshot_params()
  finally:
    if bar is not None:
      bar.close()
    learner.close()
  return dict(stage="sft", steps=learner.version, finished=done, examples=len(records),
              data=data, resumed_from=start, loss_first=first, loss_last=last,
              export=export if done else None, wall_s=round(time.time() - t0, 1),
              params=params)


EXPORT_STAMP = "fr_jax_export.json"  # in the export: the SFT step its weights are from


def _export_step(export: str) -> int | None:
  try:
    return int(json.loads(open(os.path.join(export, EXPORT_STAMP)).read())["step"])
  except (OSError, ValueError, KeyError, TypeError):
    return None


def _export(learner, export: str) -> None:
  """The HF export with its stamp, swapped in whole (`durable.write_dir`): a kill leaves the
  previous export or none, never one that looks complete and is not."""
  from fr_jax import durable

  def fill(d):
    learner.export_hf(d)
    (d / EXPORT_STAMP).write_text(json.dumps({"step": learner.version}))

  durable.clean_partial(os.path.dirname(export) or ".", prefix=f".{os.path.basename(export)}.")
  durable.write_dir(export, fill)


def main(argv):
  if len(argv) > 1:
    common.fail(f"unexpected arguments {argv[1:]}")
  from absl import flags, logging
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  c = common.load_config()
  if not c.run_dir:
    common.fail("--run_dir is required (checkpoints, metrics and the export go there)")
  if c.sft.steps < 1:
    common.fail("sft.steps must be >= 1 (--config.sft.steps=N)")
  model = common.load_model(c)
  if model.tokenizer is None:
    common.fail(f"model {c.model.name!r} has no tokenizer; SFT renders text")
  from fr_jax.sft import SFTDataError
  stop = common.stop_on_interrupt()
  try:
    summary = warm_start(c, model, c.run_dir, stop=stop)
  except (SFTDataError, FileNotFoundError) as e:
    common.fail(str(e))
  summary.pop("params")
  json.dump(summary, open(os.path.join(c.run_dir, "sft_summary.json"), "w"), indent=1)
  common.print_json(summary)


if __name__ == "__main__":
  common.run(main)
