"""Environments: reward functions against hand-made answers, disjoint splits, determinism,
the text household driven by hand, and prompts through grain (sharding, epochs, resume)."""

import pytest

from fr_jax import envs
from fr_jax.envs.arithmetic import eval_expression
from fr_jax.envs.base import last_number, prompt_dataset


def test_last_number_parsing():
  assert last_number("12 + 35 = 47") == 47
  assert last_number("The answer is 1,234.") == 1234
  assert last_number("so \\boxed{-7} and then 3") == -7
  assert last_number("no digits") is None


def test_arithmetic_rewards_and_text():
  env = envs.make("arithmetic", difficulty=2, word_fraction=0.0)
  t = env.task("train", 0)
  a, b, op = t.meta["a"], t.meta["b"], t.meta["op"]
  want = {"+": a + b, "-": a - b, "*": a * b}[op]
  assert t.answer == want and t.prompt.endswith("Answer with just the number.")
  assert env.reward(t, f"Let me think.\n{want}") == 1.0
  assert env.reward(t, f"{want + 1}") == 0.0
  assert env.reward(t, "I don't know") == 0.0
  assert env.task("train", 0) == t  # deterministic


@pytest.mark.parametrize("name,kw", [("arithmetic", {"difficulty": 2}),
                                     ("arithmetic", {"difficulty": 1, "test_size": 40}),
                                     ("countdown", {}), ("textworld", {})])
def test_splits_are_disjoint(name, kw):
  env = envs.make(name, **kw)
  test = {env.task("test", i).task_id for i in range(env.split_size("test"))}
  train = {env.task("train", i).task_id for i in range(3000)}
  assert len(test) == env.split_size("test") or name == "textworld"
  assert not test & train


def test_countdown_reward():
  env = envs.make("countdown")
  t = env.task("test", 3)
  assert eval_expression("(3 + 5) * 2") == (16.0, [3, 5, 2])
  assert eval_expression("__import__('os')") == (None, [])
  nums, target = t.meta["numbers"], t.answer
  # Brute force a correct expression over the given numbers, then check the reward.
  import itertools
  sol = None
  for perm in itertools.permutations(nums):
    for ops in itertools.product("+-*", repeat=len(nums) - 1):
      expr = str(perm[0])
      for o, x in zip(ops, perm[1:]):
        expr = f"({expr} {o} {x})"
      if eval_expression(expr)[0] == target:
        sol = expr
        break
    if sol:
      break
  assert sol is not None
  assert env.reward(t, f"thinking...\n{sol}") == 1.0
  assert env.reward(t, f"{sol} + 0") == 0.0  # 0 is not among the numbers (or changes nothing)
  assert env.reward(t, f"{target}") == (1.0 if target in nums else 0.0)
  assert env.reward(t, "import os") == 0.0


def test_textworld_episode_by_hand():
  env = envs.make("textworld")
  for i in range(40):
    t = env.task("train", i)
    if t.answer["goal"] == "clean":
      break
  g = t.answer
  ep = env.start(t)
  src = ep.where[g["object"]]
  steps = [f"go to {src}"]
  if src.split()[0] in ("cabinet", "drawer", "fridge"):
    steps.append(f"open {src}")
  steps += [f"take {g['object']} from {src}", "go to sinkbasin 1",
            f"clean {g['object']} with sinkbasin 1", f"go to {g['target']}"]
  if g["target"].split()[0] in ("cabinet", "drawer"):
    steps.append(f"open {g['target']}")
  obs = []
  for s in steps:
    o, done = ep.observe(s)
    obs.append(o)
    assert not done and "Nothing happens" not in o, (s, o)
  assert ep.reward() == 0.0
  o, done = ep.observe(f"Action: put {g['object']} in {g['target']}.")
  assert done and ep.reward() == 1.0 and "completed" in o
  ep2 = env.start(t)
  assert ep2.observe("dance")[0] == "Nothing happens."
  assert ep2.observe(f"take {g['object']} from {src}")[0] == "Nothing happens."  # not there


def test_textworld_unseen_layouts_are_new():
  env = envs.make("textworld")
  seen = {env.task("train", i).meta["layout"] for i in range(500)}
  unseen = {env.task("test_unseen", i).meta["layout"] for i in range(200)}
  assert seen <= set(range(env.seen_layouts)) and not seen & unseen


def test_prompt_dataset_epochs_shards_and_resume():
  env = envs.make("arithmetic", test_size=50)
  n = 50
  ds = prompt_dataset(env, "test", seed=1)
  first = [ds[i].task_id for i in range(n)]
  second = [ds[n + i].task_id for i in range(n)]
  assert sorted(first) == sorted(second) == sorted(env.task("test", i).task_id
                                                   for i in range(n))
  assert first != second  # reshuffled per epoch
  shards = [prompt_dataset(env, "test", seed=1, shard_index=k, num_shards=3) for k in range(3)]
  # Shard k holds global positions k, k+3, ...: the first epoch's share is range(k, n, 3).
  union = [shards[k][i].task_id for k in range(3) for i in range(len(range(k, n, 3)))]
  assert sorted(union) == sorted(first)
  it = iter(ds.to_iter_dataset())
  for _ in range(7):
    next(it)
  state = it.get_state()
  rest = [next(it).task_id for _ in range(5)]
  it2 = iter(ds.to_iter_dataset())
  it2.set_state(state)
  assert [next(it2).task_id for _ in range(5)] == rest
  with pytest.raises(ValueError, match="split='dev'"):
    prompt_dataset(env, "dev")
