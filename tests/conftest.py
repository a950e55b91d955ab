"""Test setup: 8 host CPU devices, forced before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402


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
