"""The fault-injection run, short (about 55 s on 2 cores): `python -m experiments.chaos.run`
with a learner and 2 workers and 20 s of faults (two learner SIGKILLs, one of them right after
an update with its asynchronous save in flight; a worker SIGKILL and connection cuts; a
full-disk window on the admission log; poison records). Every acknowledged record must be
used once, queued or dead-lettered; `make chaos` is the 10-minute run with 4 workers."""

import json
import os
import subprocess
import sys

from tests import XLA_TEST_FLAGS

# One device per child process.
ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=XLA_TEST_FLAGS)


def test_short_chaos_run_loses_and_duplicates_nothing(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "experiments.chaos.run", "--duration_s=20", "--workers=2",
       "--learner_kills=2", "--worker_faults=3", "--worker_kill_fraction=0.34",
       "--enospc_windows=1", "--enospc_s=4", "--poison_rounds=1", "--seed=1",
       f"--run_dir={tmp_path / 'run'}"],
      capture_output=True, text=True, env=ENV, timeout=600)
  lines = out.stdout.strip().splitlines()
  assert lines, out.stderr[-3000:]
  r = json.loads(lines[-1])
  print(json.dumps(r))
  assert out.returncode == 0, (r, out.stderr[-3000:])
  assert r["lost"] == 0 and r["duplicated"] == 0, r
  assert r["repeated_updates"] == 0 and r["updates_contiguous"]
  assert r["replay_matches_ledger"], r  # the real restart owes exactly what the ledger says
  f = r["faults"]
  assert f["learner_kill_after_update"] == 1 and f["learner_kill_random"] == 1
  assert f.get("worker_kill", 0) + f.get("connection_cut", 0) == 3
  assert f["enospc_window"] == 1 and f["poison_round"] == 1
  assert r["recovery_to_next_update_s"]["n"] == 2  # training went on after each kill
  # The full disk was hit (the window stays open until an append is refused), and survived.
  assert len(r["enospc_appends_refused"]) == 1 and r["enospc_appends_refused"][0] >= 1
  # The three invalid poison records were refused by name. The valid one that overflows the
  # update claims the version the learner last published: it was admitted (then dead-lettered
  # or still queued), or, when a kill sent the learner back to an older checkpoint before it
  # arrived, refused as future_version, or admitted by a send whose answer a cut or kill lost,
  # so that the resend was answered duplicate; a record sent again can collect several of
  # these answers (future_version from the restarted learner, then duplicate from the one that
  # had admitted it), admitted at most once. Either way no update used it.
  p = dict(r["poison_answers"])
  over = {k: p.pop(k) for k in list(p) if k.startswith("overflow:")}
  assert p == {"huge_reward:reward_out_of_range": 1, "oov_token:token_out_of_vocab": 1,
               "logp_floor:behavior_logp_below_floor": 1}, p
  assert over and set(over) <= {"overflow:admitted", "overflow:future_version",
                                "overflow:duplicate"}, over
  assert over.get("overflow:admitted", 0) <= 1, over
  assert r["overflow_poison_used"] == 0
  assert r["acknowledged"] == r["used"] + r["queued"] + r["dead_lettered"]
  assert r["used"] > 0
