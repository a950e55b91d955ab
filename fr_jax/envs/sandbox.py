"""A sandboxed Python tool: each call runs model-written code in a separate, contained process.

Containment, from outside in:
* Linux namespaces (`unshare`, where the machine allows it): a new network namespace (no
  interfaces up: no network), a new PID namespace (the worker is invisible and cannot be
  signalled; everything dies with the namespace) and a new mount namespace in which every
  top-level directory but the system ones (/usr, /lib*, /bin, /sbin, /etc, /dev, /proc, /sys)
  is covered by an empty tmpfs (the interpreter's own prefix is bound back), and /tmp is a
  fresh size-limited scratch filesystem: the code cannot read the repository, the home
  directory or anything mounted elsewhere, nor leave files behind.
* A privileged supervisor (PID 1 of the namespace, which the code cannot signal) reports how
  the code ended on a status pipe and takes any leftover process with it.
* An unprivileged user (nobody) and resource limits: CPU seconds, address space, process
  count, file size, open files, no core dumps.
* The interpreter's isolated mode (`python -I -S`: no site-packages, no PYTHON* variables), an
  empty temporary working directory and a minimal environment.
* The caller (`run_python`) enforces the wall-clock limit and the output cap, kills the whole
  process group on overrun, and never raises for anything the code does: the model always
  gets a result, truncated and clearly marked when something went wrong.

Where namespaces are unavailable (not root, no `unshare`), the call still runs with the limits,
the unprivileged user when possible, the isolated interpreter and the empty directory, and
`ToolResult.isolation` says "limits-only".
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

_ENTRY = Path(__file__).with_name("_sandbox_entry.py")
_PROJECT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Limits:
  wall_seconds: float = 10.0
  cpu_seconds: int = 5
  memory_bytes: int = 512 * 2**20  # address space
  max_processes: int = 16
  max_output_bytes: int = 16 * 1024  # what the model sees (stdout + stderr)
  max_file_bytes: int = 8 * 2**20  # any single file the code writes
  tmpfs_bytes: int = 32 * 2**20  # the scratch filesystem


@dataclasses.dataclass
class ToolResult:
  ok: bool  # exited 0 within limits
  output: str  # what the model sees: output, marked if truncated or failed
  exit_code: Optional[int]
  error: Optional[str]  # timeout | output_limit | nonzero_exit | killed | sandbox_error
  seconds: float
  isolation: str  # "namespaces" | "limits-only"


def _namespaces_available() -> bool:
  if os.geteuid() != 0 or shutil.which("unshare") is None:
    return False
  try:
    r = subprocess.run(["unshare", "--net", "--mount", "--pid", "--fork", "true"],
                       capture_output=True, timeout=10)
    return r.returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


_NS: Optional[bool] = None


def namespaces_available() -> bool:
  global _NS
  if _NS is None:
    _NS = _namespaces_available()
  return _NS


# Top-level directories the code may see: the system, read-only to the unprivileged user.
_VISIBLE = {"usr", "lib", "lib32", "lib64", "libx32", "bin", "sbin", "etc", "dev", "proc",
            "sys", "tmp"}


def _hidden_paths() -> list[str]:
  """Everything else at the top level, and the project, is covered by an empty tmpfs inside
  the sandbox (the entry keeps the base interpreter's prefix visible if it lies under one
  of them). /tmp is replaced by the scratch filesystem."""
  paths = {str(_PROJECT)}
  for name in os.listdir("/"):
    p = os.path.join("/", name)
    if name not in _VISIBLE and not os.path.islink(p) and (os.path.isdir(p) or
                                                           os.path.isfile(p)):
      paths.add(p)
  return sorted(paths)


def _mark(text: str, note: str) -> str:
  return f"{text}\n[tool: {note}]" if text else f"[tool: {note}]"


def run_python(code: str, limits: Limits = Limits()) -> ToolResult:
  """Runs `code` in the sandbox and returns what it printed (never raises)."""
  t0 = time.monotonic()
  isolation = "namespaces" if namespaces_available() else "limits-only"
  try:
    scratch = tempfile.mkdtemp(prefix="fr_tool_")
  except OSError as e:
    return ToolResult(False, _mark("", f"sandbox error: {e}"), None, "sandbox_error", 0.0,
                      isolation)
  try:
    code_file = Path(scratch) / "main.py"
    code_file.write_text(code)
    os.chmod(scratch, 0o755)
    os.chmod(code_file, 0o644)
    status_r, status_w = os.pipe()
    spec = {
        "code_file": str(code_file), "python": _base_python(), "status_fd": status_w,
        "cpu": limits.cpu_seconds, "mem": limits.memory_bytes, "nproc": limits.max_processes,
        "fsize": limits.max_file_bytes, "tmpfs": limits.tmpfs_bytes,
        "hide": _hidden_paths() if isolation == "namespaces" else [],
        "namespaces": isolation == "namespaces",
    }
    entry = [_base_python(), "-I", "-S", str(_ENTRY), json.dumps(spec)]
    cmd = (["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]
           + entry) if isolation == "namespaces" else entry
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent"}
    try:
      proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, cwd=scratch, env=env,
                              start_new_session=True, pass_fds=(status_w,))
    except OSError as e:
      os.close(status_r)
      return ToolResult(False, _mark("", f"sandbox error: {e}"), None, "sandbox_error",
                        time.monotonic() - t0, isolation)
    finally:
      os.close(status_w)
    out, error = _collect(proc, limits, t0)
    with os.fdopen(status_r) as f:
      report = f.read()
    text = out.decode("utf-8", errors="replace")
    try:
      st = json.loads(report)
    except json.JSONDecodeError:
      st = {}
    code_ = st.get("exit")
    if "signal" in st:
      code_ = -st["signal"]
    if error is None:
      if code_ is None or code_ == 125:
        error = "sandbox_error"
      elif code_ < 0:
        error = "killed"
      elif code_ != 0:
        error = "nonzero_exit"
    if error == "timeout":
      text = _mark(text, f"timed out after {limits.wall_seconds:g}s wall / "
                   f"{limits.cpu_seconds}s CPU; output so far shown")
    elif error == "output_limit":
      text = _mark(text, f"output truncated at {limits.max_output_bytes} bytes; process stopped")
    elif error == "killed":
      text = _mark(text, f"process killed by signal {-code_} (a resource limit: CPU time, "
                   "memory or processes)")
    elif error == "sandbox_error":
      text = _mark(text[-limits.max_output_bytes:], "sandbox error; the code may not have run")
    elif error == "nonzero_exit":
      text = _mark(text[-limits.max_output_bytes:], f"exited with status {code_}")
    return ToolResult(error is None, text, code_, error, time.monotonic() - t0, isolation)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)


def _base_python() -> str:
  """The base interpreter (not the venv's), whose stdlib stays visible in the sandbox."""
  for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3"):
    p = Path(sys.base_prefix) / "bin" / name
    if p.exists():
      return str(p)
  return sys.executable


def _collect(proc, limits: Limits, t0: float):
  """Reads output up to the cap and the wall-clock limit; kills the group on overrun."""
  buf = bytearray()
  error = None
  fd = proc.stdout.fileno()
  while True:
    remaining = limits.wall_seconds - (time.monotonic() - t0)
    if remaining <= 0:
      error = "timeout"
      break
    ready, _, _ = select.select([fd], [], [], min(remaining, 0.5))
    if ready:
      chunk = os.read(fd, 65536)
      if not chunk:
        break
      buf += chunk
      if len(buf) > limits.max_output_bytes:
        del buf[limits.max_output_bytes:]
        error = "output_limit"
        break
    elif proc.poll() is not None:
      # Exited; drain whatever is left without blocking.
      continue
  if error is not None:
    _kill_group(proc)
  try:
    proc.wait(timeout=5)
  except subprocess.TimeoutExpired:
    _kill_group(proc)
    proc.wait()
  proc.stdout.close()
  _reap_session(proc.pid)
  return bytes(buf), error


def _session_members(sid: int) -> list[int]:
  out = []
  for p in os.listdir("/proc"):
    if not p.isdigit():
      continue
    try:
      with open(f"/proc/{p}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
      continue
    if len(fields) > 3 and int(fields[3]) == sid and fields[0] != "Z":
      out.append(int(p))
  return out


def _reap_session(sid: int, timeout: float = 5.0):
  """Returns once nothing of the call's session is left running (a fork bomb's children
  outlive their parent by a few milliseconds while the kernel tears the namespace down)."""
  t_end = time.monotonic() + timeout
  while time.monotonic() < t_end:
    if not _session_members(sid):
      return
    try:
      os.killpg(sid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
    time.sleep(0.02)


def _kill_group(proc):
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
