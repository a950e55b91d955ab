"""The replication runner's parts: the digits task, demonstrations rendered as the agent loop
renders rollouts, exact policy lag, confidence intervals and verdicts, collapse detection."""

import math
import subprocess
import sys

import numpy as np
import pytest

from experiments.replication import comparisons as comps
from experiments.replication import driver, stats
from fr_jax import envs, sft
from fr_jax.envs.digits import Digits, first_digit
from fr_jax.models.tokenizer import Tokenizer
from tests.test_sft import _rollout


def test_t975_matches_printed_tables():
  # t_{0.975, df} from printed Student-t tables (3 decimals), and the normal limit 1.960.
  for df, t in [(1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042), (120, 1.980)]:
    assert stats.t975(df) == pytest.approx(t, abs=5e-4), df
  assert stats.t975(10**7) == pytest.approx(1.960, abs=5e-4)
  with pytest.raises(ValueError, match="df=0"):
    stats.t975(0)


def test_mean_ci_matches_hand_computation():
  ci = stats.mean_ci([1.0, 2.0, 3.0])
  # mean 2, sample sd 1, t_{0.975,2} = 4.303 (tables, 3 decimals): half-width 4.303 / sqrt(3).
  assert ci["mean"] == pytest.approx(2.0)
  assert ci["half"] == pytest.approx(4.303 / math.sqrt(3), abs=5e-4 / math.sqrt(3))
  assert ci["lo"] == pytest.approx(2.0 - 4.303 / math.sqrt(3), abs=5e-4 / math.sqrt(3))
  x = np.array([0.31, 0.42, 0.35, 0.50])
  ci = stats.mean_ci(x)
  sem = x.std(ddof=1) / 2.0
  assert ci["half"] == pytest.approx(3.182 * sem, abs=5e-4 * sem)
  assert stats.mean_ci([5.0])["half"] == 0.0
  with pytest.raises(ValueError):
    stats.paired([1.0], [1.0, 2.0])


def test_verdicts():
  d = stats.paired([0.5, 0.6, 0.55], [0.3, 0.35, 0.32])  # all +0.2ish: interval above 0
  assert stats.verdict(d, expect_positive=True) == "reproduces"
  assert stats.verdict(d, expect_positive=False) == "contradicts"
  d = stats.paired([0.5, 0.2, 0.6], [0.3, 0.4, 0.5])  # mean +0.033, interval spans 0
  assert stats.verdict(d, True) == "same direction, not significant"
  assert stats.verdict(d, False) == "not reproduced (no effect)"


def test_collapse_update():
  flat = [dict(version=i + 1, reward=0.5) for i in range(20)]
  assert comps.collapse_update(flat) == 21.0  # never: last version + 1
  crash = [dict(version=i + 1, reward=0.6 if i < 10 else 0.0) for i in range(20)]
  # The 5-update mean first drops below 0.3 when 3 of the 5 are zeros: versions 9..13 -> at 13.
  assert comps.collapse_update(crash) == 13.0
  assert comps.metric({"curve": crash}, "curve_last.reward") == 0.0
  assert comps.metric({"curve": crash}, "curve_max.reward") == 0.6


def test_digits_rewards_and_tool():
  env = envs.make("digits", tool=True)
  task = env.task("train", 3)
  d = task.answer
  assert str(d) not in task.prompt.split(":")[1]  # the secret is hidden with the tool
  ep = env.start(task)
  obs, done = ep.observe("? please")
  assert (obs, done) == (f"= {d}", False) and ep.tool_calls == 1
  obs, done = ep.observe(f"abc {d} {(d + 1) % 10}")  # the first digit is the answer
  assert done and ep.reward() == 1.0
  ep = env.start(task)
  ep.observe(f"{(d + 1) % 10}")
  assert ep.reward() == 0.0
  assert env.start(task).reward() == 0.0  # never answered (e.g. cut by the token limit)
  copy = Digits(tool=False)
  t = copy.task("test", 0)
  assert t.prompt.endswith(str(t.answer))
  ep = copy.start(t)
  assert ep.observe("?")[1]  # no tool: any turn is the answer
  assert first_digit("xx") is None and first_digit("a7b3") == 7
  train = {copy.task("train", i).task_id for i in range(300)}
  assert not train & {copy.task("test", i).task_id for i in range(copy.test_size)}


def test_demonstrations_render_like_rollouts():
  """Each warm-start conversation, rendered by `sft.render`, is token for token the rollout the
  agent loop makes when it plays the conversation's turns (a scripted engine) on its task; the
  conversation is scored as its answer says, and calls the tool only when asked to."""
  tok = Tokenizer.byte_level()
  saw = set()
  for tool in (True, False):
    env = Digits(tool=tool)
    for i in range(12):
      task, use_tool = env.task("train", i), i % 3 != 0
      msgs = env.demonstration(task, use_tool, correct_rate=0.5, max_filler=10)
      want = sft.render(tok, msgs, "chatml")
      turns = [m["content"] for m in msgs if m["role"] == "assistant"]
      traj, _ = _rollout(tok, env, task, turns, max_turns=3)
      assert traj.prompt_tokens.tolist() == want.prompt_tokens.tolist()
      assert traj.completion_tokens.tolist() == want.completion_tokens.tolist()
      assert traj.action_mask.tolist() == want.action_mask.tolist()
      assert turns[:-1] == (["?"] if tool and use_tool else [])
      assert traj.reward == float(first_digit(turns[-1]) == task.answer)
      saw.add((tool, len(turns), traj.reward))
  assert {(True, 2, 1.0), (True, 2, 0.0), (False, 1, 1.0), (False, 1, 0.0)} <= saw
  # The driver's mix: copy demonstrations in the tool task's at about copy_mix, tool calls in
  # about tool_rate of the rest.
  s = driver.Setting(tool=True, sft_steps=50, sft_batch=20, copy_mix=0.3, tool_rate=0.75)
  convs = driver.demonstrations(s, seed=0)
  copy = np.mean([m[0]["content"].count(" ") == 2 for m in convs])  # "key: abcd 7"
  calls = np.mean([m[1]["content"] == "?" for m in convs if m[0]["content"].count(" ") == 1])
  assert len(convs) == 1000 and abs(copy - 0.3) < 0.05 and abs(calls - 0.75) < 0.05


def test_driver_samples_at_the_exact_lag():
  s = driver.Setting(updates=5, batch_size=4, lag=2, eval_n=4, sft_steps=2, sft_batch=4,
                     max_new_tokens=6, delta=float("inf"), copy_check=0.0)
  r = driver.run(s, seed=0)
  lags = [p["policy_lag"] for p in r["curve"]]
  # Update t (0-based) learns from rollouts of version max(0, t - 2): lag = min(t, 2).
  assert lags == [0.0, 1.0, 2.0, 2.0, 2.0]
  assert [p["version"] for p in r["curve"]] == [1, 2, 3, 4, 5]
  assert r["rollouts"] == 20 and r["prompts_covered"] == 20
  g = driver.run(driver.Setting(updates=2, batch_size=4, group_size=2, minibatches=1,
                                loss="grpo", eval_n=4, sft_steps=2, sft_batch=4,
                                max_new_tokens=6, copy_check=0.0), seed=0)
  assert g["rollouts"] == 8 and g["prompts_covered"] == 4  # 2 prompts x G=2 per update


def test_rl_loop_curve_counts_rollouts_and_excludes_evaluation_time():
  import dataclasses
  import time

  from fr_jax.learner.learner import Learner
  from fr_jax.rollout.agent import AgentLoop
  from fr_jax.rollout.embedded import EmbeddedEngine
  s = driver.Setting(updates=3, batch_size=4, group_size=2, loss="grpo", eval_n=4,
                     sft_steps=2, sft_batch=4, max_new_tokens=6, copy_check=0.0)
  params0, _ = driver.warm_start(s, 0)
  model = dataclasses.replace(driver.load_model(0, s.width), params=params0)
  learner = Learner(driver.learner_config(s, 0), model=model)
  engine = EmbeddedEngine(model.config, params0, tokenizer=model.tokenizer, num_slots=8,
                          max_len=s.agent().engine_max_len)
  loop = AgentLoop(engine, model.tokenizer, s.env(), s.agent())
  seen = []

  def evaluate(point):  # an evaluation: 1 s that is not training time
    seen.append(dict(point))
    time.sleep(1.0)

  t0 = time.perf_counter()
  r = driver.rl_loop(learner, engine, loop, s.env(), updates=3, lag=0, batch_size=4, seed=0,
                     group_size=2, params0=params0, on_update=evaluate)
  elapsed = time.perf_counter() - t0
  learner.close()
  assert [p["rollouts"] for p in r["curve"]] == [4, 8, 12] and r["prompts_covered"] == 6
  assert seen == r["curve"]  # called after each update with its point
  walls = [p["wall_s"] for p in r["curve"]]
  assert walls == sorted(walls) and walls[-1] <= r["train_wall_s"]
  # the three 1-second evaluations are outside the clock, and nothing else is
  assert elapsed - 3.0 - 0.5 < r["train_wall_s"] < elapsed - 2.9


def test_runner_saves_each_run_and_resumes_an_unfinished_comparison(tmp_path):
  import dataclasses
  import json

  from experiments.replication import run as runner

  @dataclasses.dataclass(frozen=True)
  class Arm:  # an arm whose "run" is arithmetic on the seed: the runner's bookkeeping only
    offset: float
    speed: float  # training seconds per update
    updates: int = 2
    batch_size: int = 4
    lag: int = 0

    def run(self, seed, log=None):
      acc = 0.1 * seed + self.offset
      evals = [dict(version=v, rollouts=4 * v, wall_s=self.speed * v, accuracy=acc * v / 2)
               for v in (0, 1, 2)]
      return dict(seed=seed, start=dict(accuracy=0.0), end=dict(accuracy=acc),
                  gain=dict(accuracy=acc), evals=evals, wall_s=self.speed * 2 + seed,
                  curve=[dict(version=v, reward=acc, entropy=1.0, acceptance=1.0)
                         for v in (1, 2)])

  c = comps.Comparison("stub", "stub", "t", "p", {"a": Arm(0.5, 1.0), "b": Arm(0.2, 2.0)},
                       ("end.accuracy", "gain.accuracy"),
                       (comps.Claim("end.accuracy", "a", "b", True, "x"),
                        comps.Claim("equal_time.accuracy", "a", "b", True, "x")))
  calls = []
  res = runner.run_comparison(c, 2, on_run=lambda runs: calls.append(
      {arm: [r["seed"] for r in rs] for arm, rs in runs.items()}))
  assert calls == [{"a": [0], "b": []}, {"a": [0], "b": [0]}, {"a": [0, 1], "b": [0]},
                   {"a": [0, 1], "b": [0, 1]}]
  # --arms: only those arms run; the comparison stays unfinished (seeds -1), no summary.
  part = runner.run_comparison(c, 2, arms=("a",))
  assert part["seeds"] == -1 and [r["seed"] for r in part["runs"]["a"]] == [0, 1]
  assert part["runs"]["b"] == []
  # Resuming with seed 0 of both arms kept runs seed 1 only.
  have = {arm: [r for r in rs if r["seed"] == 0] for arm, rs in res["runs"].items()}
  calls.clear()
  res2 = runner.run_comparison(c, 2, have=have, on_run=lambda runs: calls.append(1))
  assert len(calls) == 2 and res2["runs"] == res["runs"]
  # The comparison's wall time is its runs' own seconds, kept ones included: a resumed
  # comparison (another session, another process) still reports all of them.
  assert math.isclose(res2["wall_s"], (2.0 + 4.0) * 2 + 1 + 1) and res2["wall_s"] == res["wall_s"]
  s = runner.summarise(c, res)
  assert math.isclose(s["arms"]["a"]["gain.accuracy"]["mean"], 0.55)
  assert math.isclose(s["claims"][0]["diff"]["mean"], 0.3)
  # At equal time (a's 2 s, when b has made 1 of its 2 updates): seed 0 0.5 vs 0.2 / 2,
  # seed 1 0.6 vs 0.3 / 2.
  assert math.isclose(s["claims"][1]["diff"]["mean"], (0.4 + 0.45) / 2)
  a0 = res["runs"]["a"][0]
  assert math.isclose(comps.at_time(a0, 0.5), 0.125)  # a quarter of the way to 0.5
  assert comps.at_time(a0, 9.0) == 0.5
  # An unfinished comparison (seeds -1) is saved but has no summary or table row.
  results = {"comparisons": {"fast": dict(res, wall_s=1.0),
                             "flash_vs_grpo": dict(res, seeds=-1, wall_s=0.0)}}
  results["comparisons"]["fast"]["runs"] = {
      "signed": res["runs"]["a"], "positive_only": res["runs"]["b"]}
  runner._write(results, tmp_path / "results.json", tmp_path)
  saved = json.loads((tmp_path / "results.json").read_text())["comparisons"]
  assert "summary" in saved["fast"] and "summary" not in saved["flash_vs_grpo"]
  md = (tmp_path / "results.md").read_text()
  assert comps.FAST.title in md and comps.get("flash_vs_grpo").title not in md
  runner.plot_evals("stub", res, tmp_path / "curves.png")
  assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_lag_study_drift_verdicts_and_paired_table():
  """Issue 56's drift criterion at its thresholds, and the report's lag 2 - lag 0 pairing."""
  from experiments.replication import lag_study as ls

  def fake(seed, acc, trunc, first, last, updates=24, at24=None):
    curve = [dict(version=v + 1, length=first if v < 8 else (last if v >= 16 else 30.0))
             for v in range(updates)]
    evals = [dict(version=0, accuracy=0.17), dict(version=24, accuracy=at24 or acc)]
    return dict(seed=seed, start=dict(accuracy=0.17), end=dict(accuracy=acc,
                truncation_rate=trunc), gain=dict(accuracy=acc - 0.17), curve=curve,
                evals=evals if updates == 24 or at24 else evals[:1])

  assert not ls.drift(fake(0, 0.3, 0.30, 30.0, 34.5))["drifted"]  # at both bounds exactly
  assert ls.drift(fake(0, 0.3, 0.31, 30.0, 20.0))["drifted"]  # truncation
  d = ls.drift(fake(0, 0.3, 0.1, 30.0, 34.6))  # length: 34.6 > 1.15 x 30
  assert d["drifted"] and math.isclose(d["length_rise"], 34.6 / 30.0)
  results = {"runs": {"base_lag2": {"0": fake(0, 0.30, 0.1, 30, 25),
                                    "1": fake(1, 0.20, 0.4, 30, 45)},
                      "base_lag0": {"0": fake(0, 0.35, 0.1, 30, 25),
                                    "1": fake(1, 0.34, 0.1, 30, 25)}}}
  md = ls.report(results)
  assert "| base_lag2 | 2 | 1 |" in md and "| base_lag0 | 2 | 0 |" in md
  diff = stats.paired([0.30, 0.20], [0.35, 0.34])  # -0.095, interval from the t table
  assert f"| base | 2 | {diff['mean']:+.3f} [{diff['lo']:+.3f}, {diff['hi']:+.3f}] |" in md
  assert "at update" not in md  # 24-update runs: one pairing
  # 36-update runs: paired at the end and at update 24 (from each run's evaluation there)
  results = {"runs": {"base_36u_lag2": {"0": fake(0, 0.40, 0.1, 30, 25, 36, at24=0.30),
                                        "1": fake(1, 0.36, 0.1, 30, 25, 36, at24=0.20)},
                      "base_36u_lag0": {"0": fake(0, 0.38, 0.1, 30, 25, 36, at24=0.33),
                                        "1": fake(1, 0.37, 0.1, 30, 25, 36, at24=0.29)}}}
  md = ls.report(results)
  end, at24 = stats.paired([0.40, 0.36], [0.38, 0.37]), stats.paired([0.30, 0.20], [0.33, 0.29])
  assert f"| base_36u | 2 | {end['mean']:+.3f} [{end['lo']:+.3f}, {end['hi']:+.3f}] |" in md
  assert (f"| base_36u, at update 24 | 2 | {at24['mean']:+.3f} [{at24['lo']:+.3f}, "
          f"{at24['hi']:+.3f}] |") in md
  assert "| base_36u_lag2 | 1 | 0.170 -> 0.360 | +0.190 | +0.030 |" in md
  assert ls.parse_seeds("0-3") == [0, 1, 2, 3] and ls.parse_seeds("2,5") == [2, 5]


def test_runner_rejects_bad_flags_with_a_clear_message(tmp_path):
  for args, msg in ((["--only=nope"], "unknown comparison 'nope'"),
                    (["--only=fast", "--seeds=1"], "--seeds=1"),
                    (["--only=headline_lm", "--flash_from=/nope.json"],
                     "--flash_from=/nope.json: no such file")):
    out = subprocess.run([sys.executable, "-m", "experiments.replication.run", *args,
                          f"--out={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and msg in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
  assert not (tmp_path / "results.json").exists()  # nothing was run or written


@pytest.mark.parametrize("variant", ["constlen_lr1e5_lag0", "constlen_lr1e5_lag2", "b64_lag0"])
def test_lag_study_configs_are_the_validated_run_configs(variant):
  """Both arms of a lag-study variant get the run config's derived fields: the synchronous
  arm builds its Learner from `run_config` directly, and with `constant_length` it died at
  the start (`objective.reduction=constant_length needs objective.length_norm > 0`) while
  the system arm, validated by the launcher's path, ran."""
  from experiments.replication.lag_study import VARIANTS
  from fr_jax.learner import config as lcfg
  c = VARIANTS[variant].run_config(3)
  assert lcfg.ensure_valid(c) is c
  if "constlen" in variant:  # the longest reply of a turn (fr_jax.config.validate)
    assert c.objective.length_norm == c.agent.max_new_tokens > 0


def test_make_demo_is_the_lag_studys_candidate_and_its_base_is_pinned():
  """Issue 56 chose `make demo`'s recipe from the lag study's `constlen_lr1e5_36u` runs: the
  demo's config (cpu_default, as `launch.train` validates it) is that variant's lag-2 run
  config in every field but the start-up FLOP/s probe, so its 8-seed figures are the demo's.
  The study's base stays the recipe it measured (sample_mean, lr 5e-6) whatever cpu_default
  says now."""
  from experiments.configs import cpu_default
  from experiments.replication.lag_study import VARIANTS, config_fields
  from fr_jax import config as rcfg

  demo = cpu_default.get_config()
  demo.env.seed = 3
  demo = config_fields(rcfg.validate(demo))
  study = config_fields(VARIANTS["constlen_lr1e5_36u_lag2"].run_config(3))
  assert {k for k in demo.keys() | study.keys() if demo.get(k) != study.get(k)} == {
      "log.peak_flops"}
  base = VARIANTS["base_lag2"].run_config(3)
  assert (base.objective.reduction, base.optim.lr) == ("sample_mean", 5e-6)


def test_headline_arms_read_off_the_demo_recipes_longer_runs():
  """`run.py --flash_from`: a 36-update lag-study run of make demo's recipe gives the
  headline arm its first 24 updates and its held-out evaluation at 24; a variant that is not
  the arm's recipe is refused by name; a figure an imported run lacks reads n/a."""
  import dataclasses

  from experiments.replication import lag_study as ls
  from experiments.replication import run as runner

  def fake(seed, sync):
    curve = [dict(version=v, reward=0.1 * v, acceptance=1.0, entropy=0.5, length=20.0,
                  truncation=0.0, rollouts=32 * v, wall_s=10.0 * v) for v in range(1, 37)]
    ev = [dict(version=v, rollouts=32 * v, wall_s=10.0 * v, accuracy=0.17 + v / 200,
               response_length=30 - v / 2, truncation_rate=0.01 * v) for v in (0, 12, 24, 36)]
    return dict(seed=seed, warm_start={}, start={"accuracy": 0.17}, end=ev[-1], evals=ev,
                curve=curve, cpu="test", settings=ls.settings(ls.VARIANTS[
                    f"{ls.DEMO_VARIANT}_lag{0 if sync else 2}"]))

  c = comps.get("headline_lm")
  results = {"runs": {f"{ls.DEMO_VARIANT}_lag2": {"0": fake(0, False), "1": fake(1, False)},
                      f"{ls.DEMO_VARIANT}_lag0": {"1": fake(1, True)}}}
  got = ls.headline_runs(results, c.arms, "study.json")
  a = got["flash_async"][1]
  assert [r["seed"] for r in got["flash_async"]] == [0, 1]
  assert [r["seed"] for r in got["flash_sync"]] == [1]
  assert len(a["curve"]) == 24 and a["curve"][-1]["version"] == 24
  assert a["end"] == dict(accuracy=0.17 + 24 / 200, response_length=18.0, truncation_rate=0.24)
  assert math.isclose(a["gain"]["accuracy"], 24 / 200)
  assert [e["version"] for e in a["evals"]] == [0, 12, 24]
  assert a["train_wall_s"] == a["wall_s"] == 240.0 and a["prompts_covered"] == 32 * 24
  assert got["flash_sync"][0]["prompts_covered"] is None
  assert a["imported_from"] == "study.json:constlen_lr1e5_36u_lag2:1, its first 24 updates"

  other = dict(c.arms, flash_sync=dataclasses.replace(
      c.arms["flash_sync"], overrides=(("optim.lr", 2e-5),)))
  with pytest.raises(ValueError, match=r"optim\.lr"):
    ls.headline_runs(results, other, "study.json")

  rec = runner.comparison_record(c, 1, dict(got, grpo_g8=[
      dict(got["flash_sync"][0], prompts_covered=95)]))
  rec["summary"] = runner.summarise(c, dict(rec, runs={k: v[:1] for k, v in rec["runs"].items()}))
  s = rec["summary"]["arms"]
  assert "prompts_covered" not in s["flash_sync"] and s["grpo_g8"]["prompts_covered"]["mean"] == 95
  row = next(line for line in runner.markdown({"comparisons": {"headline_lm": rec}}).splitlines()
             if line.startswith("| flash_sync |"))
  assert "| n/a |" in row
