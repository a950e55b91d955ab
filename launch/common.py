"""Shared launch plumbing: the --config flag, one-line failures, logging."""

from __future__ import annotations

import json
import sys

from absl import flags, logging
from ml_collections import config_flags

CONFIG = config_flags.DEFINE_config_file(
    "config", "experiments/configs/cpu_default.py",
    "experiment config file (ml_collections get_config()); override any field with "
    "--config.x=y")
flags.DEFINE_string("run_dir", None, "overrides config.run_dir")


class UsageError(Exception):
  """A problem with the flags or config: printed as one line, exit status 2."""


def load_config():
  """The validated config with --run_dir applied; exits with one line on a config error."""
  from fr_jax import config as rcfg
  c = CONFIG.value
  if c is None:
    fail("--config is required")
  if flags.FLAGS.run_dir is not None:
    c.run_dir = flags.FLAGS.run_dir
  try:
    return rcfg.resolve_dirs(rcfg.validate(c))
  except rcfg.ConfigError as e:
    fail(f"config error: {e}")


def load_model(c):
  from fr_jax import system
  from fr_jax.models import registry
  try:
    return system.load_model(c)
  except (registry.ModelNotFound, registry.CheckpointError, FileNotFoundError) as e:
    fail(f"model {c.model.name!r}: {e}")


def run(main):
  """app.run, with config-override errors (an unknown --config.field, a bad value) printed as
  one line instead of a traceback."""
  from absl import app
  try:
    app.run(main)
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    if "config" not in " ".join(sys.argv):
      raise
    fail(f"bad --config override: {e}")


def fail(message: str):
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(2)


def print_json(obj):
  print(json.dumps(obj, default=str), flush=True)


def quiet_logs():
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().python_handler.stream = sys.stderr
