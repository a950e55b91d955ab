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

import json
import os

from launch import common


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
  from fr_jax.sft import SFTDataError, warm_start
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
