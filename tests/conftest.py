"""Test setup: 8 host CPU devices, forced before JAX is imported anywhere."""

import os
import shutil
import tempfile
import time

from tests import XLA_TEST_FLAGS

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {XLA_TEST_FLAGS}"
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache (fr_jax.compile_cache) for the session, used by every
# launch the tests start: a program that several launches compile compiles once. Programs
# that compile in 0.1 s or more are written. A multi-process CPU learner turns it off. Each
# session starts a fresh one in .pytest_cache/xla/ (ignored by git; older sessions' are
# removed): an 8-device CPU mesh program loaded from a cache a previous process wrote can
# deadlock in its collectives and abort (devices join different all-gathers), which a rerun
# with a warm cache did in test_moe_learner and test_multihost. Set JAX_COMPILATION_CACHE_DIR
# to choose the folder.
# The two test processes themselves (8 forced host devices) do not read or write it (below):
# one of them, reading a program back, died in XLA's deserialization (SIGSEGV in
# compilation_cache.get_executable_and_time, in test_action_head, in CI and in a clean-clone
# run of the same commit), which took its xdist worker down and left the session waiting for
# it until CI's limit.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the session's first process: make it
  _xla = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      ".pytest_cache", "xla")
  os.makedirs(_xla, exist_ok=True)
  for _old in os.listdir(_xla):  # sessions of more than 6 hours ago, and the old shared cache
    _path = os.path.join(_xla, _old)
    if not _old.startswith("session-") or time.time() - os.path.getmtime(_path) > 6 * 3600:
      if os.path.isdir(_path):
        shutil.rmtree(_path, ignore_errors=True)
      else:
        os.remove(_path)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="session-", dir=_xla)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

import jax  # must come after XLA_FLAGS
import pytest

# Off for this process. JAX decides once, at a process's first compile, whether it uses the
# cache: compiling one program now keeps it off even where a test runs a launch's main in
# this process (launch.common.setup calls compile_cache.configure).
jax.config.update("jax_enable_compilation_cache", False)
jax.jit(lambda x: x + 1)(0).block_until_ready()


def pytest_sessionstart(session):
  n = jax.device_count()
  if n != 8:
    raise pytest.UsageError(
        f"expected 8 forced CPU devices, got {n}: JAX was imported before tests/conftest.py")


@pytest.fixture(scope="module")
def tiny_model():
  """tiny-chat: a tiny random Llama with a byte-level tokenizer (vocabulary 320)."""
  from fr_jax.models import registry
  return registry.load("tiny-chat")


@pytest.fixture(scope="session")
def smol_tokenizer():
  """SmolLM2-135M-Instruct's tokenizer, from the GGUF's metadata: no weights are read."""
  from fr_jax.models import registry
  return registry.describe("smollm2-135m-instruct").tokenizer


# The longest files first (totals measured on a clean clone, longest first): `make test` runs
# files whole on its xdist workers, handed out in collection order, so a long file collected
# last would run alone at the end. Every worker sorts the same way, as xdist requires.
LONGEST_FIRST = ("test_chaos_fleet.py", "test_system.py", "test_learner.py", "test_vllm.py",
                 "test_chaos.py",
                 "test_gguf_smollm2.py", "test_multihost.py", "test_attention.py",
                 "test_learning.py", "test_gateway.py", "test_notebook.py",
                 "test_model_internal.py", "test_moe_learner.py", "test_engine.py",
                 "test_moe_rollout.py",
                 "test_exactly_once.py", "test_device_check.py", "test_agent.py",
                 "test_transport.py", "test_replication.py", "test_sandbox.py", "test_export.py",
                 "test_weight_relay.py", "test_sglang_client.py", "test_sft.py")


def pytest_collection_modifyitems(session, config, items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda it: rank.get(it.path.name, len(rank)))  # stable: file order kept
