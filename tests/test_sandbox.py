"""The sandboxed Python tool against escape attempts. Each must be contained, give the model a
marked result, and leave this (worker) process alive."""

import os
import socket
import threading
from pathlib import Path

import pytest

from fr_jax.envs.sandbox import Limits, namespaces_available, run_python

REPO = Path(__file__).resolve().parents[1]
NS = pytest.mark.skipif(not namespaces_available(),
                        reason="needs Linux namespaces (root + unshare) for file/network isolation")
FAST = Limits(wall_seconds=6.0, cpu_seconds=3)


def test_ordinary_code_runs():
  r = run_python("import math\nprint(sum(i*i for i in range(10)), math.factorial(5))")
  assert r.ok and r.output.strip() == "285 120", r
  r = run_python("print(1/0)")
  assert not r.ok and r.error == "nonzero_exit"
  assert "ZeroDivisionError" in r.output and "[tool: exited with status 1]" in r.output


def test_infinite_loop_is_stopped():
  r = run_python("while True:\n  pass", FAST)
  assert not r.ok and r.error in ("killed", "timeout"), r
  assert r.seconds < FAST.wall_seconds + 3
  assert "[tool:" in r.output


def test_fork_bomb_is_contained():
  code = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass"
  r = run_python(code, FAST)
  assert not r.ok and r.seconds < FAST.wall_seconds + 5, r
  # Nothing is left running as the sandbox user.
  left = [p for p in os.listdir("/proc") if p.isdigit() and _uid(p) == 65534]
  assert not left


def _uid(pid):
  try:
    for line in open(f"/proc/{pid}/status"):
      if line.startswith("Uid:"):
        return int(line.split()[1])
  except OSError:
    return None


def test_ten_gigabytes_of_memory_is_refused():
  r = run_python("x = bytearray(10 * 2**30)\nprint('allocated')", FAST)
  assert not r.ok and "allocated" not in r.output
  assert "MemoryError" in r.output or r.error == "killed", r


def test_hundred_megabytes_of_output_is_truncated():
  lim = Limits(max_output_bytes=4096, wall_seconds=10)
  r = run_python("import sys\nfor _ in range(100):\n  sys.stdout.write('x' * 2**20)", lim)
  assert not r.ok and r.error == "output_limit"
  assert len(r.output) < 4096 + 200 and r.output.endswith(
      "[tool: output truncated at 4096 bytes; process stopped]")


@NS
def test_writing_outside_its_directory_leaves_nothing(tmp_path):
  target = tmp_path / "escaped.txt"
  repo_target = REPO / "escaped_by_sandbox.txt"
  code = ("import os\nres = []\n"
          f"for p in [{str(target)!r}, {str(repo_target)!r}, '/etc/escaped', '/escaped']:\n"
          "  try:\n    open(p, 'w').write('x'); res.append('wrote ' + p)\n"
          "  except OSError as e:\n    res.append('refused ' + p)\n"
          "open('inside.txt', 'w').write('fine')\nprint(res, os.listdir('.'))")
  r = run_python(code, FAST)
  assert r.ok, r
  assert not target.exists() and not repo_target.exists()
  assert not Path("/etc/escaped").exists() and not Path("/escaped").exists()
  assert "inside.txt" in r.output


@NS
def test_reading_the_repository_is_impossible():
  probe = REPO / "fr_jax" / "objective.py"
  assert probe.exists()
  code = (f"import os\ntry:\n  print(open({str(probe)!r}).read()[:40])\n"
          "except OSError as e:\n  print('refused', type(e).__name__)\n"
          f"print(os.listdir({str(REPO)!r}) if os.path.isdir({str(REPO)!r}) else 'no repo')")
  r = run_python(code, FAST)
  assert r.ok, r
  assert "refused" in r.output and "objective" not in r.output
  assert "Makefile" not in r.output


@NS
def test_opening_a_socket_reaches_nothing():
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(1)
  port = server.getsockname()[1]
  got = []
  t = threading.Thread(target=lambda: got.append(server.accept()), daemon=True)
  t.start()
  code = ("import socket\nfor host in ['127.0.0.1', '1.1.1.1']:\n  s = socket.socket()\n"
          "  s.settimeout(2)\n  try:\n"
          f"    s.connect((host, {port})); print('connected', host)\n"
          "  except OSError as e:\n    print('blocked', host, type(e).__name__)")
  r = run_python(code, FAST)
  server.close()
  assert "connected" not in r.output and r.output.count("blocked") == 2, r
  assert not got


@NS
def test_killing_its_parent_does_not_reach_the_worker():
  code = ("import os, signal\nprint('ppid', os.getppid())\n"
          "for pid in [os.getppid(), 1, -1]:\n  try:\n    os.kill(pid, signal.SIGKILL)\n"
          "  except OSError as e:\n    print('kill', pid, type(e).__name__)\n"
          f"try:\n  os.kill({os.getpid()}, signal.SIGKILL)\nexcept OSError as e:\n"
          "  print('worker unreachable', type(e).__name__)")
  r = run_python(code, FAST)
  assert r.isolation == "namespaces"
  # This process (the worker) is alive: we are still running the test.
  assert "worker unreachable" in r.output or r.error == "killed", r


def test_environment_is_minimal():
  os.environ["FR_SECRET_FOR_TEST"] = "leak"
  try:
    r = run_python("import os, sys\nprint(sorted(os.environ))\nprint(sys.flags.isolated)")
  finally:
    del os.environ["FR_SECRET_FOR_TEST"]
  assert r.ok and "FR_SECRET_FOR_TEST" not in r.output and r.output.strip().endswith("1")
