"""Sandbox entry point (stdlib only; run by the base interpreter in isolated mode).

Invoked by fr_jax.envs.sandbox.run_python, inside fresh net/mount/pid namespaces when
available: covers private paths with empty tmpfs mounts (keeping the interpreter's prefix),
makes a fresh scratch directory, drops to the unprivileged user, applies resource limits and
replaces itself with `python -I -S main.py`.
"""

import ctypes
import json
import os
import resource
import sys

NOBODY = 65534
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18


def _mount(libc, src, target, fstype, flags, data=None):
  r = libc.mount(src.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                 data.encode() if data else None)
  if r != 0:
    e = ctypes.get_errno()
    raise OSError(e, f"mount {target}: {os.strerror(e)}")


def _isolate_filesystem(spec):
  libc = ctypes.CDLL(None, use_errno=True)
  _mount(libc, "none", "/", None, MS_REC | MS_PRIVATE)
  prefix = os.path.realpath(sys.base_prefix)
  for f in spec["hide"]:  # top-level files: covered by /dev/null
    if os.path.isfile(f) and not os.path.islink(f):
      _mount(libc, "/dev/null", f, None, MS_BIND)
  hidden = []
  for h in sorted(os.path.realpath(h) for h in spec["hide"] if os.path.isdir(h)):
    if h == "/tmp" or h.startswith("/tmp/"):  # the scratch tmpfs covers all of /tmp below
      continue
    if not any(h == c or h.startswith(c + "/") for c in hidden):  # nested: already covered
      hidden.append(h)
  keep = [prefix] if any(prefix.startswith(os.path.realpath(h) + "/") for h in hidden) else []
  if keep:  # stage the interpreter prefix on a private tmpfs, cover, then bind it back
    _mount(libc, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=700")
    os.mkdir("/tmp/keep")
    _mount(libc, prefix, "/tmp/keep", None, MS_BIND | MS_REC)
  for h in hidden:
    _mount(libc, "tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
  if keep:
    os.makedirs(prefix, exist_ok=True)
    _mount(libc, "/tmp/keep", prefix, None, MS_BIND | MS_REC)
  # The scratch filesystem, fresh and size-limited; the only writable place.
  _mount(libc, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
         f"size={spec['tmpfs']},mode=1777")
  return "/tmp/work"


def _child(spec, work, main_py, root):
  """Runs in the forked child: drop privileges, apply limits, become the user's program."""
  os.setsid()
  os.chdir(work)
  if root:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
  limits = {
      resource.RLIMIT_CPU: spec["cpu"], resource.RLIMIT_AS: spec["mem"],
      resource.RLIMIT_NPROC: spec["nproc"], resource.RLIMIT_FSIZE: spec["fsize"],
      resource.RLIMIT_NOFILE: 64, resource.RLIMIT_CORE: 0,
  }
  for which, value in limits.items():
    resource.setrlimit(which, (value, value))
  env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "PYTHONHASHSEED": "0"}
  os.execve(spec["python"], [spec["python"], "-I", "-S", main_py], env)


def main():
  spec = json.loads(sys.argv[1])
  status = os.fdopen(spec["status_fd"], "w")
  with open(spec["code_file"]) as f:
    code = f.read()
  root = os.geteuid() == 0
  if spec["namespaces"]:
    work = _isolate_filesystem(spec)
    os.mkdir(work)
  else:
    work = os.path.dirname(spec["code_file"])
  main_py = os.path.join(work, "main.py")
  with open(main_py, "w") as f:
    f.write(code)
  if root:
    os.chown(work, NOBODY, NOBODY)
    os.chown(main_py, NOBODY, NOBODY)
  # This process stays a privileged supervisor the code cannot signal: it reports how the
  # code ended on the status pipe, then takes every leftover process of the code with it.
  pid = os.fork()
  if pid == 0:
    try:
      _child(spec, work, main_py, root)
    finally:
      os._exit(125)
  _, st = os.waitpid(pid, 0)
  try:
    os.killpg(pid, 9)
  except OSError:
    pass
  if os.WIFSIGNALED(st):
    status.write(json.dumps({"signal": os.WTERMSIG(st)}))
  else:
    status.write(json.dumps({"exit": os.WEXITSTATUS(st)}))
  status.close()


if __name__ == "__main__":
  try:
    main()
  except Exception as e:  # reported to the model as a sandbox error, never raised further
    print(f"[sandbox setup failed: {type(e).__name__}: {e}]", flush=True)
    sys.exit(125)
