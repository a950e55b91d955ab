"""The agent loop with a scripted policy: a three-turn tool trajectory checked token by token
against hand-written expectations (masks, log-probs, reward, counts)."""

import numpy as np
import pytest

from fr_jax import envs
from fr_jax.models import registry
from fr_jax.rollout.agent import AgentConfig, AgentLoop, parse_tool_call
from fr_jax.rollout.engine import Completion
from fr_jax.trajectory import validate


class ScriptedEngine:
  """A policy that plays fixed turns (a test double of the engine, not a model): each turn's
  text is tokenised, closed with <|im_end|>, and given log-probs -0.1, -0.2, ..."""

  def __init__(self, tok, turns, version=3):
    self.tok, self.turns, self.version, self.calls = tok, list(turns), version, []

  def generate(self, requests, should_abort=None):
    out = []
    for r in requests:
      self.calls.append(list(r.prompt_ids))
      ids = self.tok.encode(self.turns.pop(0)) + [self.tok.token_id("<|im_end|>")]
      out.append(Completion(r.request_id, ids, [-0.1 * (k + 1) for k in range(len(ids))],
                            "stop", [self.version] * len(ids), len(r.prompt_ids)))
    return out


@pytest.fixture(scope="module")
def tok(smol_tokenizer):
  return smol_tokenizer


def test_parse_tool_call():
  code, err = parse_tool_call('x <tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}'
                              '\n</tool_call>')
  assert code == "print(1)" and err is None
  assert parse_tool_call("the answer is 4") == (None, None)
  assert "JSON" in parse_tool_call("<tool_call>{oops</tool_call>")[1]
  assert "unknown tool" in parse_tool_call('<tool_call>{"name": "web"}</tool_call>')[1]


def test_three_turn_tool_trajectory_by_hand(tok):
  env = envs.make("arithmetic", difficulty=2, word_fraction=0.0)
  task = next(t for t in (env.task("train", i) for i in range(50)) if t.meta["op"] == "*")
  a, b = task.meta["a"], task.meta["b"]
  turn1 = ('<tool_call>\n{"name": "python", "arguments": {"code": "print('
           f'{a} * {b}'
           ')"}}\n</tool_call>')
  turn2 = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1/0)"}}\n</tool_call>'
  turn3 = f"The answer is {a * b}."
  engine = ScriptedEngine(tok, [turn1, turn2, turn3])
  loop = AgentLoop(engine, tok, env, AgentConfig(max_turns=4, max_total_tokens=2048))
  (traj,), (ep,) = loop.run([task], [0])
  validate(traj)

  end = tok.token_id("<|im_end|>")
  t1 = tok.encode(turn1) + [end]
  t2 = tok.encode(turn2) + [end]
  t3 = tok.encode(turn3) + [end]
  obs1 = tok.encode(f"\n<|im_start|>user\n<tool_response>\n{a * b}\n\n</tool_response>"
                    "<|im_end|>\n<|im_start|>assistant\n")
  err = ("Traceback (most recent call last):\n")
  want_prompt = tok.encode(tok.apply_chat_template(
      [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": task.prompt}]))
  assert traj.prompt_tokens.tolist() == want_prompt
  comp = traj.completion_tokens.tolist()
  # Layout: turn 1 | tool result 1 | turn 2 | tool result 2 | turn 3.
  assert comp[:len(t1)] == t1
  assert comp[len(t1):len(t1) + len(obs1)] == obs1
  k = len(t1) + len(obs1)
  assert comp[k:k + len(t2)] == t2
  rest = comp[k + len(t2):]
  obs2_text = tok.decode(rest[:len(rest) - len(t3)])
  assert rest[-len(t3):] == t3
  assert obs2_text.startswith("\n<|im_start|>user\n<tool_response>\n" + err)
  assert "ZeroDivisionError" in obs2_text and "[tool: exited with status 1]" in obs2_text
  # Masks: exactly the sampled turns are actions.
  mask = traj.action_mask.tolist()
  n2 = len(rest) - len(t3)
  assert mask == ([True] * len(t1) + [False] * len(obs1) + [True] * len(t2) + [False] * n2 +
                  [True] * len(t3))
  # Log-probs: the engine's on actions, 0 elsewhere.
  lp = traj.behavior_logp
  np.testing.assert_allclose(lp[:len(t1)], [-0.1 * (i + 1) for i in range(len(t1))], rtol=1e-6)
  assert not lp[~traj.action_mask].any()
  assert traj.reward == 1.0 and traj.num_tool_calls == 2 and traj.num_turns == 3
  assert traj.finish_reason == "stop" and traj.min_policy_version == 3
  # The model saw everything so far at each turn.
  assert engine.calls[1] == want_prompt + t1 + obs1


def test_wrong_answer_and_turn_limit(tok):
  env = envs.make("arithmetic", difficulty=1, word_fraction=0.0)
  task = env.task("train", 1)
  call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(2)"}}\n</tool_call>'
  engine = ScriptedEngine(tok, [call, call])
  (traj,), _ = AgentLoop(engine, tok, env, AgentConfig(max_turns=2)).run([task], [5])
  assert traj.finish_reason == "length" and traj.truncated and traj.reward == 0.0
  assert traj.num_turns == 2 and traj.num_tool_calls == 2
  assert traj.action_mask[-1]  # ends on the model's turn, no dangling template
  engine = ScriptedEngine(tok, ["I think it is -1"])
  (traj,), _ = AgentLoop(engine, tok, env).run([task], [6])
  assert traj.reward == (1.0 if task.answer == -1 else 0.0) and traj.num_tool_calls == 0


def test_textworld_episode_through_the_loop(tok):
  env = envs.make("textworld")
  task = next(t for t in (env.task("train", i) for i in range(60))
              if t.answer["goal"] == "place")
  g = task.answer
  src = env.start(task).where[g["object"]]
  cmds = [f"go to {src}"]
  if src.split()[0] in ("cabinet", "drawer", "fridge"):
    cmds.append(f"open {src}")
  cmds += [f"take {g['object']} from {src}", f"go to {g['target']}"]
  if g["target"].split()[0] in ("cabinet", "drawer"):
    cmds.append(f"open {g['target']}")
  cmds.append(f"put {g['object']} in {g['target']}")
  engine = ScriptedEngine(tok, cmds)
  (traj,), (ep,) = AgentLoop(engine, tok, env, AgentConfig(max_turns=10,
                                                           max_total_tokens=4096)).run([task], [0])
  assert traj.reward == 1.0 and traj.num_turns == len(cmds) and traj.finish_reason == "stop"
  assert "You arrive at" in tok.decode(traj.completion_tokens.tolist())
  validate(traj)


def test_real_rollout_logprobs_equal_learner_scoring():
  """End to end: SmolLM2 on the embedded engine plays arithmetic episodes with the tool; the
  learner's packed scoring of the resulting trajectories reproduces every behaviour log-prob
  (so masks, packing's target frame and the engine agree token for token)."""
  import jax

  from fr_jax.models import scoring
  from fr_jax.packing import PackingSpec, pack
  from fr_jax.rollout.embedded import EmbeddedEngine
  m = registry.load("smollm2-135m-instruct")
  env = envs.make("arithmetic", difficulty=2)
  engine = EmbeddedEngine(m.config, m.params, tokenizer=m.tokenizer, num_slots=2, max_len=512)
  loop = AgentLoop(engine, m.tokenizer, env, AgentConfig(max_turns=2, max_new_tokens=12,
                                                         max_total_tokens=512, temperature=0.8))
  tasks = [env.task("train", i) for i in range(2)]
  trajs, _ = loop.run(tasks, [11, 12])
  for t in trajs:
    validate(t)
  (b,) = pack(trajs, PackingSpec(512, (2,), 4)).batches
  lp, _ = jax.jit(lambda p: scoring.score_packed(p, m.config, b.tokens, b.targets, b.positions,
                                                 b.segment_ids, 0.8))(m.params)
  lp = np.asarray(lp)
  np.testing.assert_allclose(lp[b.action_mask], b.behavior_logp[b.action_mask], atol=1e-4)
  assert b.action_mask.sum() == sum(t.num_action_tokens for t in trajs)
