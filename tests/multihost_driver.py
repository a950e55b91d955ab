"""One process of a (possibly multi-process) learner, for the multi-host equality test.

  python -m tests.multihost_driver --workdir=DIR --until=N --local_devices=4 \
      --num_processes=2 --process_id=I --coordinator=127.0.0.1:PORT

Each process sees `local_devices` CPU devices; with `num_processes` > 1 they form one global
(data=2, fsdp=4) mesh through `jax.distributed` with gloo collectives. Process 0 runs the
learner service: it restores the latest checkpoint in DIR, then until version N offers the
synthetic records of each version (records v*B .. v*B+B-1: what a version trains on does not
depend on how the run was split), and the service updates, saves a checkpoint and publishes
weights after each one. The other processes follow. Process 0 writes the final weights
(gathered: `snapshot_params`) to DIR/params.npz. Every process also serves its own pieces of
each published version in bfloat16 (`fr_jax.transport.shards`, as launch.learner does);
process 0 fetches the last one from all of them like a weight relay, into
DIR/shards.safetensors.
"""

import argparse
import json
import os
import sys

B = 8


def config(workdir, fsdp):
  from fr_jax.learner import config as lcfg
  c = lcfg.default_config()
  c.model.name = "tiny-qwen2"
  c.batch_size = B
  c.mesh.data, c.mesh.fsdp = 8 // fsdp, fsdp
  c.packing.row_len = 64
  c.packing.row_buckets = (8, 16)
  c.objective.delta = float("inf")
  c.optim.lr = 3e-3
  c.optim.total_steps = 20
  c.checkpoint.dir = f"{workdir}/ckpt"
  c.checkpoint.every = 1
  c.checkpoint.keep = 2
  c.log.dir = workdir
  c.log.peak_flops = 1e11
  return c


def flat_params(params) -> dict:
  import jax
  import numpy as np
  return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(a)
          for path, a in jax.tree_util.tree_flatten_with_path(params)[0]}


def run(workdir: str, until: int, fsdp: int = 4) -> dict:
  """The learner (process 0 leads, others follow) until version `until`; on process 0
  returns the published weights as {name: array} with "version" (they are also written to
  workdir/params.npz), elsewhere {}."""
  import threading

  import numpy as np

  from fr_jax.learner import multihost, synthetic
  from fr_jax.learner.learner import Learner
  from fr_jax.learner.service import LearnerService
  from fr_jax.transport import codec, shards
  from fr_jax.transport import server as srv

  learner = Learner(config(workdir, fsdp))
  learner.shard_sink = host = shards.ShardHost("bfloat16")
  shard_server, port = srv.serve_shards(host)
  if not learner.is_leader:
    learner.group.put_signed(f"shards/{learner.group.process_id}", f"127.0.0.1:{port}".encode())
    multihost.follow(learner)
    srv.stop(shard_server)
    return {}
  addresses = [f"127.0.0.1:{port}"] + (
      [learner.group.get_signed(f"shards/{i}").decode()
       for i in range(1, learner.group.num_processes)] if learner.group else [])
  service = LearnerService(learner, queue_capacity=4 * B, publish_every=1,
                           encode=codec.encode_record, decode=codec.decode_record)
  service.restore()
  stop = threading.Event()
  while service.version < until:
    v = service.version
    for i in range(v * B, (v + 1) * B):
      t = synthetic.synthetic_trajectory(i, vocab_size=learner.model_config.vocab_size,
                                         max_len=60, version=v)
      t.traj_id = f"synthetic/{i}"
      ok, why = service.offer(t)
      assert ok, why
    service.step(service.next_batch(stop))
  service.save(force=True)
  v, params = service.version, learner.snapshot_params()
  out = dict(flat_params(params), version=np.int64(v))
  np.savez(os.path.join(workdir, "params.npz"), **out)
  learner.wait_shards()  # the other process's pieces: its shard server waits for them
  fetch_shards(host, addresses, v, os.path.join(workdir, "shards.safetensors"))
  service.close()
  learner.close()
  srv.stop(shard_server)
  return out


def fetch_shards(host, addresses, version, path) -> None:
  """Version `version`'s pieces from every process's shard server, into one file."""
  from fr_jax.transport import shard_fetch
  from fr_jax.transport.client import WeightsClient
  client = WeightsClient(addresses[0])
  try:
    vf = shard_fetch.VersionFile(path, host.manifest(version), version)
    got = shard_fetch.fetch(vf, [shard_fetch.Source("hosts", hosts=tuple(addresses))],
                       lambda a, v, p, b: client.open_shards(a, v, p, b, timeout=120))
    assert got["failures"] == {}, got
    vf.close()
    with open(os.path.splitext(path)[0] + ".log", "w") as f:  # bytes by source
      f.write(json.dumps(dict(vf.received)))
  finally:
    client.close()


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True, help="checkpoints, metrics, params.npz")
  p.add_argument("--until", type=int, default=5, help="train until this policy version")
  p.add_argument("--local_devices", type=int, default=8, help="CPU devices in this process")
  p.add_argument("--num_processes", type=int, default=1, help="processes in the learner")
  p.add_argument("--process_id", type=int, default=0, help="this process")
  p.add_argument("--coordinator", default="", help="jax.distributed coordinator host:port")
  p.add_argument("--fsdp", type=int, default=4, help="mesh fsdp axis (data = 8 / fsdp)")
  a = p.parse_args()
  import jax
  jax.config.update("jax_num_cpu_devices", a.local_devices)
  from fr_jax.learner import multihost
  if a.num_processes > 1:
    multihost.initialize(a.coordinator, a.num_processes, a.process_id)
  out = run(a.workdir, a.until, a.fsdp)
  if out:
    print(f"version {int(out['version'])}", file=sys.stderr)


if __name__ == "__main__":
  main()
