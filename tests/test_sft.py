"""The supervised warm start: SFT data renders token for token like a rollout of the same
conversation (the real agent loop, a scripted policy and the real sandboxed tool), the SFT
loss is the mean negative log-likelihood of the assistant tokens (against a NumPy
log-softmax over each conversation scored alone), an interrupted warm start resumes to the
same parameters as an uninterrupted one, and the priced tool's reward by hand."""

import dataclasses
import json
import math
import threading

import jax
import numpy as np
import pytest

from fr_jax import config as rcfg
from fr_jax import envs, sft
from fr_jax.learner.learner import Learner
from fr_jax.models import decoder, registry
from fr_jax.models.tokenizer import Tokenizer
from fr_jax.rollout.agent import AgentConfig, AgentLoop
from fr_jax.rollout.engine import Completion
from tests.helpers import forward


class ScriptedEngine:
  """Plays fixed assistant turns (a test double of the engine, not a model): each turn's text
  is tokenised as a model would sample it and closed with <|im_end|>."""

  version = 0

  def __init__(self, tok, turns):
    self.tok, self.turns = tok, list(turns)

  def generate(self, requests, should_abort=None):
    out = []
    for r in requests:
      ids = self.tok.encode(self.turns.pop(0)) + [self.tok.token_id("<|im_end|>")]
      out.append(Completion(r.request_id, ids, [-0.5] * len(ids), "stop", [0] * len(ids)))
    return out


def _rollout(tok, env, task, turns, template="chatml", max_turns=4):
  loop = AgentLoop(ScriptedEngine(tok, turns), tok, env,
                   AgentConfig(max_turns=max_turns, max_total_tokens=4096, template=template))
  (traj,), (ep,) = loop.run([task], [0])
  return traj, ep


@pytest.fixture(scope="module")
def smol_tok(smol_tokenizer):
  return smol_tokenizer


@pytest.mark.parametrize("template", ["chatml", "model"])
@pytest.mark.parametrize("use_tool", [True, False])
def test_sft_data_renders_like_a_rollout(smol_tok, template, use_tool):
  env = envs.make("tool_arithmetic")
  for k in range(4):
    task = env.task("train", k)
    msgs = env.demonstration(task, use_tool)
    want = sft.render(smol_tok, msgs, template, "c")
    # The rollout: the assistant turns played by the loop, the tool really run.
    traj, ep = _rollout(smol_tok, env, task, [m["content"] for m in msgs
                                              if m["role"] == "assistant"], template)
    assert traj.prompt_tokens.tolist() == want.prompt_tokens.tolist()
    assert traj.completion_tokens.tolist() == want.completion_tokens.tolist()
    assert traj.action_mask.tolist() == want.action_mask.tolist()
    assert (traj.num_tool_calls, traj.num_turns) == (want.num_tool_calls, want.num_turns)
    assert ep.score == 1.0  # the demonstration is right


def test_sft_render_of_a_wrong_tool_output_differs(smol_tok):
  """The tool turn must hold what the tool prints (with its newline): a demonstration that
  drops it does not render like the rollout, and the comparison above would catch it."""
  env = envs.make("tool_arithmetic")
  task = env.task("train", 0)
  msgs = env.demonstration(task, True)
  msgs[3] = {"role": "tool", "content": str(task.answer)}  # no trailing newline
  traj, _ = _rollout(smol_tok, env, task, [msgs[2]["content"], msgs[4]["content"]])
  assert sft.render(smol_tok, msgs, "chatml").completion_tokens.tolist() != \
      traj.completion_tokens.tolist()


def test_sft_observation_turns_render_like_an_interactive_rollout():
  tok = Tokenizer.byte_level()
  env = envs.make("textworld")
  task = env.task("train", 0)
  turns = ["look", "go north", "take key"]
  traj, ep = _rollout(tok, env, task, turns, max_turns=3)
  # Rebuild the conversation from the rollout's text: observations are user turns.
  loop = AgentLoop(None, tok, env, AgentConfig(max_turns=3, max_total_tokens=4096,
                                              template="chatml"))
  env_ep, msgs = env.start(task), []
  if env.system_prompt:
    msgs.append({"role": "system", "content": env.system_prompt})
  msgs.append({"role": "user", "content": task.prompt})
  for i, t in enumerate(turns):
    msgs.append({"role": "assistant", "content": t})
    obs, done = env_ep.observe(t)
    if done or i == len(turns) - 1:
      break
    msgs.append({"role": "user", "content": obs})
  del loop
  want = sft.render(tok, msgs, "chatml")
  assert traj.completion_tokens.tolist() == want.completion_tokens.tolist()
  assert traj.action_mask.tolist() == want.action_mask.tolist()


def test_sft_data_errors_name_the_line(tmp_path):
  p = tmp_path / "d.jsonl"
  good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "4"}]}
  p.write_text(json.dumps(good) + "\n" + json.dumps({"messages": [
      {"role": "user", "content": "hi"}]}) + "\n")
  with pytest.raises(sft.SFTDataError, match=r"d.jsonl:2: no assistant turn"):
    sft.read_jsonl(p)
  p.write_text("{not json\n")
  with pytest.raises(sft.SFTDataError, match=r"d.jsonl:1: not JSON"):
    sft.read_jsonl(p)
  # Bytes that are not UTF-8, nesting that exhausts the parser, a folder: each one named
  # (they used to escape as UnicodeDecodeError, RecursionError and IsADirectoryError).
  p.write_bytes(json.dumps(good).encode() + b"\n" + b'{"messages": "\xff\xfe"}\n')
  with pytest.raises(sft.SFTDataError, match=r"d.jsonl:2: not UTF-8"):
    sft.read_jsonl(p)
  p.write_text("[" * 100_000 + "]" * 100_000 + "\n")
  with pytest.raises(sft.SFTDataError, match=r"d.jsonl:1: nested too deeply"):
    sft.read_jsonl(p)
  with pytest.raises(sft.SFTDataError, match=r"cannot read .*Is a directory"):
    sft.read_jsonl(tmp_path)
  with pytest.raises(sft.SFTDataError, match="last message must be an assistant"):
    sft.check_conversation([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                            {"role": "tool", "content": "c"}])
  with pytest.raises(sft.SFTDataError, match="alternate"):
    sft.check_conversation([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                            {"role": "assistant", "content": "c"}])


@pytest.mark.parametrize("turns, score, reward, calls", [
    (["{easy}"], 1.0, 1.0, 0),  # easy, answered directly
    (["{easy_wrong}"], 0.0, 0.0, 0),
    (["{call}", "{hard}"], 1.0, 0.9, 1),  # hard, one call
    (["{call}", "{call}", "{hard}"], 1.0, 0.8, 2),  # two calls
    (["{call}", "{hard_wrong}"], 0.0, -0.1, 1),
    (["<tool_call>\n{oops\n</tool_call>", "{hard}"], 1.0, 0.9, 1),  # a malformed call is charged
])
def test_tool_cost_reward_by_hand(smol_tok, turns, score, reward, calls):
  env = envs.make("tool_arithmetic", tool_cost=0.1)
  hard = next(t for t in (env.task("train", i) for i in range(50)) if t.meta["level"] == "hard")
  easy = next(t for t in (env.task("train", i) for i in range(50)) if t.meta["level"] == "easy")
  task = hard if any("hard" in t for t in turns) else easy
  m = task.meta
  fill = dict(easy=str(easy.answer), easy_wrong=str(easy.answer + 1), hard=str(hard.answer),
              hard_wrong=str(hard.answer + 1),
              call=('<tool_call>\n{"name": "python", "arguments": {"code": "print('
                    f'{m.get("a", 0)} * {m.get("b", 0)}'
                    ')"}}\n</tool_call>'))
  traj, ep = _rollout(smol_tok, env, task, [t.format(**fill) if "{" in t[:2] else t
                                            for t in turns])
  assert ep.score == score
  assert traj.reward == pytest.approx(reward, abs=1e-12)
  assert traj.num_tool_calls == calls


def test_tool_arithmetic_levels_and_splits():
  env = envs.make("tool_arithmetic", hard_fraction=0.5)
  test = [env.task("test", i) for i in range(env.test_size)]
  train_ids = {env.task("train", i).task_id for i in range(2000)}
  assert not train_ids & {t.task_id for t in test}
  assert [t.meta["level"] for t in test[:4]] == ["easy", "hard", "easy", "hard"]
  for t in test:
    a, b = t.meta["a"], t.meta["b"]
    if t.meta["level"] == "easy":
      assert 1 <= a <= 9 and 1 <= b <= 9 and t.answer == a + b <= 9
    else:
      assert 100 <= a <= 999 and 10 <= b <= 99 and t.answer == a * b


def test_tool_arithmetic_difficulty_bins():
  """`levels` (issue 60): the test split takes the bins in turn, each item's operands are
  its bin's (hand-stated ranges), train and test stay disjoint, train draws every bin about
  equally, the tool-less variant's system turn offers no tool, and unknown bins are refused."""
  from fr_jax.envs.arithmetic import CONTINUUM
  env = envs.make("tool_arithmetic", levels=CONTINUUM)
  test = [env.task("test", i) for i in range(env.test_size)]
  assert [t.meta["level"] for t in test] == list(CONTINUUM) * 20
  train = [env.task("train", i) for i in range(2000)]
  assert not {t.task_id for t in train} & {t.task_id for t in test}
  counts = {lv: sum(t.meta["level"] == lv for t in train) for lv in CONTINUUM}
  assert all(340 <= c <= 460 for c in counts.values()), counts
  for t in test + train:
    a, b, lv = t.meta["a"], t.meta["b"], t.meta["level"]
    ok = {"easy": 1 <= a <= 9 and 1 <= b <= 9 and t.answer == a + b <= 9,
          "add1c": 1 <= a <= 9 and 1 <= b <= 9 and t.answer == a + b >= 10,
          "add2": 10 <= a <= 99 and 10 <= b <= 99 and t.answer == a + b,
          "mul21": 10 <= a <= 99 and 2 <= b <= 9 and t.answer == a * b,
          "hard": 100 <= a <= 999 and 10 <= b <= 99 and t.answer == a * b}[lv]
    assert ok, t
  assert "tool" in env.system_prompt
  assert dataclasses.replace(env, tools=()).system_prompt == "Answer with just the number."
  with pytest.raises(ValueError, match="levels"):
    envs.make("tool_arithmetic", levels=("easy", "add3"))
  assert envs.make("tool_arithmetic", levels="easy, hard").levels == ("easy", "hard")
  assert envs.make("tool_arithmetic", levels="").levels == ()  # a config flag's default


# --- the learner's SFT loss and the warm start -------------------------------------------------

def _tiny_config(tmp_path, steps=4):
  c = rcfg.default_config()
  c.model.name = "tiny-chat"
  c.env.name = "tool_arithmetic"
  c.agent.template = "chatml"
  c.packing.row_len = 512
  c.packing.row_buckets = (1, 2, 4)
  c.sft.steps = steps
  c.sft.examples = 24
  c.sft.batch_size = 4
  c.sft.lr = 1e-3
  c.sft.checkpoint_every = 2
  c.checkpoint.async_save = False
  c.log.peak_flops = 1e11
  return c


def test_sft_schedule_is_its_own_when_set(tmp_path):
  """sft.min_lr_ratio sets the warm start's end of schedule; unset (< 0) it is the RL
  config's optim.min_lr_ratio, as before. (Setting RL's min_lr_ratio to 1.0 once turned the
  agent demo's warm start from a decay to 1e-4 into a constant 2e-4.)"""
  from fr_jax.learner import optim
  c = _tiny_config(tmp_path, steps=40)
  c.sft.lr, c.optim.min_lr_ratio = 2e-4, 1.0
  last = lambda c: float(optim.schedule(sft.learner_config(c).optim)(40))  # noqa: E731
  assert math.isclose(last(c), 2e-4, rel_tol=1e-6)  # inherited: constant
  c.sft.min_lr_ratio = 0.5
  assert math.isclose(last(c), 1e-4, rel_tol=1e-6)
  assert c.optim.min_lr_ratio == 1.0  # the RL schedule is untouched
  bad = rcfg.default_config()
  bad.service.queue_capacity = bad.batch_size  # (the default config is a template)
  bad.sft.min_lr_ratio = 1.5
  with pytest.raises(rcfg.ConfigError, match="sft.min_lr_ratio=1.5"):
    rcfg.validate(bad)


@pytest.mark.parametrize("reduction", ["token_mean", "sample_mean"])
def test_sft_loss_is_the_mean_nll_of_assistant_tokens(tmp_path, reduction):
  c = _tiny_config(tmp_path)
  c.sft.reduction = reduction
  model = registry.load("tiny-chat")
  env = envs.make("tool_arithmetic")
  convs = sft.demonstrations(env, 4, seed=3)
  recs = [sft.render(model.tokenizer, m, "chatml", f"c{i}") for i, m in enumerate(convs)]
  assert {r.num_tool_calls for r in recs} == {0, 1}  # both kinds in the batch
  # Independent: each conversation alone, unpacked, through the forward pass and a NumPy
  # log-softmax; the loss is the mean NLL over all assistant tokens (token_mean) or the mean
  # over conversations of each one's mean (sample_mean).
  nll = []
  for r in recs:
    ids = np.concatenate([r.prompt_tokens, r.completion_tokens])
    h, _ = forward(model.params, model.config, ids[None, :-1],
                           np.arange(len(ids) - 1)[None])
    logits = np.asarray(decoder.logits_from_hidden(model.params, model.config, h)[0], np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    lp = logits[np.arange(len(ids) - 1), ids[1:]] - logz
    mask = np.concatenate([np.zeros(len(r.prompt_tokens) - 1, bool), r.action_mask])
    nll.append(-lp[mask])
  want = (np.concatenate(nll).mean() if reduction == "token_mean"
          else np.mean([x.mean() for x in nll]))
  learner = Learner(sft.learner_config(c), model=model)
  m = learner.update(recs)
  assert m["loss"] == pytest.approx(float(want), rel=1e-5)
  assert m["ratio_mean"] == pytest.approx(1.0) and m["acceptance_rate"] == 1.0
  learner.close()


def _flat(params):
  return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(params)])


def test_sft_resume_equals_an_uninterrupted_run(tmp_path):
  c = _tiny_config(tmp_path, steps=4)
  full = sft.warm_start(c, registry.load("tiny-chat"), str(tmp_path / "full"), progress=False)
  assert full["finished"] and full["steps"] == 4 and full["resumed_from"] == 0
  stop = threading.Event()

  def halt(step, m):
    if step == 2:
      stop.set()

  part = sft.warm_start(c, registry.load("tiny-chat"), str(tmp_path / "cut"), stop=stop,
                    progress=False, on_step=halt)
  assert not part["finished"] and part["steps"] == 2 and part["export"] is None
  rest = sft.warm_start(c, registry.load("tiny-chat"), str(tmp_path / "cut"), progress=False)
  assert rest["finished"] and rest["resumed_from"] == 2 and rest["steps"] == 4
  np.testing.assert_allclose(_flat(rest["params"]), _flat(full["params"]), rtol=0, atol=1e-6)
  # The data file was written once and read back; the export loads as a model.
  assert (tmp_path / "cut" / "sft_data.jsonl").read_text() == \
      (tmp_path / "full" / "sft_data.jsonl").read_text()
  steps = [json.loads(line)["step"] for line in open(tmp_path / "cut" / "metrics.jsonl")
           if '"loss"' in line]
  assert steps == [1, 2, 3, 4]
  loaded = registry.load(f"hf:{rest['export']}")
  np.testing.assert_allclose(_flat(loaded.params), _flat(rest["params"]), rtol=0, atol=0)
  # A finished warm start is found finished, not redone.
  again = sft.warm_start(c, registry.load("tiny-chat"), str(tmp_path / "cut"), progress=False)
  assert again["resumed_from"] == 4 and again["loss_first"] is None


def test_sft_crash_then_more_steps_keeps_one_metric_row_per_step_and_a_fresh_export(tmp_path):
  """A crash after step 3 (its metric row written, its checkpoint not: every 2) resumes from
  2 and redoes 3 without writing its row twice; a finished warm start asked for more steps
  exports the new weights, not the earlier export; the export is swapped in whole."""
  c = _tiny_config(tmp_path, steps=4)
  out = str(tmp_path / "run")

  class Crash(Exception):
    pass

  def crash(step, m):
    if step == 3:
      raise Crash

  with pytest.raises(Crash):
    sft.warm_start(c, registry.load("tiny-chat"), out, progress=False, on_step=crash)
  done = sft.warm_start(c, registry.load("tiny-chat"), out, progress=False)
  assert done["resumed_from"] == 2 and done["finished"]
  steps = [json.loads(line)["step"] for line in open(tmp_path / "run" / "metrics.jsonl")
           if '"loss"' in line]
  assert steps == [1, 2, 3, 4]
  c.sft.steps = 6
  more = sft.warm_start(c, registry.load("tiny-chat"), out, progress=False)
  assert more["resumed_from"] == 4 and more["steps"] == 6 and more["finished"]
  loaded = registry.load(f"hf:{more['export']}")
  np.testing.assert_allclose(_flat(loaded.params), _flat(more["params"]), rtol=0, atol=0)
  assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".export")]
