"""The sandboxed Python tool against escape attempts, run as a user would run a worker: as root
and as an unprivileged user (nobody, dropped to inside the test).

Each user runs `python -m fr_jax.envs.escapes --json` once (25 attempts, about 10 s); the
tests below read its verdicts, which rest on the host's side (the listener saw nothing, the
file does not exist, no segment is left, the concurrent calls succeeded). The unprivileged
run uses the system interpreter and a world-readable copy of the sandbox's stdlib-only files:
this test's own interpreter lives under /root, which nobody cannot read, as a real ordinary
user's worker would have its own interpreter.

Fail-closed is tested in a user namespace that permits no nested ones (`tests/no_userns.py`),
which is how a kernel or container that refuses user namespaces looks to the sandbox."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fr_jax.envs.escapes import ATTEMPTS, portable_copy
from fr_jax.envs.sandbox import Limits, run_python
from tests import XLA_TEST_FLAGS

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


def _kernel_allows_user_namespaces() -> bool:
  """Independent of the sandbox's own probe: util-linux's unshare, as nobody when root."""
  cmd = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--ipc", "--mount",
         "--fork", "true"]
  if os.geteuid() == 0:
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] + cmd
  try:
    return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


USERNS = _kernel_allows_user_namespaces()
needs_userns = pytest.mark.skipif(not USERNS, reason="this kernel refuses user namespaces")


@pytest.fixture(scope="module")
def world_readable_copy():
  """The stdlib-only files an unprivileged worker needs, where nobody can read them."""
  d = portable_copy(tempfile.mkdtemp(prefix="fr_sandbox_user_"))
  yield d
  shutil.rmtree(d, ignore_errors=True)


def as_user(mode, args, copy, timeout=300):
  """Runs `python ARGS` as the worker of `mode`: root (this interpreter, the repository) or
  unprivileged (nobody with the system interpreter on the copy; the current user if the
  tests themselves run unprivileged)."""
  if mode == "root":
    if os.geteuid() != 0:
      pytest.skip("the root worker is tested when the tests run as root")
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=str(REPO)))
  if os.geteuid() != 0:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=str(REPO)))
  assert SYSTEM_PYTHON, "no system python3 that an unprivileged user can run"
  return subprocess.run([SYSTEM_PYTHON, *args], cwd=copy, capture_output=True, text=True,
                        timeout=timeout, user=NOBODY, group=NOBODY, extra_groups=[],
                        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": copy, "LANG": "C.UTF-8"})


_RUNS = {}


def escape_run(mode, copy):
  if mode not in _RUNS:
    out = as_user(mode, ["-m", "fr_jax.envs.escapes", "--json"], copy)
    lines = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert lines and lines[-1].get("summary"), (out.stdout[-2000:], out.stderr[-3000:])
    _RUNS[mode] = lines
  return _RUNS[mode]


MODES = ["root", "unprivileged"]


@needs_userns
@pytest.mark.parametrize("mode", MODES)
def test_every_attempt_ran_under_full_isolation(mode, world_readable_copy):
  lines = escape_run(mode, world_readable_copy)
  summary = lines[-1]
  assert summary["isolation"] == "namespaces", summary
  assert summary["attempts"] == len(ATTEMPTS) >= 16
  assert summary["user"] == ("uid 0" if mode == "root" else f"uid {NOBODY}")


@needs_userns
@pytest.mark.parametrize("name", [a.name for a in ATTEMPTS])
@pytest.mark.parametrize("mode", MODES)
def test_escape_attempt_is_contained(mode, name, world_readable_copy):
  rows = {r["name"]: r for r in escape_run(mode, world_readable_copy)[:-1]}
  r = rows[name]
  print(json.dumps(r))
  assert r["contained"], r


# --- fail closed ---
WORKER = r"""
import json, logging, os, sys
from fr_jax.envs import sandbox
logging.basicConfig(level=logging.WARNING, format="LOG %(message)s", stream=sys.stdout)
out = {"probe": sandbox.probe(), "uid": os.geteuid()}
try:
  sandbox.require_isolation()
  out["required"] = "no error"
except sandbox.SandboxUnavailable as e:
  out["required"] = str(e)
marker = os.path.join(os.environ.get("TMPDIR", "/tmp"), "fr_closed_%d" % os.getpid())
r = sandbox.run_python("open(%r, 'w').write('ran')" % marker)
out["refused"] = [r.error, r.isolation, os.path.exists(marker)]
lim = sandbox.Limits(allow_limits_only=True)
a = sandbox.run_python("import os; print(os.getuid())", lim)
b = sandbox.run_python("print(6 * 7)", lim)
out["limits_only"] = [[a.ok, a.isolation, a.output.strip()], [b.ok, b.isolation, b.output.strip()]]
out["mode"] = sandbox.isolation_mode(lim)
print(json.dumps(out))
"""


@needs_userns
@pytest.mark.parametrize("mode", MODES)
def test_without_user_namespaces_calls_are_refused_unless_limits_only_is_allowed(
    mode, world_readable_copy):
  out = as_user(mode, ["tests/no_userns.py", sys.executable if mode == "root" or
                       os.geteuid() != 0 else SYSTEM_PYTHON, "-c", WORKER],
                world_readable_copy, timeout=120)
  lines = out.stdout.splitlines()
  assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
  r = json.loads(lines[-1])
  assert r["probe"][0] is False and "No space left on device" in r["probe"][1], r
  assert "needs Linux user namespaces" in r["required"], r
  assert "allow_limits_only" in r["required"]
  assert r["refused"] == ["sandbox_unavailable", "none", False], r  # nothing ran
  (a_ok, a_iso, a_uid), (b_ok, b_iso, b_out) = r["limits_only"]
  assert a_ok and b_ok and a_iso == b_iso == "limits-only" and b_out == "42", r
  assert a_uid == str(NOBODY) if r["uid"] == 0 else a_uid == str(r["uid"])  # never as root
  assert r["mode"] == "limits-only"
  warnings = [ln for ln in lines if ln.startswith("LOG ") and "limits only" in ln]
  assert len(warnings) == 1, lines  # once per process


def _train_without_userns(run_dir, *extra):
  """launch.train (tiny model, 1 update) where the kernel refuses user namespaces. The
  repository's interpreter, so the worker is the test's own user here; the unprivileged path
  of the same refusal is test_without_user_namespaces_calls_are_refused_unless_... above."""
  cmd = [sys.executable, "tests/no_userns.py", sys.executable, "-m", "launch.train",
         "--config=experiments/configs/tiny_test.py", "--config.max_updates=1",
         "--config.eval.n=0", "--config.env.name=arithmetic", f"--run_dir={run_dir}", *extra]
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", XLA_FLAGS=XLA_TEST_FLAGS)
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


@needs_userns
def test_a_run_that_cannot_isolate_the_tool_stops_at_start(tmp_path):
  """Exit 2 with the reason and the opt-out, before any model loads or the run dir exists."""
  r = _train_without_userns(tmp_path / "a")
  lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
  assert r.returncode == 2 and lines[-1].startswith("error: the Python tool needs Linux user "
                                                    "namespaces"), r.stderr[-2000:]
  assert "allow_limits_only" in lines[-1] and not (tmp_path / "a").exists()


@needs_userns
@pytest.mark.slow  # a whole (tiny) training run; the refusal above is the fast half
def test_a_run_allowed_limits_only_trains_and_says_so(tmp_path):
  r = _train_without_userns(tmp_path / "b", "--config.agent.allow_limits_only=True")
  assert r.returncode == 0, r.stderr[-3000:]
  summary = json.loads(r.stdout.strip().splitlines()[-1])
  assert summary["tool_isolation"] == "limits-only" and summary["updates"] == 1, summary
  assert "resource limits only" in r.stderr


# --- ordinary behaviour ---
def test_ordinary_code_runs():
  r = run_python("import math\nprint(sum(i*i for i in range(10)), math.factorial(5))")
  assert r.ok and r.output.strip() == "285 120", r
  r = run_python("print(1/0)")
  assert not r.ok and r.error == "nonzero_exit"
  assert "ZeroDivisionError" in r.output and "[tool: exited with status 1]" in r.output


def test_scratch_is_writable_and_size_limited():
  lim = Limits(tmpfs_bytes=4 * 2**20)
  r = run_python("import os\nopen('/tmp/a', 'w').write('x' * 1000)\n"
                 "print(os.path.getsize('/tmp/a'), os.getcwd())\n"
                 "try:\n  open('/tmp/b', 'wb').write(b'x' * 6 * 2**20)\n"
                 "except OSError as e:\n  print(e.strerror)", lim)
  assert r.ok, r
  size, cwd = r.output.split("\n")[0].split()
  assert size == "1000" and cwd == "/tmp/work"
  assert "No space left on device" in r.output


# --- one memory limit for the whole call ---
CHILDREN = r"""
import json, sys
from fr_jax.envs import sandbox
lim = sandbox.Limits(call_memory_bytes=256 * 2**20, memory_bytes=512 * 2**20, wall_seconds=30,
                     cpu_seconds=20)
code = '''
import os, time
kids = []
for i in range(6):
  pid = os.fork()
  if pid == 0:
    b = bytearray(100 * 2**20)
    for j in range(0, len(b), 4096):
      b[j] = 1
    time.sleep(1.0)
    os._exit(0)
  kids.append(pid)
killed = sum(os.WIFSIGNALED(os.waitpid(p, 0)[1]) for p in kids)
print("OUT killed", killed)
'''
r = sandbox.run_python(code, lim)
print(json.dumps({"containment": sandbox.memory_containment(), "ok": r.ok, "out": r.output,
                  "isolation": r.isolation}))
"""


@needs_userns
@pytest.mark.parametrize("mode", MODES)
def test_six_children_share_one_memory_limit(mode, world_readable_copy):
  """Six children each touching 100 MiB under a 256 MiB call limit: at most two fit, so the
  kernel kills at least three (the per-process address-space limit alone let all six run,
  1.2 GiB together). Where the worker cannot make a memory cgroup (an unprivileged worker on
  most machines) the sandbox says so rather than claim the limit."""
  out = as_user(mode, ["-c", CHILDREN], world_readable_copy, timeout=120)
  assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
  r = json.loads(out.stdout.strip().splitlines()[-1])
  kind, where = r["containment"]
  killed = int(r["out"].split("OUT killed")[1].split()[0])
  if kind.startswith("cgroup"):
    assert r["ok"] and killed >= 3, r
  else:
    assert kind == "per-process" and "cgroup" in where, r
    assert mode == "unprivileged", "a root worker here should get a memory cgroup"
    assert killed == 0, r  # what the limit would have stopped, said out loud above
