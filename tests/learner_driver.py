"""A learner process for the restart test: trains a tiny model on the synthetic grain stream,
saving a checkpoint (with the iterator state) every update, and resumes from the latest one.

  python -m tests.learner_driver --workdir=DIR --until=N [--seed=0]
"""

import sys

from absl import app, flags

flags.DEFINE_string("workdir", None, "checkpoints and metrics")
flags.DEFINE_integer("until", 4, "train until this policy version")
flags.DEFINE_integer("seed", 0, "synthetic stream seed")
F = flags.FLAGS


def config(workdir, seed=0):
  from fr_jax.learner import config as lcfg
  c = lcfg.default_config()
  c.model.name = "tiny-qwen2"
  c.model.seed = seed
  c.batch_size = 6
  c.packing.row_len = 128
  c.packing.row_buckets = (2, 4, 6)
  c.objective.delta = float("inf")
  c.optim.lr = 3e-3
  c.optim.total_steps = 20
  c.checkpoint.dir = f"{workdir}/ckpt"
  c.checkpoint.every = 1
  c.checkpoint.keep = 2
  c.log.dir = workdir
  c.log.peak_flops = 1e11
  return c


def train(workdir: str, until: int, seed: int = 0) -> int:
  """Restores the latest checkpoint in `workdir` (with the data stream's position), trains
  until version `until` with a checkpoint after every update; returns the version."""
  from fr_jax.learner import synthetic
  from fr_jax.learner.learner import Learner
  learner = Learner(config(workdir, seed))
  it = iter(synthetic.dataset(seed=seed, vocab_size=256, max_len=100).to_iter_dataset())
  meta = learner.restore()
  if meta is not None:
    it.set_state(meta["data_state"])
  while learner.version < until:
    learner.update(synthetic.take(it, learner.config.batch_size))
    learner.save(data_state=it.get_state())
  learner.close()
  return learner.version


def main(argv):
  del argv
  print(f"version {train(F.workdir, F.until, F.seed)}", file=sys.stderr)


if __name__ == "__main__":
  flags.mark_flag_as_required("workdir")
  app.run(main)
