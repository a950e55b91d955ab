"""Supervised warm start data: chat conversations rendered exactly as rollouts are.

A conversation is a list of messages `{"role": ..., "content": ...}`: optional system turns
and a user turn (the prompt), then assistant turns, each followed (except the last) by a
`tool` turn (the tool's output, as the agent loop returns it inside <tool_response> tags) or a
`user` turn (an interactive environment's observation). Assistant turns that call the tool
write the call in their text, in the Hermes format the agent loop parses:

  {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "What is 7 x 8?"},
                {"role": "assistant", "content": "<tool_call>\\n{...}\\n</tool_call>"},
                {"role": "tool", "content": "56\\n"}, {"role": "assistant", "content": "56"}]}

`render()` turns one into the record a rollout of the same conversation produces, token for
token: the prompt through the chat template (`agent.prompt_ids`), each assistant turn as the
model would sample it (its text's ids, then the end-of-turn token) with action_mask True, and
every tool or user turn through the agent loop's own template (`agent.user_turn_ids`) with
action_mask False. The learner trains on such records with `objective.loss=sft`: the mean
negative log-likelihood of the assistant tokens (see `fr_jax.learner.step`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from fr_jax import durable
from fr_jax.rollout.agent import (
  RESPONSE_CLOSE,
  RESPONSE_OPEN,
  parse_tool_call,
  prompt_ids,
  user_turn_ids,
)
from fr_jax.trajectory import Trajectory

ROLES = ("system", "user", "assistant", "tool")


class SFTDataError(ValueError):
  """A conversation that cannot be rendered, naming where it is."""


def check_conversation(messages, where: str = "conversation") -> list[dict]:
  """The messages if they form a trainable conversation; SFTDataError otherwise."""
  if not isinstance(messages, list) or not messages:
    raise SFTDataError(f"{where}: expected a non-empty list of messages")
  for i, m in enumerate(messages):
    if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
      raise SFTDataError(f"{where}: message {i} must be {{\"role\": one of {ROLES}, "
                         "\"content\": a string}")
  first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
  if first is None:
    raise SFTDataError(f"{where}: no assistant turn to train on")
  if first == 0 or messages[first - 1]["role"] != "user":
    raise SFTDataError(f"{where}: the first assistant turn must follow a user turn")
  if any(m["role"] not in ("system", "user") for m in messages[:first]):
    raise SFTDataError(f"{where}: only system and user turns may come before the first "
                       "assistant turn")
  rest = messages[first:]
  if rest[-1]["role"] != "assistant":
    raise SFTDataError(f"{where}: the last message must be an assistant turn")
  for a, b in zip(rest, rest[1:]):
    if (a["role"] == "assistant") == (b["role"] == "assistant"):
      raise SFTDataError(f"{where}: after the first assistant turn, assistant turns and "
                         "tool/user turns must alternate")
  return messages


def end_of_turn_id(tok) -> int:
  """The token a model samples to end its turn (<|im_end|> for ChatML models)."""
  t = tok.token_id("<|im_end|>")
  t = tok.eos_id if t is None else t
  if t is None:
    raise SFTDataError("the tokenizer has neither <|im_end|> nor an eos token")
  return t


def render(tok, messages: list[dict], template: str = "model",
           conversation_id: str = "sft") -> Trajectory:
  """The record a rollout of `messages` produces (see the module docstring). Its reward is 1
  and its behaviour log-probs 0: `objective.loss=sft` ignores both."""
  check_conversation(messages, conversation_id)
  first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
  prompt = prompt_ids(tok, messages[:first], template)
  end = end_of_turn_id(tok)
  ids: list[int] = []
  mask: list[bool] = []
  calls = turns = 0
  for m in messages[first:]:
    if m["role"] == "assistant":
      t = tok.encode(m["content"], add_bos=False) + [end]
      turns += 1
      calls += parse_tool_call(m["content"]) != (None, None)
    elif m["role"] == "tool":
      t = user_turn_ids(tok, m["content"], (RESPONSE_OPEN, RESPONSE_CLOSE))
    else:
      t = user_turn_ids(tok, m["content"])
    ids += t
    mask += [m["role"] == "assistant"] * len(t)
  n = len(ids)
  return Trajectory(
      prompt_id=conversation_id, prompt_tokens=np.asarray(prompt, np.int32),
      completion_tokens=np.asarray(ids, np.int32), action_mask=np.asarray(mask, bool),
      behavior_logp=np.zeros(n, np.float32), reward=1.0,
      policy_version=np.zeros(n, np.int32), finish_reason="stop", num_tool_calls=calls,
      num_turns=turns, env="sft", traj_id=conversation_id)


def read_jsonl(path) -> list[list[dict]]:
  """Conversations from a JSONL file, one `{"messages": [...]}` per line (blank lines
  skipped); SFTDataError names the first bad line."""
  out = []
  try:
    f = open(path, "rb")
  except OSError as e:  # missing, a folder, unreadable
    raise SFTDataError(f"cannot read {path}: {e.strerror}") from None
  with f:
    for n, raw in enumerate(f, 1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise SFTDataError(f"{path}:{n}: not UTF-8 (byte {e.start} of the line)") from None
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise SFTDataError(f"{path}:{n}: not JSON ({e.msg})") from None
      except RecursionError:
        raise SFTDataError(f"{path}:{n}: nested too deeply to parse") from None
      msgs = row.get("messages") if isinstance(row, dict) else None
      out.append(check_conversation(msgs, f"{path}:{n}"))
  if not out:
    raise SFTDataError(f"{path}: no conversations")
  return out


def write_jsonl(path, conversations: Iterable[list[dict]]) -> Path:
  """Writes conversations as JSONL, whole or not at all (`durable.write_file`)."""
  return durable.write_file(path, "".join(json.dumps({"messages": m}) + "\n"
                                          for m in conversations))


def demonstrations(env, n: int, *, seed: int = 0, tool_fraction: float = 0.5) -> list:
  """`n` conversations on the env's train split from `env.demonstration(task, use_tool)` (or
  `env.sft_demonstration`, for an env whose `demonstration` serves another warm start);
  each calls the tool with probability `tool_fraction`, independently of the task, so the
  warm-started policy calls it on about that share of items whatever they are."""
  make = getattr(env, "sft_demonstration", None) or getattr(env, "demonstration", None)
  if make is None:
    raise SFTDataError(f"env {env.name!r} writes no demonstrations; pass sft.data=FILE.jsonl")
  rng = np.random.default_rng([seed, 7])
  size = env.split_size("train")
  return [make(env.task("train", int(rng.integers(size))), bool(rng.random() < tool_fraction))
          for _ in range(n)]


def batch_indices(num_examples: int, batch_size: int, step: int, seed: int = 0) -> np.ndarray:
  """The examples of supervised step `step` (0-based): epochs are fresh permutations of all
  examples, read in order, so any step's batch is known without the ones before it (a resumed
  run continues with exactly the batches the uninterrupted run would have used)."""
  if num_examples < 1 or batch_size < 1:
    raise SFTDataError(f"need examples ({num_examples}) and batch_size ({batch_size}) >= 1")
  first = step * batch_size
  perms: dict[int, np.ndarray] = {}
  out = []
  for j in range(first, first + batch_size):
    epoch, k = divmod(j, num_examples)
    if epoch not in perms:
      perms[epoch] = np.random.default_rng([seed, epoch]).permutation(num_examples)
    out.append(perms[epoch][k])
  return np.asarray(out)
