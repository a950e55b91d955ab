r"""A tool-using agent written only against the `openai` package: it answers arithmetic
questions with a Python tool, through `launch.gateway`, and posts each episode's reward.

  FR_JAX_GATEWAY_KEY=secret python -m experiments.agents.openai_tool_agent \
      --base_url=http://127.0.0.1:8000/v1 --episodes=32

Each episode is one question; every call carries the episode id. The tool runs only
`print(<arithmetic>)` (evaluated safely here, never executed); the reward is 1 for the right
number on the last line, minus 0.1 per tool call. Call seeds follow the built-in agent loop's
(`seed * 1000003 + turn`), so an episode can be compared with `AgentLoop` token for token.
Prints one JSON line per episode.
"""

import argparse
import ast
import json
import operator
import os
import random
import re

import openai

TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code; returns what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                   "required": ["code"]}}}]
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calc(code: str) -> str:
  """The tool: `print(expr)` of +, -, * on integers, else an error."""
  def ev(n):
    if isinstance(n, ast.Constant) and type(n.value) is int and abs(n.value) < 10**12:
      return n.value
    if isinstance(n, ast.BinOp) and type(n.op) in OPS:
      return OPS[type(n.op)](ev(n.left), ev(n.right))
    raise ValueError("only integer +, -, * are allowed")
  try:
    call = ast.parse(code.strip(), mode="eval").body
    assert isinstance(call, ast.Call) and getattr(call.func, "id", "") == "print"
    return f"{ev(call.args[0])}\n"
  except (SyntaxError, ValueError, AssertionError, IndexError, RecursionError) as e:
    return f"[tool error: {type(e).__name__}]"


def episode(client, episode_id, system, question, answer, *, seed, temperature=1.0,
            max_turns=3, max_tokens=64, tool_cost=0.1, tools=TOOLS):
  """Runs one episode through the gateway and posts its reward; returns (reward, calls)."""
  messages = ([{"role": "system", "content": system}] if system else []) + [
      {"role": "user", "content": question}]
  calls, reply = 0, ""
  for turn in range(max_turns):
    r = client.chat.completions.create(
        model="fr_jax", messages=messages, tools=tools, temperature=temperature,
        max_tokens=max_tokens, seed=(seed * 1_000_003 + turn) % 2**32,
        extra_headers={"X-Episode-Id": episode_id})
    msg = r.choices[0].message
    messages.append(msg.model_dump(exclude_none=True))
    if not msg.tool_calls:
      reply = msg.content or ""
      break
    for tc in msg.tool_calls:
      calls += 1
      code = json.loads(tc.function.arguments or "{}").get("code", "")
      messages.append({"role": "tool", "tool_call_id": tc.id, "content": calc(str(code))})
  numbers = re.findall(r"-?\d+", reply.strip().splitlines()[-1] if reply.strip() else "")
  reward = float(bool(numbers) and int(numbers[-1]) == answer) - tool_cost * calls
  client.post(f"/episodes/{episode_id}/reward", cast_to=object, body={"reward": reward})
  return reward, calls


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--base_url", default="http://127.0.0.1:8000/v1")
  p.add_argument("--episodes", type=int, default=32)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--temperature", type=float, default=1.0)
  a = p.parse_args()
  client = openai.OpenAI(base_url=a.base_url, api_key=os.environ.get("FR_JAX_GATEWAY_KEY"))
  rng = random.Random(a.seed)
  for i in range(a.episodes):
    x, y = rng.randint(100, 999), rng.randint(10, 99)
    reward, calls = episode(client, f"agent-{a.seed}-{i}", "Use the python tool to compute.",
                            f"What is {x} * {y}?", x * y, seed=a.seed * 100_000 + i,
                            temperature=a.temperature)
    print(json.dumps({"episode": i, "reward": reward, "tool_calls": calls}), flush=True)


if __name__ == "__main__":
  main()
