r"""One process of the weight_relay benchmark's 2-process learner: the learner's weight side
without its training (the benchmark's machine cannot train the 1.5B shapes).

  python -m experiments.benchmarks.shard_hosts --params_dir=DIR --model=random:NAME \
      --dtype=bfloat16 --num_processes=2 --process_id=I --coordinator=127.0.0.1:PORT

The processes form one `jax.distributed` group (gloo) with one CPU device each, and place
the benchmark's random parameters (memory-mapped .npy files in DIR, written by
weight_relay.random_params) on a (data=1, fsdp=2) mesh with the learner's shardings: each
process holds only its half. Each runs a `ShardHost` over its own pieces
(`hf_shards.local_pieces`, as `Learner.publish_shards` does) behind a shard server; process 0
also serves the learner's gRPC service (heartbeats with the version and `GetManifest`, the
stand-in `tests.sglang_standin.PublishedWeights` with shards), and learns the other's address
through the coordinator (`Group.put_signed`). Commands on stdin, one per line:

  publish V dense|sparse|lora
                            make version V from the current weights and publish it. dense:
                            every element's low 7 mantissa bits change at random (a delta
                            cannot help); sparse: 0.7% of the elements move by one unit in
                            the last place, the rate measured between two versions of the
                            demo run (experiments/benchmarks/weight_delta.py); lora: as
                            dense, in the LoRA adapters' pieces only (--lora_rank > 0)
  stats                     print {"sent_bytes": ..., "sent": ...} (this host's egress)
  quit

Process 0 prints `serving PORT` once ready and `published V` once every process has V; the
others print `published V` when theirs is in.
"""

import argparse
import json
import sys


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--params_dir", required=True)
  p.add_argument("--model", required=True)
  p.add_argument("--dtype", default="bfloat16", help="the parameters' dtype")
  p.add_argument("--wire_dtype", default="bfloat16", help="the servers' (service.wire_dtype)")
  p.add_argument("--lora_rank", type=int, default=0,
                 help="LoRA adapters of this rank on every projection (alpha = 2 rank)")
  p.add_argument("--num_processes", type=int, default=2)
  p.add_argument("--process_id", type=int, required=True)
  p.add_argument("--coordinator", required=True)
  a = p.parse_args()

  import jax
  jax.config.update("jax_num_cpu_devices", 1)
  import numpy as np

  from fr_jax.learner import mesh as meshlib
  from fr_jax.learner import multihost
  from fr_jax.models import decoder, hf_shards, registry
  from fr_jax.transport import codec, shards
  from fr_jax.transport import server as srv
  multihost.initialize(a.coordinator, a.num_processes, a.process_id, secret="bench")
  group = multihost.Group()
  lora = dict(lora_rank=a.lora_rank, lora_alpha=2.0 * a.lora_rank,
              lora_targets=("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
  cfg = registry.shape_config(a.model.removeprefix("random:"), param_dtype=a.dtype,
                              **(lora if a.lora_rank else {}))
  names = list(codec.flatten(decoder.param_shapes(cfg)))
  from fr_jax.models.hf_io import _np_dtype
  dt = _np_dtype(a.dtype)  # .npy stores bfloat16 as raw 2-byte records
  host_params = codec.unflatten({n: np.load(f"{a.params_dir}/{i}.npy", mmap_mode="r").view(dt)
                                 for i, n in enumerate(names)})
  mesh = meshlib.make_mesh(1, a.num_processes)
  params = meshlib.put(host_params, meshlib.params_sharding(host_params, mesh))
  manifest = hf_shards.manifest_of(params, cfg, a.wire_dtype)
  host = shards.ShardHost(a.wire_dtype)
  rng = np.random.default_rng(a.process_id)
  noise = rng.integers(0, 128, 1 << 25, dtype=np.uint16)  # 64 MB: beyond zstd's window
  pieces = hf_shards.local_pieces(params, cfg, manifest, a.process_id)
  del params, host_params  # the pieces are this process's copy from here on
  host.put(1, manifest, pieces)

  def publish(v: int, how: str) -> None:
    nonlocal pieces
    moved = {i for i in pieces
             if how != "lora" or manifest.pieces[i].tensor in manifest.adapters}
    if how == "lora" and not manifest.adapters:
      raise SystemExit("publish lora: this model has no adapters (--lora_rank)")
    pieces = {i: b.copy() if i in moved else b for i, b in pieces.items()}
    at = v * 7919  # where in the noise this version starts
    for b in (pieces[i] for i in moved):
      flat = b.reshape(-1).view(np.uint16)
      if how in ("dense", "lora"):  # the noise, cyclically from `at`
        k = 0
        while k < flat.size:
          start = at % noise.size
          n = min(flat.size - k, noise.size - start)
          flat[k:k + n] ^= noise[start:start + n]
          k, at = k + n, at + n
      else:
        idx = rng.integers(0, flat.size, max(1, flat.size * 7 // 1000))  # (a repeat: a bit less)
        flat[idx] ^= 1
    host.put(v, manifest, pieces)

  if a.process_id == 0:
    from tests.sglang_standin import PublishedWeights
    service = PublishedWeights()
    service.shards = host
    server, port = srv.serve(service)
    host.hosts = [""] + [group.get_signed(f"shards/{i}").decode()
                         for i in range(1, a.num_processes)]
    service.publish(1, None)
    print(f"serving {port}", flush=True)
  else:
    server, port = srv.serve_shards(host)
    group.put_signed(f"shards/{a.process_id}", f"127.0.0.1:{port}".encode())
  for line in sys.stdin:
    cmd = line.split()
    if not cmd:
      continue
    if cmd[0] == "publish":
      v = int(cmd[1])
      publish(v, cmd[2])
      if a.process_id == 0:
        service.publish(v, None)
      print(f"published {v}", flush=True)
    elif cmd[0] == "stats":
      print(json.dumps({"sent_bytes": host.sent_bytes, "sent": dict(host.sent)}), flush=True)
    elif cmd[0] == "quit":
      if a.process_id == 0:
        service.shutdown.set()
        print("shutdown", flush=True)
      else:
        break
    elif cmd[0] == "exit":
      break
  srv.stop(server, grace=1.0)


if __name__ == "__main__":
  main()
