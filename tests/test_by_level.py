"""experiments.agent_demo.by_level against hand-derived values."""

import json

import pytest

from experiments.agent_demo import by_level as bl


def _write(tmp_path, rows, tail=""):
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


UPDATE_1 = dict(step=1, traj_prompt_ids=["t:easy:1+2:0:", "t:easy:3+4:1:", "t:hard:1x2:0:",
                                         "t:hard:3x4:5:Tom"],
                traj_rewards=[1.0, 0.6, 0.0, 0.6], traj_tool_calls=[0, 1, 0, 2],
                traj_action_tokens=[5, 30, 10, 20])
UPDATE_2 = dict(step=2, traj_prompt_ids=["t:easy:1+1:0:", "t:hard:5x6:0:"],
                traj_rewards=[0.6, 0.6], traj_tool_calls=[1, 1], traj_action_tokens=[25, 25])


def test_by_level_hand_counts(tmp_path):
  # batch mean 0.55: A = +0.45, +0.05, -0.55, +0.05; sample_mean w = 1/5, 1/30, 1/10, 1/20
  _write(tmp_path, [{"step": 1, "loss": 0.0}, UPDATE_1, UPDATE_2], tail='{"step": 3, "traj')
  ups = bl.read_updates(tmp_path)  # the row without records and the torn line are skipped
  assert [u["step"] for u in ups] == [1, 2]
  assert bl.read_updates(tmp_path / "metrics.jsonl") == ups  # a file of rows reads the same
  rows = {(r["updates"], r["level"]): r for r in bl.by_level(ups, window=1)}
  easy, hard, every = rows[("1-1", "easy")], rows[("1-1", "hard")], rows[("1-1", "all")]
  assert (easy["n"], easy["calls"], easy["reward_call"], easy["reward_direct"]) == (2, 0.5, 0.6,
                                                                                   1.0)
  assert easy["push"] == pytest.approx(0.05 / 30 - 0.45 / 5)
  assert hard["push"] == pytest.approx(0.05 / 20 + 0.55 / 10)
  assert every["push"] == pytest.approx((0.05 / 30 + 0.05 / 20) / 2 - (0.45 / 5 - 0.55 / 10) / 2)
  assert easy["A_direct"] == pytest.approx(0.45) and hard["A_direct"] == pytest.approx(-0.55)
  # update 2: every reply called, so there is no choice to push
  assert rows[("2-2", "easy")]["push"] is None and rows[("2-2", "easy")]["calls"] == 1.0
  assert rows[("2-2", "all")]["reward_direct"] is None
  # constant_length, L = 10: every w = 1/10
  rows = {(r["updates"], r["level"]): r
          for r in bl.by_level(ups, window=2, reduction="constant_length", length_norm=10.0)}
  assert rows[("1-2", "easy")]["n"] == 3 and rows[("1-2", "easy")]["calls"] == pytest.approx(2 / 3)
  # calls: A = +0.05 (update 1) and 0 (update 2, mean 0.6); alone: +0.45
  assert rows[("1-2", "easy")]["push"] == pytest.approx((0.005 + 0.0) / 2 - 0.045)


def test_by_level_refuses_runs_without_records(tmp_path):
  with pytest.raises(SystemExit, match="no such file"):
    bl.read_updates(tmp_path)
  _write(tmp_path, [{"step": 1, "loss": 0.0, "traj_ids": ["w/0"]}])
  with pytest.raises(SystemExit, match="no update carries its records"):
    bl.read_updates(tmp_path)
  with pytest.raises(ValueError, match="reduction"):
    bl.by_level([UPDATE_1], reduction="mean")


def test_by_level_orders_the_bins_from_easy_to_hard():
  up = dict(UPDATE_1, traj_prompt_ids=["t:hard:1x2:0:", "t:zeta:1:0:", "t:mul21:1x2:0:",
                                       "t:easy:1+2:0:"])
  assert [r["level"] for r in bl.by_level([up])] == ["easy", "mul21", "hard", "zeta", "all"]
