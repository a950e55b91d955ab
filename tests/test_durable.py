"""Durable files (`fr_jax/durable.py`) and the writers that use it: a restart, a kill or a full
disk leaves the old whole thing or the new whole thing, and pruning never removes the version
just published."""

import errno
import os

import jax
import numpy as np
import pytest

from fr_jax import durable
from fr_jax.models import hf_io, registry
from tests import helpers


def _full_disk_after(n):
  """A writer stand-in for a disk that fills after `n` successful writes."""
  calls = {"n": 0}

  def hook(real):
    def write(*a, **kw):
      calls["n"] += 1
      if calls["n"] > n:
        raise OSError(errno.ENOSPC, "No space left on device")
      return real(*a, **kw)
    return write
  return hook


def test_prune_keeps_current_and_the_newest_served_whatever_the_numbers(tmp_path):
  for v in (3, 10, 11):
    durable.version_dir(tmp_path, v).mkdir()
  # A learner restarted at 5: 5 is new, 11 may still be what the fleet serves.
  durable.version_dir(tmp_path, 5).mkdir()
  assert durable.prune(tmp_path, current=5, keep=2) == [3, 10]
  assert durable.versions_on_disk(tmp_path) == [5, 11]
  # Its next publication: 6, and the previous one (5), which servers may still be loading.
  durable.version_dir(tmp_path, 6).mkdir()
  assert durable.prune(tmp_path, current=6, keep=2, also=5) == [11]
  assert durable.versions_on_disk(tmp_path) == [5, 6]


def test_a_restarted_learner_keeps_its_own_export(tmp_path):
  """Publish v10 and v11, restart from the checkpoint at v5, publish v5: v5 must be there
  (the old pruning kept the two highest numbers and removed the export just written)."""
  from fr_jax.learner.learner import Learner
  from fr_jax.learner.publish import Publisher
  learner = Learner(helpers.tiny_config())
  pub = Publisher(learner, hf_export_dir=str(tmp_path))
  for v in (10, 11):
    pub.publish(v)
  restarted = Publisher(learner, hf_export_dir=str(tmp_path))
  restarted.publish(5)
  assert restarted.hf_dir == str(durable.version_dir(tmp_path, 5))
  assert durable.versions_on_disk(tmp_path) == [5, 11]
  cfg, params = hf_io.load_hf(restarted.hf_dir)
  for a, b in zip(jax.tree.leaves(learner.state.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  restarted.publish(6)
  assert durable.versions_on_disk(tmp_path) == [5, 6]


def test_save_hf_on_a_full_disk_leaves_the_old_weights_whole(tmp_path, monkeypatch):
  old = registry.load("tiny-qwen2", seed=1)
  new = registry.load("tiny-qwen2", seed=2)
  hf_io.save_hf(tmp_path, old.params, old.config, max_shard_bytes=40_000)
  shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
  assert len(shards) > 2
  monkeypatch.setattr(hf_io, "save_file", _full_disk_after(1)(hf_io.save_file))
  with pytest.raises(OSError, match="No space"):
    hf_io.save_hf(tmp_path, new.params, new.config, max_shard_bytes=40_000)
  assert sorted(p.name for p in tmp_path.glob("model-*.safetensors")) == shards
  assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
  _, params = hf_io.load_hf(tmp_path)
  for a, b in zip(jax.tree.leaves(old.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


def test_save_hf_with_fewer_shards_removes_the_stale_ones(tmp_path):
  m = registry.load("tiny-qwen2", seed=1)
  hf_io.save_hf(tmp_path, m.params, m.config, max_shard_bytes=40_000)
  hf_io.save_hf(tmp_path, m.params, m.config)
  assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_write_dir_is_old_or_new_never_a_mix(tmp_path):
  final = tmp_path / "export"
  durable.write_dir(final, lambda d: [(d / n).write_text("old") for n in "ab"])

  def dies_midway(d):
    (d / "a").write_text("new")
    raise OSError(errno.ENOSPC, "No space left on device")

  with pytest.raises(OSError):
    durable.write_dir(final, dies_midway)
  assert {p.name: p.read_text() for p in final.iterdir()} == {"a": "old", "b": "old"}
  assert sorted(os.listdir(tmp_path)) == ["export"]  # no temporaries left
  durable.write_dir(final, lambda d: (d / "c").write_text("new"))
  assert {p.name: p.read_text() for p in final.iterdir()} == {"c": "new"}
  assert oct(final.stat().st_mode & 0o777) == oct(0o755)


def test_write_files_leaves_every_old_file_when_one_fails(tmp_path):
  durable.write_files(tmp_path, {"x": b"1", "y": "2"})

  def fails(p):
    raise OSError(errno.ENOSPC, "No space left on device")

  with pytest.raises(OSError):
    durable.write_files(tmp_path, {"x": b"new", "y": fails})
  assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"x": "1", "y": "2"}
  durable.write_file(tmp_path / "x", b"3")
  assert (tmp_path / "x").read_bytes() == b"3"
