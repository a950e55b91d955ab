"""Durable files: the one place that writes a file or a directory so that a crash, a kill or
a full disk leaves the old whole thing or the new whole thing, never a torn one.

* `write_file(path, data)`: a temporary file beside it, fsynced, renamed over, the directory
  fsynced. `data` is bytes, text, or a callable that writes the temporary path itself.
* `write_files(dir, {name: data})`: several files in one directory, all written as
  temporaries first; only when every one is whole are they renamed into place (renames take
  no space), so a full disk part-way leaves every old file untouched. Files in `remove` go
  after the renames (a model's stale shards).
* `write_dir(final, fill)`: a whole directory. `fill(tmp)` writes into a hidden temporary
  directory beside `final`; every file and the directory are fsynced, an old `final` is moved
  aside, the new one renamed in, the parent fsynced, the old one removed. Readers see the old
  directory or the new one, never a mix; a kill leaves a hidden `.NAME.*` directory that
  `clean_partial` removes.
* Versioned directories `root/vNNNNNNNN` (weight publications, relay copies):
  `version_dir`, `versions_on_disk`, `clean_partial`, and `prune`, which always keeps the
  version just written and the newest one that may still be served.

Standard library only: every layer may use it (admission log, relay, publication, HF and
GGUF export, SFT).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

VERSION_DIR = re.compile(r"^v(\d{8,})$")
Data = bytes | str | Callable[[Path], object]


def fsync_path(path) -> None:
  """fsyncs a file or a directory (a directory's fsync makes renames in it durable)."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _write_tmp(tmp: Path, data: Data) -> None:
  if callable(data):
    data(tmp)
  else:
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
      view = memoryview(raw)
      while view:
        view = view[os.write(fd, view):]
    finally:
      os.close(fd)
  fsync_path(tmp)


def _tmp_name(path: Path) -> Path:
  return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def write_file(path, data: Data) -> Path:
  """Writes `path` whole or not at all (see the module doc); returns it."""
  return write_files(Path(path).parent, {Path(path).name: data}) / Path(path).name


def write_files(directory, files: dict[str, Data], *, remove: Iterable[str] = ()) -> Path:
  """Writes every file of `files` into `directory` (created if missing), each whole: all as
  temporaries first, then renamed; on any error before the renames nothing old is touched
  and the temporaries are removed. Then removes the names in `remove` that were not written."""
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  done: list[tuple[Path, Path]] = []
  try:
    for name, data in files.items():
      tmp = _tmp_name(directory / name)
      done.append((tmp, directory / name))
      _write_tmp(tmp, data)
  except BaseException:
    for tmp, _ in done:
      tmp.unlink(missing_ok=True)
    raise
  for tmp, final in done:
    os.replace(tmp, final)
  for name in set(remove) - set(files):
    (directory / name).unlink(missing_ok=True)
  fsync_path(directory)
  return directory


def write_dir(final, fill: Callable[[Path], object]) -> Path:
  """Makes `final` a directory whose contents `fill(tmp)` wrote, atomically (module doc)."""
  final = Path(final)
  root = final.parent
  root.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=root))
  old = None
  try:
    fill(tmp)
    for f in tmp.rglob("*"):
      if f.is_file():
        fsync_path(f)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a server may run as another user
    fsync_path(tmp)
    if final.exists():
      old = root / f".{final.name}.replaced-{os.getpid()}"
      shutil.rmtree(old, ignore_errors=True)
      os.rename(final, old)
    os.rename(tmp, final)
    fsync_path(root)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    if old is not None and not final.exists():
      os.rename(old, final)  # put the old one back
    raise
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)
  return final


# --- versioned directories ---
def version_dir(root, version: int) -> Path:
  return Path(root) / f"v{version:08d}"


def versions_on_disk(root) -> list[int]:
  """Whole versions under `root`, oldest first (hidden partial directories are not)."""
  root = Path(root)
  if not root.is_dir():
    return []
  return sorted(int(m.group(1)) for p in root.iterdir()
                if p.is_dir() and (m := VERSION_DIR.match(p.name)))


def write_version(root, version: int, fill: Callable[[Path], object]) -> Path:
  """`write_dir` of `root/vNNNNNNNN`. A version already there (a learner that restarted from
  an older checkpoint publishes its numbers again) is replaced whole."""
  return write_dir(version_dir(root, version), fill)


def clean_partial(root, prefix: str = ".v") -> list[str]:
  """Removes what an interrupted `write_dir` left under `root` (hidden directories and
  temporaries named `prefix...`; the default: of versions); returns their names. Call at
  start, before anything writes to `root`."""
  root = Path(root)
  gone = []
  if root.is_dir():
    for p in root.iterdir():
      if p.name.startswith(prefix):
        if p.is_dir():
          shutil.rmtree(p, ignore_errors=True)
        else:
          p.unlink(missing_ok=True)
        gone.append(p.name)
  return gone


def prune(root, current: int, keep: int = 2, also: int | None = None) -> list[int]:
  """Keeps `current` (just written), `also` (the one that may still be served or loading:
  the previous publication), and then the newest others up to `keep` in all; removes the
  rest and returns their numbers. Never removes `current`, whatever the numbers on disk (a
  restarted learner's `current` is below versions it wrote before)."""
  on_disk = versions_on_disk(root)
  kept = {current} | ({also} if also is not None and also in on_disk else set())
  for v in reversed(on_disk):
    if len(kept) >= keep:
      break
    kept.add(v)
  drop = [v for v in on_disk if v not in kept]
  for v in drop:
    shutil.rmtree(version_dir(root, v), ignore_errors=True)
  return drop
