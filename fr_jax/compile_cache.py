"""The persistent XLA compilation cache: compiled programs kept on disk between processes.

Every process of a run compiles its programs anew (the learner's update per bucket, the
engine's prefill and decode steps, the evaluation's); with the cache a second run, a restarted
worker or a second `make demo` loads them from disk instead. `configure` points JAX at one
directory:

  "auto"  (the default, `config.compile_cache_dir`): JAX_COMPILATION_CACHE_DIR if set, else
          $XDG_CACHE_HOME/fr_jax/xla (~/.cache/fr_jax/xla)
  a path  that directory (created, private to the user)
  "off"   or "": no persistent cache

The directory is trusted code: whoever can write to it can run code in the processes that
read it (JAX's warning), so it is created with mode 0700 and never shared between users.
Entries are keyed by the program, the jaxlib version and the compile options, so a stale one
is never loaded, only left unused; the directory is capped (`max_bytes`, least recently used
entries go first).

One case cannot use it, measured (tests/test_multihost.py): on the CPU backend a program
whose collectives cross processes (gloo) does not survive the cache. Loaded from disk, it
issues its cross-process collectives differently from its peer's program, freshly compiled or
loaded alike, and gloo aborts ("Received data size doesn't match expected size"). JAX writes
entries from process 0 only, so the first warm run of a multi-process CPU learner aborts.
`multihost.initialize` therefore turns the cache off in such a process (`off_for_processes`).

The same holds within one process for a learner on a mesh of several CPU devices (forced
host devices): a second `launch.train --config.mesh.fsdp=8` loaded its update from the cache
and aborted, its 8 device threads waiting in different all-gathers (XLA's rendezvous
timeout). The launches therefore turn the cache off for a CPU mesh (`off_for_cpu_mesh`).
"""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger("fr_jax.compile_cache")

OFF = ("", "off", "none")
MAX_BYTES = 2 * 2**30  # unless JAX_COMPILATION_CACHE_MAX_SIZE says otherwise
# Programs that compile faster than JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS (JAX's default:
# 1 s) are not written: on the CPU backend most small programs take 0.05-0.3 s.


def default_dir(environ) -> str:
  """$XDG_CACHE_HOME/fr_jax/xla, or ~/.cache/fr_jax/xla, in `environ`."""
  home = environ.get("HOME") or os.path.expanduser("~")
  base = environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
  return os.path.join(base, "fr_jax", "xla")


def resolve(setting: str, environ=None) -> str | None:
  """The directory a `compile_cache_dir` setting means (see the module docstring), or None
  for no cache."""
  environ = os.environ if environ is None else environ
  setting = (setting or "").strip()
  if setting.lower() in OFF:
    return None
  if setting == "auto":
    return environ.get("JAX_COMPILATION_CACHE_DIR") or default_dir(environ)
  return os.path.abspath(os.path.expanduser(setting))


def configure(setting: str = "auto") -> str | None:
  """Points this process's JAX at the cache `setting` names, before anything compiles.
  Returns the directory, or None when the cache is off (also when the directory cannot be
  created: a warning, and the run goes on without it)."""
  path = resolve(setting)
  if path is not None:
    try:
      os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
      log.warning("compilation cache %s: %s; compiling without it", path, e)
      path = None
  jax.config.update("jax_enable_compilation_cache", path is not None)
  if path is None:
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  return path


def off_for_cpu_mesh(mesh_devices: int) -> bool:
  """Before anything compiles: turns the cache off where the learner's mesh spans several
  CPU devices (see the module docstring). Returns whether it did."""
  if mesh_devices <= 1 or jax.default_backend() != "cpu":
    return False
  if jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir:
    log.info("compilation cache off: a learner on %d CPU devices cannot load its programs "
             "from it (fr_jax.compile_cache)", mesh_devices)
  jax.config.update("jax_enable_compilation_cache", False)
  return True


def off_for_processes() -> bool:
  """After `jax.distributed.initialize`: turns the cache off where this process's programs
  have cross-process CPU collectives (see the module docstring). Returns whether it did."""
  if jax.process_count() <= 1 or jax.default_backend() != "cpu":
    return False
  if jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir:
    log.info("compilation cache off: a multi-process CPU learner's programs cannot be "
             "loaded from it (fr_jax.compile_cache)")
  jax.config.update("jax_enable_compilation_cache", False)
  return True
