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

`warm_start()` is the one supervised warm start: `launch.sft` and `launch.train` run it on a
run config, the replication driver and the learning guard on their own data.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
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


def demonstrations(env, n: int, *, seed: int = 0, tool_fraction: float = 0.5,
                   **options) -> list:
  """`n` conversations on the env's train split from `env.demonstration(task, use_tool,
  **options)`; each calls the tool with probability `tool_fraction`, independently of the
  task, so the warm-started policy calls it on about that share of items whatever they are."""
  if not hasattr(env, "demonstration"):
    raise SFTDataError(f"env {env.name!r} writes no demonstrations; pass sft.data=FILE.jsonl")
  rng = np.random.default_rng([seed, 7])
  size = env.split_size("train")
  return [env.demonstration(env.task("train", int(rng.integers(size))),
                            bool(rng.random() < tool_fraction), **options) for _ in range(n)]


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


# --- the warm start ---------------------------------------------------------------------------

def learner_config(c):
  """The run config turned into the warm start's learner config."""
  s = copy.deepcopy(c)
  with s.unlocked():
    s.objective.loss = "sft"
    s.objective.temperature = 1.0  # the likelihood of the data, not of a tempered policy
    s.objective.reduction = c.sft.reduction
    s.batch_size, s.minibatches = c.sft.batch_size, 1
    s.optim.lr, s.optim.warmup_frac = c.sft.lr, c.sft.warmup_frac
    if c.sft.min_lr_ratio >= 0:
      s.optim.min_lr_ratio = c.sft.min_lr_ratio
    s.optim.total_steps = max(c.sft.steps, 1)
    s.checkpoint.every = c.sft.checkpoint_every
  return s


def warm_start(c, model, out_dir: str, *, stop=None, progress: bool = True, on_step=None,
               done_when=None) -> dict:
  """Runs (or resumes, or finds finished) the warm start of `c.sft` in `out_dir`: the data
  (`c.sft.data`, or `c.sft.examples` demonstrations of the env written once to
  out_dir/sft_data.jsonl), the learner of `learner_config(c)` with checkpoints and metrics in
  out_dir, and an HF export in out_dir/export when finished. Returns the summary;
  summary["params"] holds the trained parameters (on device).

  `stop` (an Event) ends it after the current step with a checkpoint, unfinished;
  `on_step(step, metrics)` is called after each step; `done_when(step, params)` is asked
  before each step, with the parameters after `step` steps (a resumed run asks again), and True
  ends the warm start there, finished."""
  from fr_jax import envs
  from fr_jax.learner.learner import Learner
  from fr_jax.trajectory import TrajectoryError, validate
  t0 = time.time()
  os.makedirs(out_dir, exist_ok=True)
  data = c.sft.data
  if not data:  # generated once, then read back like any user's file
    data = os.path.join(out_dir, "sft_data.jsonl")
    if not os.path.exists(data):
      env = envs.make(c.env.name, **c.env.kwargs.to_dict())
      write_jsonl(data, demonstrations(env, c.sft.examples, seed=c.sft.seed,
                                       tool_fraction=c.sft.tool_fraction))
  records = [render(model.tokenizer, m, c.agent.template, f"sft:{i}")
             for i, m in enumerate(read_jsonl(data))]
  lc = learner_config(c)
  with lc.unlocked():
    lc.checkpoint.dir = os.path.join(out_dir, "checkpoints")
    lc.log.dir = out_dir
  learner = Learner(lc, model=model)
  for i, r in enumerate(records):
    try:
      validate(r, **learner.record_limits)
    except TrajectoryError as e:
      raise SFTDataError(f"{data}: conversation {i + 1}: {e} (raise packing.row_len or "
                         "shorten it)") from None
  learner.restore()
  start = learner.version
  bar = None
  if progress and start < c.sft.steps:
    from tqdm import tqdm
    bar = tqdm(total=c.sft.steps, initial=start, desc="sft steps", unit="step",
               file=sys.stderr, dynamic_ncols=True)
  first = last = None
  done = False
  try:
    for k in range(start, c.sft.steps):
      if stop is not None and stop.is_set():
        break
      if done_when is not None and done_when(k, learner.policy_params()):
        done = True
        break
      idx = batch_indices(len(records), c.sft.batch_size, k, c.sft.seed)
      m = learner.update([records[i] for i in idx], log_ids=False)
      first = m["loss"] if first is None else first
      last = m["loss"]
      learner.save()
      if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{m['tokens_per_s']:.0f}")
      if on_step is not None:
        on_step(learner.version, m)
    learner.save(force=True)
    done = done or learner.version >= c.sft.steps
    export = os.path.join(out_dir, "export")
    if done and _export_step(export) != learner.version:
      _export(learner, export)
    params = learner.snapshot_params()
  finally:
    if bar is not None:
      bar.close()
    learner.close()
  return dict(stage="sft", steps=learner.version, finished=done, examples=len(records),
              data=data, resumed_from=start, loss_first=first, loss_last=last,
              export=export if done else None, wall_s=round(time.time() - t0, 1),
              params=params)


EXPORT_STAMP = "fr_jax_export.json"  # in the export: the SFT step its weights are from


def _export_step(export: str) -> int | None:
  try:
    return int(json.loads(open(os.path.join(export, EXPORT_STAMP)).read())["step"])
  except (OSError, ValueError, KeyError, TypeError):
    return None


def _export(learner, export: str) -> None:
  """The HF export with its stamp, swapped in whole (`durable.write_dir`): a kill leaves the
  previous export or none, never one that looks complete and is not."""

  def fill(d):
    learner.export_hf(d)
    (d / EXPORT_STAMP).write_text(json.dumps({"step": learner.version}))

  durable.clean_partial(os.path.dirname(export) or ".", prefix=f".{os.path.basename(export)}.")
  durable.write_dir(export, fill)
