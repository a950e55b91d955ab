r"""sglang-router in front of SGLang servers that require an API key, with the key kept off
every command line.

  export SGLANG_API_KEY=<the servers' key>
  python -m launch.router --worker-urls http://s0:30000 http://s1:30000 --host 0.0.0.0 \
      --port 30001 [any other sglang_router.launch_router flag]

The arguments are sglang_router's own (`python -m sglang_router.launch_router --help`). The
key is read from $SGLANG_API_KEY and handed to the router in this process: the router then
refuses clients that do not present it (HTTP 401) and presents it to the servers. Passed as
`--api-key` on a command line it would be readable by every user of the host (`ps`).
Without $SGLANG_API_KEY it refuses to start; `--allow_no_key` runs an open router (a
loopback test).
"""

import os
import sys

KEY_ENV = "SGLANG_API_KEY"


def router_argv(argv: list[str], env=os.environ) -> list[str]:
  """sglang_router's arguments: `argv` plus the key from `env` (ValueError without one, or
  with --api-key on the command line)."""
  if any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
    raise ValueError("give the key in $SGLANG_API_KEY, not --api-key (a command line is "
                     "readable by every user of the host)")
  if "--allow_no_key" in argv:
    return [a for a in argv if a != "--allow_no_key"]
  key = env.get(KEY_ENV, "")
  if not key:
    raise ValueError(f"export {KEY_ENV}=<the SGLang servers' --api-key> first (or pass "
                     "--allow_no_key for an open router on loopback)")
  return [*argv, "--api-key", key]


def main() -> None:
  try:
    argv = router_argv(sys.argv[1:])
  except ValueError as e:
    print(f"launch.router: {e}", file=sys.stderr)
    sys.exit(2)
  from sglang_router.launch_router import launch_router, parse_router_args
  launch_router(parse_router_args(argv))


if __name__ == "__main__":
  main()
