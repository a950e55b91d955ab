"""The worker's side of the escape suite (fr_jax.envs.escapes): what the host holds that model
code must not reach (a token, a learner port, an abstract Unix socket, a directory anyone may
write), and what the host can observe afterwards (leftover processes, SysV segments, /dev/shm).
Stdlib only."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class Host:
  """What the worker's side holds that the code must not reach."""

  def __init__(self):
    self.token = secrets.token_hex(16)
    os.environ["FR_JAX_TOKEN"] = self.token  # as launch.worker's environment would hold it
    self.dir = tempfile.mkdtemp(prefix="fr_escape_")
    os.chmod(self.dir, 0o777)  # writable by anyone who can reach it
    self.tcp = socket.socket()
    self.tcp.bind(("127.0.0.1", 0))
    self.tcp.listen(8)
    self.port = self.tcp.getsockname()[1]
    self.abstract = f"fr_jax_escape_{secrets.token_hex(4)}"
    self.unix = socket.socket(socket.AF_UNIX)
    self.unix.bind("\0" + self.abstract)
    self.unix.listen(8)
    self.connections: list[str] = []
    for s, name in ((self.tcp, "tcp"), (self.unix, "abstract unix")):
      threading.Thread(target=self._accept, args=(s, name), daemon=True).start()

  def _accept(self, s, name):
    while True:
      try:
        c, _ = s.accept()
      except OSError:
        return
      self.connections.append(name)
      c.close()

  def values(self) -> dict:
    return dict(port=self.port, abstract=self.abstract, token=self.token, host_dir=self.dir,
                repo=str(REPO), probe_file=str(Path(__file__).resolve()),
                worker_pid=os.getpid())

  def close(self):
    self.tcp.close()
    self.unix.close()
    os.environ.pop("FR_JAX_TOKEN", None)
    shutil.rmtree(self.dir, ignore_errors=True)


def _in_other_pid_ns() -> set[int]:
  """Processes of the sandbox's users in another PID namespace than ours."""
  mine = os.readlink("/proc/self/ns/pid")
  out = set()
  for p in os.listdir("/proc"):
    if p.isdigit():
      try:
        if os.readlink(f"/proc/{p}/ns/pid") != mine and _uid(p) in (65534, os.geteuid()):
          out.add(int(p))
      except OSError:
        continue
  return out


def _sandbox_leftovers(before: set, timeout: float = 3.0) -> list[int]:
  """A call's processes still alive after it returned (and a grace period)."""
  t_end = time.monotonic() + timeout
  while True:
    left = sorted(_in_other_pid_ns() - before)
    if not left or time.monotonic() > t_end:
      return left
    time.sleep(0.05)


def _uid(pid) -> int | None:
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("Uid:"):
          return int(line.split()[1])
  except OSError:
    return None
  return None


def _sysv_segments() -> set[str]:
  with open("/proc/sysvipc/shm") as f:
    return {ln.split()[1] for ln in f.readlines()[1:] if ln.split()}


def _host_shm() -> set[str]:
  return set(os.listdir("/dev/shm"))
