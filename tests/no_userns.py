"""Runs a command in a user namespace that allows no further user namespaces: what a kernel
or container that refuses them looks like to the sandbox (a real refusal, ENOSPC from
unshare, confined to this throwaway namespace). Stdlib only.

  python tests/no_userns.py PROGRAM [ARGS...]

As root the namespace maps root and nobody (the sandbox's two users); as anyone else it maps
only the caller's own uid, and PROGRAM runs as that ordinary user, without capabilities."""

import os
import sys


def main():
  r_up, w_up = os.pipe()
  r_go, w_go = os.pipe()
  pid = os.fork()
  if pid == 0:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
      os.write(w_up, b"no")
      os._exit(3)
    os.write(w_up, b"ok")
    os.read(r_go, 2)
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
      f.write("0")
    os.execv(sys.argv[1], sys.argv[1:])
  if os.read(r_up, 2) != b"ok":
    sys.exit("no_userns: unshare(CLONE_NEWUSER) refused")
  uid, gid = os.geteuid(), os.getegid()
  if uid == 0:
    maps = {"uid_map": "0 0 1\n65534 65534 1\n", "gid_map": "0 0 1\n65534 65534 1\n"}
  else:
    with open(f"/proc/{pid}/setgroups", "w") as f:
      f.write("deny")
    maps = {"uid_map": f"{uid} {uid} 1\n", "gid_map": f"{gid} {gid} 1\n"}
  for name, text in maps.items():
    with open(f"/proc/{pid}/{name}", "w") as f:
      f.write(text)
  os.write(w_go, b"ok")
  _, st = os.waitpid(pid, 0)
  sys.exit(os.waitstatus_to_exitcode(st))


if __name__ == "__main__":
  main()
