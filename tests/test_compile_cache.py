"""The persistent compilation cache's settings (fr_jax.compile_cache): which directory each
names, and that a process configured with one writes its programs there, privately, and
with "off" writes none."""

import os
import subprocess
import sys
from pathlib import Path

from fr_jax.compile_cache import resolve

REPO = Path(__file__).resolve().parents[1]


def test_settings_name_their_directory():
  assert resolve("auto", {"HOME": "/h"}) == "/h/.cache/fr_jax/xla"
  assert resolve("auto", {"HOME": "/h", "XDG_CACHE_HOME": "/x"}) == "/x/fr_jax/xla"
  assert resolve("auto", {"HOME": "/h", "JAX_COMPILATION_CACHE_DIR": "/j"}) == "/j"
  assert resolve(" /some/dir ", {}) == "/some/dir"
  assert resolve("rel/dir", {}) == os.path.join(os.getcwd(), "rel", "dir")
  for off in ("off", "OFF", "none", "", None):
    assert resolve(off, {"JAX_COMPILATION_CACHE_DIR": "/j"}) is None


_CHILD = """
import sys
import jax, jax.numpy as jnp
from fr_jax import compile_cache
print(compile_cache.configure(sys.argv[1]), compile_cache.off_for_cpu_mesh(int(sys.argv[2])))
jax.jit(lambda x: jnp.cumsum(x) * 2)(jnp.arange(5.0)).block_until_ready()
"""


def test_a_configured_process_writes_its_programs_there_and_off_writes_none(tmp_path):
  """... and a launch whose learner mesh spans 8 CPU devices writes none either: loaded from
  the cache, such an update deadlocked in its all-gathers (`compile_cache.off_for_cpu_mesh`;
  the 8 devices are the suite's forced host devices)."""
  env = dict(os.environ, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "env_dir"))
  got = {}
  mine, mesh = tmp_path / "mine" / "xla", tmp_path / "mesh" / "xla"
  for setting, devices in ((str(mine), 1), ("off", 1), (str(mesh), 8)):
    r = subprocess.run([sys.executable, "-c", _CHILD, setting, str(devices)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got[setting] = r.stdout.strip().splitlines()[-1]
  assert got == {str(mine): f"{mine} False", "off": "None False", str(mesh): f"{mesh} True"}
  assert any(p.name.startswith("jit_") for p in mine.iterdir())
  assert not any(mesh.iterdir())  # the CPU mesh's process wrote nothing
  assert (mine.stat().st_mode & 0o777) == 0o700  # the cache is code: the user's alone
  assert not (tmp_path / "env_dir").exists()  # "off" wrote nowhere, not even JAX's default


def test_the_test_processes_keep_the_cache_off_even_after_a_launch_configures_it(tmp_path):
  """tests/conftest.py keeps the suite's own processes off the cache (one died deserializing
  a program from it): a launch's main run in-process (launch.common.setup configures the
  cache) must not turn it back on for them."""
  import jax
  import jax.numpy as jnp

  from fr_jax import compile_cache
  before = jax.config.jax_compilation_cache_dir
  try:
    assert compile_cache.configure(str(tmp_path / "xla")) == str(tmp_path / "xla")
    jax.jit(lambda x: jnp.cumsum(x) * 7 + 0.5)(jnp.arange(9.0)).block_until_ready()
  finally:
    jax.config.update("jax_enable_compilation_cache", False)
    jax.config.update("jax_compilation_cache_dir", before)
  assert list((tmp_path / "xla").iterdir()) == []
