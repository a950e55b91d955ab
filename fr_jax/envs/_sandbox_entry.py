"""Sandbox entry point (stdlib only; run by the base interpreter in isolated mode).

Invoked by fr_jax.envs.sandbox.run_python with a JSON spec. The same code runs for a root
worker and for an ordinary user; only the identity map differs.

Namespaces mode, four processes:

  E (this process, the worker's uid)
  `- S  unshare(user, mount, pid, net, ipc, uts); E writes S's uid/gid maps from outside
     `- P  PID 1 of the new PID namespace, root of the new user namespace (the supervisor):
        |  builds a new root (read-only system binds, minimal /dev, fresh /proc, one size-limited
        |  scratch tmpfs serving /tmp and /dev/shm), pivots into it, drops the old root, makes
        |  itself non-dumpable, then forks the code and reports how it ended on the status pipe
        `- C  closes every inherited descriptor, drops to nobody (root workers), enters a second
              user + mount namespace (which locks every mount above: the code cannot unmount
              or remount them), sets rlimits and no_new_privs, execs `python -I -S main.py`

Why this holds: the code's uid differs from P's (root worker) or P is non-dumpable in an
ancestor user namespace (ordinary worker), so it can neither ptrace P nor read its /proc
entries; P is the PID namespace's init, which ignores signals from inside; nothing of the host
is mounted but the read-only system directories; the network namespace has no interfaces up
(no TCP, no DNS, no abstract Unix sockets of the host); the IPC namespace dies with the call;
RLIMIT_NPROC counts per (user namespace, uid), so each call has its own process counter.
The user namespace of P allows one nested user namespace (C's), so the code cannot open more.

Limits-only mode (only when the caller's config allows it): the code runs as the worker's
user (nobody for root) with the rlimits, an empty directory and no inherited descriptors.
"""

import ctypes
import json
import os
import platform
import resource
import sys

NOBODY = 65534
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
ST_NOEXEC, ST_NOATIME, ST_NODIRATIME, ST_RELATIME = 8, 1024, 2048, 4096
MNT_DETACH = 2
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}
DEVICES = ("null", "zero", "full", "random", "urandom")
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# /etc entries the interpreter and libc may read; the rest of /etc (service configs, tokens
# a deployment keeps there) is not visible.
ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "passwd", "group",
       "nsswitch.conf", "hosts", "alternatives")
NS_FLAGS = (CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
            | CLONE_NEWUTS)

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
  pass


def _check(r, what):
  if r != 0:
    e = ctypes.get_errno()
    raise SetupError(f"{what}: {os.strerror(e)}")


def _unshare(flags, what):
  _check(_libc.unshare(ctypes.c_int(flags)), what)


def _mount(src, target, fstype, flags, data=None):
  _check(_libc.mount(src.encode() if src else None, target.encode(),
                     fstype.encode() if fstype else None, ctypes.c_ulong(flags),
                     data.encode() if data else None), f"mount {target}")


def _write(path, text):
  fd = os.open(path, os.O_WRONLY)
  try:
    os.write(fd, text.encode())
  finally:
    os.close(fd)


def _ro_bind(src, dst):
  """A read-only bind of `src` at `dst`, keeping the flags the kernel locks (atime, noexec)."""
  _mount(src, dst, None, MS_BIND | MS_REC)
  f = os.statvfs(src).f_flag
  flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
  flags |= MS_NOEXEC if f & ST_NOEXEC else 0
  flags |= MS_NODIRATIME if f & ST_NODIRATIME else 0
  if f & ST_NOATIME:
    flags |= MS_NOATIME
  elif f & ST_RELATIME:
    flags |= MS_RELATIME
  else:
    flags |= MS_STRICTATIME
  _mount(None, dst, None, flags)


def _mirror(host, root):
  """`host` (a path) at root + host: the same symlink, or a read-only bind of the directory
  or file; nothing if the host lacks it."""
  if os.path.islink(host):
    os.symlink(os.readlink(host), root + host)
  elif os.path.isdir(host):
    os.mkdir(root + host)
    _ro_bind(host, root + host)
  elif os.path.isfile(host):
    open(root + host, "w").close()
    _ro_bind(host, root + host)


def _build_root(spec):
  """The sandbox's filesystem, assembled on a tmpfs over the (host-empty) scratch directory;
  pivots into it. Runs in P: the new mount namespace, the new PID namespace's /proc."""
  _mount(None, "/", None, MS_REC | MS_PRIVATE)
  root = spec["root"]
  _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
  for d in SYSTEM_DIRS:
    _mirror("/" + d, root)
  bound = [("/" + d) for d in SYSTEM_DIRS if os.path.isdir("/" + d)
           and not os.path.islink("/" + d)]
  os.mkdir(root + "/etc", 0o755)
  for name in ETC:
    _mirror("/etc/" + name, root)
  prefix = os.path.realpath(spec["prefix"])
  if not any(prefix == b or prefix.startswith(b + "/") for b in bound):
    os.makedirs(root + prefix, exist_ok=True)
    _ro_bind(prefix, root + prefix)
  # One scratch filesystem, size-limited, for both /tmp and /dev/shm.
  stage = root + "/.scratch"
  os.mkdir(stage)
  _mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['tmpfs']},mode=755")
  for d in ("tmp", "shm"):
    os.mkdir(f"{stage}/{d}")
    os.chmod(f"{stage}/{d}", 0o1777)
  os.mkdir(root + "/tmp")
  _mount(stage + "/tmp", root + "/tmp", None, MS_BIND)
  os.mkdir(root + "/dev")
  _mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
  for name in DEVICES:
    open(f"{root}/dev/{name}", "w").close()
    _mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
  for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                       ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
    os.symlink(target, f"{root}/dev/{name}")
  os.mkdir(root + "/dev/shm")
  _mount(stage + "/shm", root + "/dev/shm", None, MS_BIND)
  _check(_libc.umount2((stage).encode(), MNT_DETACH), "umount scratch stage")
  os.rmdir(stage)
  os.mkdir(root + "/proc")
  _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
  nr = SYS_PIVOT_ROOT.get(platform.machine())
  if nr is None:
    raise SetupError(f"pivot_root: unknown syscall number on {platform.machine()}")
  os.chdir(root)
  _check(_libc.syscall(nr, b".", b"."), "pivot_root")
  _check(_libc.umount2(b".", MNT_DETACH), "detach the old root")
  os.chdir("/")
  _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _map_ids(pid, root_worker):
  """E writes S's identity maps from the parent namespace: a root worker maps root (for the
  supervisor) and nobody (for the code); an ordinary user maps only itself, as root."""
  if root_worker:
    ids = f"0 0 1\n{NOBODY} {NOBODY} 1\n"
    _write(f"/proc/{pid}/uid_map", ids)
    _write(f"/proc/{pid}/gid_map", ids)
  else:
    _write(f"/proc/{pid}/setgroups", "deny")
    _write(f"/proc/{pid}/uid_map", f"0 {os.geteuid()} 1\n")
    _write(f"/proc/{pid}/gid_map", f"0 {os.getegid()} 1\n")


def _close_inherited():
  """Every descriptor above stderr, the status pipe included."""
  try:
    fds = [int(f) for f in os.listdir("/proc/self/fd")]
  except OSError:
    fds = range(3, 1024)
  for fd in fds:
    if fd > 2:
      try:
        os.close(fd)
      except OSError:
        pass


def _limits(spec):
  limits = {
      resource.RLIMIT_CPU: spec["cpu"], resource.RLIMIT_AS: spec["mem"],
      resource.RLIMIT_NPROC: spec["nproc"], resource.RLIMIT_FSIZE: spec["fsize"],
      resource.RLIMIT_NOFILE: 64, resource.RLIMIT_CORE: 0,
  }
  for which, value in limits.items():
    resource.setrlimit(which, (value, value))


def _exec_code(spec, work, pythons=()):
  """Becomes `python -I -S main.py`; in limits-only mode a root worker's interpreter may be
  one nobody cannot read (under /root), so the system's is tried next."""
  env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "PYTHONHASHSEED": "0"}
  os.chdir(work)
  for python in (spec["python"], *pythons):
    try:
      os.execve(python, [python, "-I", "-S", "main.py"], env)
    except PermissionError:
      continue
  raise SetupError(f"no Python interpreter this user may run: {spec['python']}, "
                   f"{', '.join(pythons)}")


def _code_child(spec, work, root_worker):
  """C: from the supervisor's child to the model's program."""
  _close_inherited()
  os.setsid()
  if root_worker:
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
  _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # its own /proc files again, to write its maps
  uid, gid = os.geteuid(), os.getegid()
  _unshare(CLONE_NEWUSER | CLONE_NEWNS, "unshare the code's user namespace")
  _write("/proc/self/setgroups", "deny")
  _write("/proc/self/uid_map", f"{NOBODY} {uid} 1\n")
  _write("/proc/self/gid_map", f"{NOBODY} {gid} 1\n")
  _limits(spec)
  _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
  _exec_code(spec, work)


def _report(status_fd, st):
  ended = {"signal": os.WTERMSIG(st)} if os.WIFSIGNALED(st) else {"exit": os.WEXITSTATUS(st)}
  with os.fdopen(status_fd, "w") as status:
    status.write(json.dumps(ended))


def _supervise(spec, code, root_worker):
  """P: PID 1 of the call's PID namespace."""
  _build_root(spec)
  _check(_libc.sethostname(b"sandbox", 7), "sethostname")
  # One nested user namespace below this one (the code's); the code cannot create more.
  _write("/proc/sys/user/max_user_namespaces", "1")
  work = "/tmp/work"
  os.mkdir(work, 0o700)
  with open(work + "/main.py", "w") as f:
    f.write(code)
  if root_worker:
    for p in (work, work + "/main.py"):
      os.chown(p, NOBODY, NOBODY)
  _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "non-dumpable supervisor")
  pid = os.fork()
  if pid == 0:
    try:
      _code_child(spec, work, root_worker)
    except BaseException as e:  # reported as a sandbox error
      os.write(1, f"[sandbox setup failed: {type(e).__name__}: {e}]\n".encode())
    finally:
      os._exit(125)
  while True:  # reap everything (orphans come to PID 1) until the code itself has ended
    try:
      done, st = os.waitpid(-1, 0)
    except ChildProcessError:
      st = 125 << 8
      break
    if done == pid:
      break
  try:
    os.kill(-1, 9)  # whatever the code left running
  except OSError:
    pass
  _report(spec["status_fd"], st)


def _namespaces(spec, code):
  root_worker = os.geteuid() == 0
  r_up, w_up = os.pipe()  # S -> E: unshared (or why not)
  r_go, w_go = os.pipe()  # E -> S: maps written
  pid = os.fork()
  if pid == 0:  # S
    os.close(r_up)
    os.close(w_go)
    try:
      _unshare(NS_FLAGS, "unshare user/mount/pid/net/ipc/uts namespaces")
    except SetupError as e:
      os.write(w_up, str(e).encode())
      os._exit(125)
    os.write(w_up, b"ok")
    os.close(w_up)
    if os.read(r_go, 2) != b"ok":
      os._exit(125)
    os.close(r_go)
    p = os.fork()
    if p == 0:
      try:
        _supervise(spec, code, root_worker)
        os._exit(0)
      except BaseException as e:
        os.write(1, f"[sandbox setup failed: {type(e).__name__}: {e}]\n".encode())
        os._exit(125)
    _, st = os.waitpid(p, 0)
    os._exit(os.WEXITSTATUS(st) if os.WIFEXITED(st) else 125)
  os.close(w_up)
  os.close(r_go)
  up = os.read(r_up, 4096)
  if up != b"ok":
    os.waitpid(pid, 0)
    raise SetupError(up.decode(errors="replace") or "the namespace child died")
  try:
    _map_ids(pid, root_worker)
  except OSError as e:
    os.close(w_go)
    os.waitpid(pid, 0)
    raise SetupError(f"writing the uid/gid maps: {e}") from None
  os.write(w_go, b"ok")
  os.close(w_go)
  _, st = os.waitpid(pid, 0)
  os._exit(os.WEXITSTATUS(st) if os.WIFEXITED(st) else 125)


def _limits_only(spec, code):
  """No namespaces (allowed by the caller's config): limits, an empty directory, nobody for
  root, no inherited descriptors. The status pipe stays with this process."""
  work = os.path.dirname(spec["code_file"])
  root_worker = os.geteuid() == 0
  if root_worker:
    os.chown(work, NOBODY, NOBODY)
    os.chown(spec["code_file"], NOBODY, NOBODY)
  pid = os.fork()
  if pid == 0:
    try:
      _close_inherited()  # stays in the entry's process group: the caller's kill reaches it
      if root_worker:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
      _limits(spec)
      _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
      _exec_code(spec, work, ("/usr/bin/python3", "/usr/local/bin/python3"))
    except BaseException as e:
      os.write(1, f"[sandbox setup failed: {type(e).__name__}: {e}]\n".encode())
    finally:
      os._exit(125)
  _, st = os.waitpid(pid, 0)
  try:
    os.killpg(pid, 9)
  except OSError:
    pass
  _report(spec["status_fd"], st)


def main():
  spec = json.loads(sys.argv[1])
  if spec.get("cgroup"):  # before anything forks: every process of the call is counted
    _write(os.path.join(spec["cgroup"], "cgroup.procs"), str(os.getpid()))
  with open(spec["code_file"]) as f:
    code = f.read()
  if spec["mode"] == "namespaces":
    _namespaces(spec, code)
  else:
    _limits_only(spec, code)


if __name__ == "__main__":
  try:
    main()
  except Exception as e:  # reported to the model as a sandbox error, never raised further
    print(f"[sandbox setup failed: {type(e).__name__}: {e}]", flush=True)
    sys.exit(125)
