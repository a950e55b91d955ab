r"""The sandboxed Python tool's added latency per call: a trivial call (`pass`) through the
sandbox against the same interpreter started bare (`python -I -S -c pass`), as root and as an
unprivileged user.

  python -m experiments.benchmarks.sandbox                          # 100 calls each
  python -m experiments.benchmarks.sandbox --before=/tmp/old        # and an older tree too

`--before` names a checkout of an earlier revision (`git worktree add /tmp/old REV`); its
sandbox is measured in the same run, in interleaved rounds with this tree and the bare peer,
so that the machine's noise falls on all three alike. The unprivileged runs use nobody and the
system interpreter on world-readable copies of the sandbox files (as tests/test_sandbox.py
does); they need this process to be root. Each line is JSON: the machine, then per user and
tree the median call, the bare peer's median, and the added latency (their difference).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from absl import app, flags

from experiments.benchmarks.common import emitter

flags.DEFINE_integer("calls", 100, "timed calls per tree and user")
flags.DEFINE_integer("rounds", 5, "interleaved rounds the calls are split into")
flags.DEFINE_string("before", None, "a checkout of an earlier revision to measure as well")
flags.DEFINE_list("users", ["root", "nobody"], "whom to run the worker as")
FLAGS = flags.FLAGS

NOBODY = 65534
REPO = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter with the tree to measure first on sys.path: argv = [tree, n,
# what]; prints the n call times as a JSON list. The sandbox's own first call (its probe and
# the page cache) is not timed.
_MEASURE = r"""
import json, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
n, what = int(sys.argv[2]), sys.argv[3]
if what == "bare":
  call = lambda: subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True)
else:
  from fr_jax.envs.sandbox import run_python
  def call():
    r = run_python("pass")
    assert r.ok, r.output
call()
ts = []
for _ in range(n):
  t0 = time.perf_counter()
  call()
  ts.append(time.perf_counter() - t0)
print(json.dumps(ts))
"""


def _system_python() -> str:
  p = shutil.which("python3", path="/usr/bin:/bin")
  if p is None:
    raise SystemExit("no system python3 that an unprivileged user can run")
  return p


def _measure(tree: str, n: int, what: str, user: str) -> list[float]:
  args = ["-c", _MEASURE, tree, str(n), what]
  if user == "root":
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)
  else:
    r = subprocess.run([_system_python(), *args], capture_output=True, text=True,
                       timeout=600, cwd="/", user=NOBODY, group=NOBODY, extra_groups=[],
                       env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
  if r.returncode != 0:
    raise SystemExit(f"measuring {what} of {tree} as {user} failed:\n{r.stderr[-2000:]}")
  return json.loads(r.stdout.strip().splitlines()[-1])


def _isolation(tree: str, user: str) -> str:
  """What a call of `tree`'s sandbox gets as `user` (ToolResult.isolation, which every
  revision reports)."""
  code = ("import sys; sys.path.insert(0, sys.argv[1]); from fr_jax.envs import sandbox; "
          "print(sandbox.run_python('pass').isolation)")
  py = sys.executable if user == "root" else _system_python()
  kw = {} if user == "root" else dict(user=NOBODY, group=NOBODY, extra_groups=[], cwd="/")
  r = subprocess.run([py, "-c", code, tree], capture_output=True, text=True, timeout=120, **kw)
  return r.stdout.strip() or f"error: {r.stderr.strip()[-200:]}"


def main(argv):
  del argv
  import platform
  emit = emitter("sandbox")
  emit("machine", platform=platform.platform(), python=platform.python_version(),
       cpu_count=os.cpu_count(), kernel=os.uname().release, euid=os.geteuid())
  trees = {"this": str(REPO)}
  if FLAGS.before:
    trees["before"] = os.path.realpath(FLAGS.before)
  users = FLAGS.users
  if os.geteuid() != 0:
    users = ["self"]  # an ordinary user measures as itself
  work = tempfile.mkdtemp(prefix="fr_bench_sandbox_")
  os.chmod(work, 0o755)
  try:
    from fr_jax.envs.escapes import portable_copy
    for user in users:
      # root imports the trees themselves; nobody, world-readable copies of their sandbox.
      where = {name: (t if user in ("root", "self") else
                      portable_copy(os.path.join(work, name), Path(t)))
               for name, t in trees.items()}
      runner = "root" if user in ("root", "self") else "nobody"
      times = {k: [] for k in ["bare", *where]}
      per_round = max(1, FLAGS.calls // FLAGS.rounds)
      for rnd in range(FLAGS.rounds):
        times["bare"] += _measure(where["this"], per_round, "bare", runner)
        for name, t in where.items():
          times[name] += _measure(t, per_round, "sandbox", runner)
        print(f"[sandbox bench] {user}: round {rnd + 1}/{FLAGS.rounds}", file=sys.stderr,
              flush=True)
      bare = statistics.median(times["bare"])
      emit("bare", user=user, calls=len(times["bare"]), median_ms=round(1e3 * bare, 2))
      for name, t in where.items():
        med = statistics.median(times[name])
        emit("sandbox", user=user, tree=name, path=trees[name],
             isolation=_isolation(t, runner), calls=len(times[name]),
             median_ms=round(1e3 * med, 2), bare_median_ms=round(1e3 * bare, 2),
             added_ms=round(1e3 * (med - bare), 2), ratio_to_bare=round(med / bare, 2))
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
