"""A sandboxed Python tool: each call runs model-written code in a separate, contained process.

Isolation fails closed. A call runs under real isolation (Linux user namespaces, for a root
worker and for an ordinary user alike) or, where the kernel refuses them, not at all: the
result says `sandbox_unavailable` with the kernel's reason. `Limits(allow_limits_only=True)`
is the explicit opt-out; that mode logs a warning once per process and `isolation_mode()`
reports it for run summaries.

Containment, from outside in (`_sandbox_entry.py` has the process layout):
* New user, mount, PID, network, IPC and UTS namespaces per call. The code sees a new root:
  the system directories and the interpreter read-only, a few /etc files, a minimal /dev
  (null, zero, full, random, urandom), its own /proc, and one size-limited scratch tmpfs
  serving /tmp and /dev/shm, discarded afterwards. No network interfaces are up. SysV and
  POSIX IPC die with the call.
* A supervisor (PID 1 of the namespace) that the code can neither signal nor ptrace reports
  how the code ended on a status pipe no code process holds, then kills what is left.
* The code runs as nobody in a second user namespace (its mounts locked, no capabilities, no
  further user namespaces, no_new_privs), with per-call limits: CPU seconds, address space,
  processes (counted per user namespace, so one call's fork bomb cannot starve another),
  file size, open files, no core dumps; no inherited descriptors.
* One memory limit on the whole call (`call_memory_bytes`: every process of it together,
  its tmpfs included), where the worker may make a memory cgroup (cgroup v1 or v2 with the
  memory controller delegated: a root worker on most machines). The entry joins the call's
  cgroup before it forks anything; the kernel kills a process of the call that takes it past
  the limit. Elsewhere only the per-process address-space limit holds (six children could then
  use six times `memory_bytes`); `memory_containment()` says which, and a worker logs it once.
* The isolated interpreter (`python -I -S`) in an empty working directory with a minimal
  environment. The caller enforces the wall-clock limit, the output cap and the code size,
  kills the whole process tree on overrun, and never raises for anything the code does: the
  model always gets a result, truncated and clearly marked when something went wrong.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_ENTRY = Path(__file__).with_name("_sandbox_entry.py")
log = logging.getLogger("fr_jax.sandbox")


@dataclasses.dataclass(frozen=True)
class Limits:
  wall_seconds: float = 10.0
  cpu_seconds: int = 5
  memory_bytes: int = 512 * 2**20  # address space, per process
  call_memory_bytes: int = 512 * 2**20  # resident memory of the whole call (a cgroup)
  max_processes: int = 16  # per call (threads count)
  max_output_bytes: int = 16 * 1024  # what the model sees (stdout + stderr)
  max_file_bytes: int = 8 * 2**20  # any single file the code writes
  tmpfs_bytes: int = 32 * 2**20  # the scratch filesystem (/tmp and /dev/shm together)
  max_code_bytes: int = 256 * 1024  # a longer tool call is refused before anything runs
  # Where the kernel refuses user namespaces: run the code with the limits only (as the
  # worker's user, or nobody for root) instead of refusing the call. Unsafe: the code can
  # then read what the worker's user can read and reach the network.
  allow_limits_only: bool = False


class SandboxUnavailable(RuntimeError):
  """The kernel refuses the namespaces the sandbox needs, and limits-only is not allowed."""


@dataclasses.dataclass
class ToolResult:
  ok: bool  # exited 0 within limits
  output: str  # what the model sees: output, marked if truncated or failed
  exit_code: int | None
  # timeout | output_limit | nonzero_exit | killed | code_too_long | sandbox_error |
  # sandbox_unavailable
  error: str | None
  seconds: float
  isolation: str  # "namespaces" | "limits-only" | "none" (refused before running)


_PROBE: tuple[bool, str] | None = None
_PROBE_LOCK = threading.Lock()
_CGROUP: tuple[str, str] | None = None  # (kind "v1" | "v2" | "", base folder or the reason)
_CGROUP_N = [0]
_CGROUP_LOCK = threading.Lock()  # not _PROBE_LOCK: the probe's own call makes a cgroup
_WARNED = threading.Event()
_WARN_LOCK = threading.Lock()


def probe() -> tuple[bool, str]:
  """(available, reason): whether a call gets full isolation on this machine, found once per
  process by running an empty program through the whole namespace setup."""
  global _PROBE
  with _PROBE_LOCK:
    if _PROBE is None:
      r = _run("", Limits(wall_seconds=30.0), "namespaces")
      why = r.output.strip().splitlines()[0] if r.output.strip() else str(r.error)
      why = why.removeprefix("[sandbox setup failed: ").removeprefix("SetupError: ")
      _PROBE = (True, "") if r.ok else (False, why.rstrip("]"))
    return _PROBE


def isolation_mode(limits: Limits = Limits()) -> str:
  """What a call with `limits` gets here: namespaces, limits-only or unavailable."""
  if probe()[0]:
    return "namespaces"
  return "limits-only" if limits.allow_limits_only else "unavailable"


def require_isolation(limits: Limits = Limits()) -> str:
  """For a worker about to offer the tool: the isolation mode, or SandboxUnavailable with the
  kernel's reason and the opt-out, so the run fails at start rather than on every call."""
  mode = isolation_mode(limits)
  if mode == "unavailable":
    raise SandboxUnavailable(
        f"the Python tool needs Linux user namespaces, which this machine refuses "
        f"({probe()[1]}). Enable them (sysctl user.max_user_namespaces > 0; in a container, "
        f"a seccomp profile that allows unshare), or set agent.allow_limits_only=True to run "
        f"model code with resource limits only (it can then read the worker user's files and "
        f"reach the network)")
  if mode == "limits-only":
    _warn_limits_only()
  kind, where = memory_containment()
  if kind == "per-process":
    log.warning("the Python tool's memory limit is per process only (%s): a call's processes "
                "together may use up to agent.tool_limits.max_processes x memory_bytes", where)
  return mode


def _warn_limits_only():
  """The limits-only warning, once per process (threads may race here)."""
  with _WARN_LOCK:
    first = not _WARNED.is_set()
    _WARNED.set()
  if first:
    log.warning("the Python tool runs model code with resource limits only: user namespaces "
                "are unavailable (%s) and allow_limits_only is set", probe()[1])


def _own_cgroup_dirs():
  """(kind, folder) candidates for this process's own memory cgroup: v1's memory hierarchy,
  then v2's (unified, or the whole /sys/fs/cgroup)."""
  try:
    lines = open("/proc/self/cgroup").read().splitlines()
  except OSError:
    return []
  own = {}
  for line in lines:
    _, controllers, path = line.split(":", 2)
    own["v1" if "memory" in controllers.split(",") else "v2" if controllers == "" else "-"] = path
  out = []
  if "v1" in own:
    out += [("v1", Path("/sys/fs/cgroup/memory") / own["v1"].lstrip("/")),
            ("v1", Path("/sys/fs/cgroup/memory"))]  # a namespaced view: its own root
  if "v2" in own:
    for root in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
      out.append(("v2", root / own["v2"].lstrip("/")))
  return out


def _make_cgroup(kind: str, base: Path, name: str, limit: int) -> Path:
  """A child cgroup of `base` holding at most `limit` bytes (swap included); OSError if the
  kernel refuses any step."""
  d = base / name
  d.mkdir()
  try:
    first, swap = (("memory.limit_in_bytes", "memory.memsw.limit_in_bytes") if kind == "v1"
                   else ("memory.max", "memory.swap.max"))
    if kind == "v2" and "memory" not in (d / "cgroup.controllers").read_text().split():
      raise OSError(f"the memory controller is not delegated to {base}")
    (d / first).write_text(str(limit))
    if (d / swap).exists():  # v1: memory+swap >= memory; v2: swap on its own
      (d / swap).write_text(str(limit) if kind == "v1" else "0")
  except OSError:
    d.rmdir()
    raise
  return d


def memory_containment() -> tuple[str, str]:
  """("cgroup v1" | "cgroup v2", folder) when each call gets a memory cgroup here, else
  ("per-process", the reason), found once per process."""
  global _CGROUP
  with _CGROUP_LOCK:
    if _CGROUP is None:
      why = "no memory cgroup in /proc/self/cgroup"
      for kind, base in _own_cgroup_dirs():
        try:
          _make_cgroup(kind, base, f"fr_sandbox_probe_{os.getpid()}", 64 * 2**20).rmdir()
          _CGROUP = (kind, str(base))
          break
        except OSError as e:
          why = f"cannot make a memory cgroup under {base}: {e.strerror or e}"
      else:
        _CGROUP = ("", why)
  kind, where = _CGROUP
  return (f"cgroup {kind}", where) if kind else ("per-process", where)


def _call_cgroup(limits: Limits) -> Path | None:
  """The call's own memory cgroup, or None where none can be made."""
  memory_containment()
  kind, base = _CGROUP
  if not kind:
    return None
  with _CGROUP_LOCK:
    _CGROUP_N[0] += 1
    n = _CGROUP_N[0]
  try:
    return _make_cgroup(kind, Path(base), f"fr_sandbox_{os.getpid()}_{n}",
                        limits.call_memory_bytes)
  except OSError as e:
    log.warning("no memory cgroup for this call (%s); per-process limits only", e)
    return None


def _remove_cgroup(d: Path | None) -> None:
  if d is None:
    return
  for _ in range(50):  # the call's processes are reaped; the kernel may lag a little
    try:
      d.rmdir()
      return
    except OSError:
      time.sleep(0.02)
  log.warning("could not remove the call's cgroup %s", d)


def _mark(text: str, note: str) -> str:
  return f"{text}\n[tool: {note}]" if text else f"[tool: {note}]"


def run_python(code: str, limits: Limits = Limits()) -> ToolResult:
  """Runs `code` in the sandbox and returns what it printed (never raises)."""
  if len(code.encode("utf-8", errors="replace")) > limits.max_code_bytes:
    return ToolResult(False, _mark("", f"code longer than {limits.max_code_bytes} bytes; "
                                   "not run"), None, "code_too_long", 0.0, "none")
  mode = isolation_mode(limits)
  if mode == "unavailable":
    return ToolResult(False, _mark("", "sandbox unavailable on this machine; not run"), None,
                      "sandbox_unavailable", 0.0, "none")
  if mode == "limits-only":
    _warn_limits_only()
  return _run(code, limits, mode)


def _run(code: str, limits: Limits, mode: str) -> ToolResult:
  t0 = time.monotonic()
  try:
    scratch = tempfile.mkdtemp(prefix="fr_tool_")
  except OSError as e:
    return ToolResult(False, _mark("", f"sandbox error: {e}"), None, "sandbox_error", 0.0,
                      mode)
  try:
    code_file = Path(scratch) / "main.py"
    code_file.write_text(code)
    os.chmod(scratch, 0o755)
    os.chmod(code_file, 0o644)
    status_r, status_w = os.pipe()
    python = _base_python()
    spec = {
        "code_file": str(code_file), "root": scratch, "python": python,
        "prefix": os.path.realpath(sys.base_prefix), "status_fd": status_w, "mode": mode,
        "cpu": limits.cpu_seconds, "mem": limits.memory_bytes, "nproc": limits.max_processes,
        "fsize": limits.max_file_bytes, "tmpfs": limits.tmpfs_bytes,
    }
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent"}
    cgroup = _call_cgroup(limits)
    spec["cgroup"] = str(cgroup) if cgroup is not None else ""
    try:
      proc = subprocess.Popen([python, "-I", "-S", str(_ENTRY), json.dumps(spec)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, cwd=scratch, env=env,
                              start_new_session=True, pass_fds=(status_w,))
    except OSError as e:
      os.close(status_r)
      _remove_cgroup(cgroup)
      return ToolResult(False, _mark("", f"sandbox error: {e}"), None, "sandbox_error",
                        time.monotonic() - t0, mode)
    finally:
      os.close(status_w)
    try:
      out, error = _collect(proc, limits, t0)
    finally:
      _remove_cgroup(cgroup)
    with os.fdopen(status_r) as f:
      report = f.read()
    text = out.decode("utf-8", errors="replace")
    try:
      st = json.loads(report)
    except json.JSONDecodeError:
      st = {}
    code_ = -st["signal"] if "signal" in st else st.get("exit")
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
    return ToolResult(error is None, text, code_, error, time.monotonic() - t0, mode)
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
    _kill_group(proc.pid)
  try:
    proc.wait(timeout=5)
  except subprocess.TimeoutExpired:
    _kill_group(proc.pid)
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
    _kill_group(sid)
    time.sleep(0.02)


def _kill_group(pgid: int):
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
