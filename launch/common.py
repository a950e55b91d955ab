"""Shared launch plumbing: the --config flag, one-line failures, logging.

Only errors born in flag or config parsing (a `UsageError`) become one line (`error: ...`,
exit status 2); anything else raised while a run runs keeps its traceback."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

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
  """The validated config with --run_dir applied; exits with one line on a config error.
  Points JAX at the config's compilation cache (`fr_jax.compile_cache`) before anything
  compiles."""
  from fr_jax import config as rcfg
  try:
    c = CONFIG.value
    if c is not None:
      c.keys()  # a config file that failed to load raises here
  except OSError as e:  # how ml_collections reports a config file it could not load
    fail("--config: " + " ".join(line.strip() for line in str(e).splitlines()))
  if c is None:
    fail("--config is required")
  if flags.FLAGS.run_dir is not None:
    c.run_dir = flags.FLAGS.run_dir
  try:
    c = rcfg.validate(c)  # directories resolved from run_dir too
  except rcfg.ConfigError as e:
    fail(f"config error: {e}")
  from fr_jax import compile_cache
  compile_cache.configure(c.compile_cache_dir)
  return c


def require_tool_isolation(c) -> str:
  """The Python tool's isolation for this run (see fr_jax.envs.sandbox); one line and exit
  status 2 where the machine cannot isolate it and the config does not allow limits-only."""
  from fr_jax import system
  from fr_jax.envs import sandbox
  mode = system.tool_isolation(c)
  if mode == "unavailable":
    try:
      sandbox.require_isolation()
    except sandbox.SandboxUnavailable as e:
      fail(str(e))
  return mode


def secret(flag_value: str, env: str) -> str:
  """A credential: the flag's value if given, else $`env`. Flags that take one default to ""
  (their help names the variable), so `--help` never prints a secret."""
  return flag_value or os.environ.get(env, "")


def check_client_tls(flag_values) -> None:
  """A client's --tls_ca/--tls_cert/--tls_key (workers, weight relays): one line and exit
  status 2 for a half pair or an unreadable file."""
  ca, cert, key = (flag_values[f].value for f in ("tls_ca", "tls_cert", "tls_key"))
  if bool(cert) != bool(key) or (cert and not ca):
    fail("--tls_cert and --tls_key go together, with --tls_ca")
  for flag, path in (("tls_ca", ca), ("tls_cert", cert), ("tls_key", key)):
    if path and not os.access(path, os.R_OK):
      fail(f"--{flag} {path}: not a readable file")


def stop_on_interrupt():
  """An Event that the first Ctrl-C sets (the run stops after its current step, with a
  checkpoint); a second Ctrl-C aborts."""
  import signal
  import threading
  stop = threading.Event()

  def interrupt(*_):
    if stop.is_set():
      raise KeyboardInterrupt
    print("\nstopping after this step (a checkpoint will be saved); Ctrl-C again to abort",
          file=sys.stderr, flush=True)
    stop.set()

  signal.signal(signal.SIGINT, interrupt)
  return stop


def load_model(c):
  """The config's model; first (before anything compiles), the compilation cache is turned
  off for a learner mesh of several CPU devices (`compile_cache.off_for_cpu_mesh`)."""
  from fr_jax import compile_cache
  from fr_jax.learner.config import mesh_size
  from fr_jax.models import registry
  compile_cache.off_for_cpu_mesh(mesh_size(c))
  try:
    return registry.load_configured(c.model)
  except (registry.ModelNotFound, registry.CheckpointError, FileNotFoundError) as e:
    fail(f"model {c.model.name!r}: {e}")


def find_checkpoint(path: str, step: int | None = None) -> tuple[Path, int]:
  """(checkpoints directory, step) for --checkpoint (a run directory written by launch.train,
  or its checkpoints/) and --step (default: the newest committed); launch.evaluate and
  launch.export both resolve them here."""
  run = Path(path).absolute()
  if not run.is_dir():
    raise UsageError(f"--checkpoint={path}: no such directory; give a run directory written "
                     "by launch.train or its checkpoints/ directory")
  from fr_jax.learner.checkpoint import committed_steps
  for d in (run / "checkpoints", run):
    if steps := committed_steps(d):
      if step is None:
        return d, steps[-1]
      if step not in steps:
        raise UsageError(f"--step={step}: {d} has committed steps {steps}")
      return d, step
  hint = ""
  if committed_steps(run / "sft" / "checkpoints"):
    hint = f"; the warm start's checkpoints are in {run / 'sft'}: pass --checkpoint={run / 'sft'}"
  raise UsageError(f"--checkpoint={path}: no committed checkpoint in {run / 'checkpoints'} or "
                   f"{run}{hint}")


def read_checkpoint(step_dir: Path):
  """(params as host NumPy arrays, the step's meta record) of a step `find_checkpoint` found:
  `checkpoint.restore_params`, the parameters alone (no optimizer state, no Learner)."""
  from fr_jax.learner.checkpoint import restore_params
  try:
    return restore_params(step_dir)
  except ValueError as e:
    raise UsageError(str(e)) from None


def check_params(params, shapes: dict, model: str, hint: str = ""):
  """UsageError unless a checkpoint's `params` have exactly `shapes` ({path: shape}), those
  of `model`."""
  from fr_jax.transport.codec import flatten
  got = {k: tuple(a.shape) for k, a in flatten(params).items()}
  for k in sorted(set(shapes) | set(got)):
    if shapes.get(k) != got.get(k):
      raise UsageError(f"checkpoint params/{k} has shape {got.get(k)}, but model {model!r} "
                       f"implies {shapes.get(k)}: this checkpoint is not that model's{hint}")


def parse_flags(argv):
  """absl's flag parsing, with any error in it (an unknown flag, a bad value, an unknown
  --config.field) printed as one line with exit status 2."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(str(e))
  except Exception as e:  # raised while parsing a --config override
    fail(f"bad --config override: {type(e).__name__}: {e}")


def run(main):
  """app.run with one-line flag and config errors, and a `UsageError` from `main`; any other
  failure inside `main` keeps its traceback."""
  from absl import app

  def main_(argv):
    try:
      return main(argv)
    except UsageError as e:
      fail(str(e))

  app.run(main_, flags_parser=parse_flags)


def fail(message: str):
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(2)


def print_json(obj):
  print(json.dumps(obj, default=str), flush=True)


def quiet_logs():
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().python_handler.stream = sys.stderr


def reachable_at(bind: str, port: int) -> str:
  """The host:port others reach a server bound to `bind` at: its host, or this machine's
  name for a wildcard bind, and the port it got."""
  import socket
  host = bind.rsplit(":", 1)[0].strip("[]")
  return f"{socket.getfqdn() if host in ('', '0.0.0.0', '::') else host}:{port}"
