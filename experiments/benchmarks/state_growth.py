r"""A long run's learner state: checkpoint size and learner memory stay flat after warm-up.

  python -m experiments.benchmarks.state_growth                # 1,000 updates of B = 16
  python -m experiments.benchmarks.state_growth --updates=200  # quicker

The tiny model trains through the real LearnerService with the admission log and
asynchronous checkpoints every 50 updates. A feeder thread plays `--producers` workers that
each restart (a new id nonce, so a new producer) every `--restart_every` records, the churn a
fleet sees. At the report points it prints JSON lines with the learner process's RSS, the
newest committed checkpoint's size (all of it, and its JSON part, which holds the producer
watermarks), the admission log's size, and the producer table. For comparison each line also
gives the size the earlier design's list of every used trajectory id would have had in the
checkpoint at that point.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import uuid

from absl import app, flags

from experiments.benchmarks.common import emitter, machine

flags.DEFINE_integer("updates", 1000, "updates to run")
flags.DEFINE_integer("batch", 16, "B")
flags.DEFINE_integer("producers", 8, "simulated workers")
flags.DEFINE_integer("restart_every", 400, "records per worker before it restarts")
flags.DEFINE_list("report_at", ["50", "100", "250", "500", "750", "1000"], "updates to report")
FLAGS = flags.FLAGS


def dir_bytes(path) -> int:
  return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def main(argv):
  del argv
  import psutil

  from experiments.configs import tiny_test
  from fr_jax import system
  from fr_jax.learner.synthetic import synthetic_trajectory
  from fr_jax.transport import codec
  emit = emitter("state_growth")
  emit("machine", **machine())
  run = tempfile.mkdtemp(prefix="fr_jax_state_")
  c = tiny_test.get_config()
  c.update_from_flattened_dict({
      "run_dir": run, "batch_size": FLAGS.batch, "max_updates": FLAGS.updates,
      "checkpoint.every": 50, "checkpoint.async_save": True, "checkpoint.keep": 3,
      "service.queue_capacity": 4 * FLAGS.batch, "log.peak_flops": 1e11})
  emit("settings", updates=FLAGS.updates, batch=FLAGS.batch, producers=FLAGS.producers,
       restart_every=FLAGS.restart_every, checkpoint_every=50, run_dir=run)
  learner, service = system.build_service(c, admission_log=True)
  stop = threading.Event()
  used_ids_bytes = [2]  # json.dumps(sorted(ids)) of the earlier design: "[" + ids + "]"

  def feed():
    i = 0
    nonces = [uuid.uuid4().hex[:8] for _ in range(FLAGS.producers)]
    counts = [0] * FLAGS.producers
    while not stop.is_set():
      k = i % FLAGS.producers
      if counts[k] == FLAGS.restart_every:
        nonces[k], counts[k] = uuid.uuid4().hex[:8], 0
      t = synthetic_trajectory(i, seed=k, vocab_size=300, version=service.version)
      t.traj_id = f"worker-{k}/{nonces[k]}/{counts[k]}"
      ok, why = False, "queue_full"
      while why == "queue_full" and not stop.is_set():
        ok, why = service.offer(t, timeout=0.5, raw=codec.encode_record(t))
      counts[k] += 1
      i += 1

  feeder = threading.Thread(target=feed, daemon=True)
  feeder.start()
  proc = psutil.Process()
  report = {int(x) for x in FLAGS.report_at}
  t0 = time.time()

  def on_update(m, s):
    used_ids_bytes[0] += sum(len(json.dumps(i)) + 2 for i in m["traj_ids"])
    v = s.version
    if v not in report:
      return
    ck = learner.checkpointer
    step = ck.committed_step()
    ck_dir = os.path.join(ck.dir, str(step)) if step is not None else None
    emit("point", update=v, wall_s=round(time.time() - t0, 1),
         learner_rss_mb=round(proc.memory_info().rss / 2**20, 1),
         committed_checkpoint=step,
         checkpoint_bytes=dir_bytes(ck_dir) if ck_dir else None,
         checkpoint_json_bytes=dir_bytes(os.path.join(ck_dir, "meta")) if ck_dir else None,
         admission_log_bytes=s.log.size_bytes, admission_log_records=len(s.log),
         producers=len(s.producers), producers_evicted=s.producers.evicted,
         queue_depth=len(s.queue),
         earlier_design_used_ids_json_bytes=used_ids_bytes[0] - 2 * (v > 0))

  summary = service.run(FLAGS.updates, on_update=on_update)
  stop.set()
  service.close()
  learner.close()
  emit("summary", updates=summary["updates"], trajectories_used=summary["trajectories_used"],
       producers=summary["producers"], wall_s=round(time.time() - t0, 1))


if __name__ == "__main__":
  app.run(main)
