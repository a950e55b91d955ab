"""The multi-turn agent loop: chat template, model turn, tool call or environment step, tool
result, model turn, ... until a final answer, the turn limit or the token budget.

Token bookkeeping is exact: the trajectory is built from token ids, never re-tokenised text.
Tokens the engine sampled are actions (their behaviour log-probs are the engine's); template
tokens, tool results and observations have action_mask False and behaviour log-prob 0.

Tool calls use the Hermes/Qwen format, one per model turn:

  <tool_call>
  {"name": "python", "arguments": {"code": "print(12 * 34)"}}
  </tool_call>

The result comes back as a user turn: <tool_response>\\n...\\n</tool_response>. A model turn
without a tool call is the final answer (single-answer environments). In interactive
environments every model turn is a command and the observation comes back as a user turn.

Model output is hostile input here. The tool-call parser is linear in the reply's length (two
substring searches and one JSON parse, whose failures, deep nesting included, are a marked
tool error). Tool output and observations are encoded as text: a `<|im_start|>` or
`</tool_call>` the code prints stays characters, never a control token of the conversation.
A loop that offers the Python tool checks at construction that the sandbox can isolate it
(`sandbox.require_isolation`), so a run fails at start, not on every call.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import numpy as np

from fr_jax.envs.base import Env, Task
from fr_jax.envs.sandbox import Limits, require_isolation, run_python
from fr_jax.rollout.engine import Completion, Engine, Request
from fr_jax.rollout.tool_formats import CALL_CLOSE, CALL_OPEN, RESPONSE_CLOSE, RESPONSE_OPEN
from fr_jax.trajectory import Trajectory

MAX_TOOL_OUTPUT_CHARS = 2000


@dataclasses.dataclass
class AgentConfig:
  max_turns: int = 4  # model turns per episode
  max_new_tokens: int = 256  # per model turn
  max_total_tokens: int = 1024  # prompt + completion
  temperature: float = 1.0
  top_p: float = 1.0
  template: str = "model"  # "model": the model's own chat template; "chatml": plain ChatML
  tool_limits: Limits = dataclasses.field(default_factory=Limits)
  # MoE models: ask the engine for the experts of every fed position and put them in the
  # record (`Trajectory.routed_experts`), for the learner's routing replay.
  record_routing: bool = False

  @property
  def engine_max_len(self) -> int:
    """The embedded engine's positions per sequence (`EmbeddedEngine(max_len=...)`) for this
    agent's trajectories of up to max_total_tokens: one more, since the engine keeps a free
    position past every prompt it takes."""
    return self.max_total_tokens + 1


def parse_tool_call(text: str) -> tuple[str | None, str | None]:
  """(code, error) from a model turn: code if it holds a well-formed python call, an error
  message if it holds a malformed one, (None, None) if it holds none. The call is the text
  between the first <tool_call> and the first </tool_call> after it, whitespace stripped;
  linear time in len(text)."""
  start = text.find(CALL_OPEN)
  end = text.find(CALL_CLOSE, start + len(CALL_OPEN)) if start >= 0 else -1
  if end < 0:
    return None, None
  try:
    call = json.loads(text[start + len(CALL_OPEN):end].strip())
  except json.JSONDecodeError as e:
    return None, f"tool call is not valid JSON ({e.msg})"
  except (ValueError, RecursionError) as e:  # e.g. an int of 10^5 digits, nesting 10^5 deep
    return None, f"tool call is not valid JSON ({type(e).__name__})"
  if not isinstance(call, dict) or call.get("name") != "python":
    return None, "unknown tool; the only tool is \"python\""
  code = call["arguments"].get("code") if isinstance(call.get("arguments"), dict) else None
  if not isinstance(code, str) or not code.strip():
    return None, "tool call has no arguments.code string"
  return code, None


def prompt_ids(tok, messages: list[dict], template: str = "model") -> list[int]:
  """An episode's prompt: the system and user turns rendered by the chat template
  (`template`: "model", the model's own, or "chatml"), then the assistant header."""
  text = tok.chatml(messages) if template == "chatml" else tok.apply_chat_template(messages)
  return tok.encode(text)


def user_turn_ids(tok, text: str, wrap: tuple[str, str] = ("", "")) -> list[int]:
  """Template tokens closing the model turn, a user turn with `text` (untrusted: encoded as
  text) inside `wrap` (template), and the next assistant header."""
  return tok.encode_pieces([("\n<|im_start|>user\n" + wrap[0], True), (text, False),
                            (wrap[1] + "<|im_end|>\n<|im_start|>assistant\n", True)])


@dataclasses.dataclass
class Episode:
  """One rollout in progress."""

  task: Task
  prompt_ids: list[int]
  env_episode: object = None
  tokens: list[int] = dataclasses.field(default_factory=list)
  mask: list[bool] = dataclasses.field(default_factory=list)
  logp: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  turns: int = 0
  tool_calls: int = 0
  done: bool = False
  finish_reason: str = "stop"
  reward: float = 0.0  # score minus the env's tool charges
  score: float = 0.0  # the env's verdict on the episode (its accuracy)
  routes: list = dataclasses.field(default_factory=list)  # routing rows of positions 0..

  @property
  def routed(self) -> int:
    """Positions whose routing the episode holds."""
    return sum(r.shape[0] for r in self.routes)

  @property
  def length(self) -> int:
    return len(self.prompt_ids) + len(self.tokens)


class AgentLoop:
  """Runs episodes of one environment on one engine, batching model turns across episodes."""

  def __init__(self, engine: Engine, tokenizer, env: Env, cfg: AgentConfig | None = None):
    cfg = AgentConfig() if cfg is None else cfg
    self.engine, self.tok, self.env, self.cfg = engine, tokenizer, env, cfg
    self.stop_ids = tuple(tokenizer.stop_ids())
    # "namespaces" or "limits-only" (config-allowed); SandboxUnavailable otherwise.
    self.tool_isolation = (require_isolation(cfg.tool_limits) if "python" in env.tools
                           else "none")

  def start(self, task: Task) -> Episode:
    messages = ([{"role": "system", "content": self.env.system_prompt}]
                if self.env.system_prompt else [])
    messages.append({"role": "user", "content": task.prompt})
    ids = prompt_ids(self.tok, messages, self.cfg.template)
    ep = Episode(task, ids, self.env.start(task) if self.env.interactive else None)
    if ep.length >= self.cfg.max_total_tokens:
      ep.done, ep.finish_reason = True, "length"
    return ep

  def request(self, ep: Episode, seed: int) -> Request:
    budget = self.cfg.max_total_tokens - ep.length
    return Request(f"{ep.task.task_id}#{seed}#{ep.turns}", ep.prompt_ids + ep.tokens,
                   max_new_tokens=max(1, min(self.cfg.max_new_tokens, budget)),
                   temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                   seed=(seed * 1_000_003 + ep.turns) % 2**32, stop_token_ids=self.stop_ids,
                   routed_experts_start=ep.routed if self.cfg.record_routing else None)

  def _append(self, ep: Episode, ids, *, action: bool, logp=None, versions=None):
    n = len(ids)
    ep.tokens += list(ids)
    ep.mask += [action] * n
    ep.logp += list(logp) if action else [0.0] * n
    ep.versions += list(versions) if versions is not None else [self.engine.version] * n

  def advance(self, ep: Episode, c: Completion) -> None:
    """Appends a model turn and what follows it (tool result / observation / the end)."""
    # A request aborted before it ran has no tokens and no routing to add.
    # Routing rows are kept as the engine gave them. A record whose rows do not add up goes
    # without routing (`trajectory`, below), and admission's check (`trajectory.validate`, the
    # one owner) refuses it under replay as missing_routing.
    if self.cfg.record_routing and c.routed_experts is not None and c.token_ids:
      ep.routes.append(c.routed_experts)
    self._append(ep, c.token_ids, action=True, logp=c.logprobs, versions=c.versions)
    ep.turns += 1
    text = self.tok.decode([t for t in c.token_ids if t not in self.stop_ids])
    if c.finish_reason == "abort":
      ep.done, ep.finish_reason = True, "abort"
      return
    if c.finish_reason == "length":  # the turn was cut at a limit
      self._end(ep, text, "length")
      return
    if self.env.interactive:
      obs, finished = ep.env_episode.observe(text)
      # An interactive environment that offers tools counts its own calls.
      ep.tool_calls = getattr(ep.env_episode, "tool_calls", ep.tool_calls)
      if finished:
        self._end(ep, text)
        return
      reply, wrap = obs, ("", "")
    else:
      code, error = parse_tool_call(text) if "python" in self.env.tools else (None, None)
      if code is None and error is None:  # no tool call: the final answer
        self._end(ep, text)
        return
      ep.tool_calls += 1
      out = (f"[tool error: {error}]" if error is not None
             else run_python(code, self.cfg.tool_limits).output)
      if len(out) > MAX_TOOL_OUTPUT_CHARS:
        out = out[:MAX_TOOL_OUTPUT_CHARS] + "\n[tool: output truncated]"
      reply, wrap = out, (RESPONSE_OPEN, RESPONSE_CLOSE)
    ids = user_turn_ids(self.tok, reply, wrap)
    if ep.turns >= self.cfg.max_turns or ep.length + len(ids) >= self.cfg.max_total_tokens:
      self._end(ep, text, "length")
      return
    self._append(ep, ids, action=False)

  def _end(self, ep: Episode, text: str, reason: str | None = None) -> None:
    """Ends the episode (with `reason`, if given). Its score is the env's verdict on it
    (interactive) or on the final reply `text`; its reward, the score minus `env.tool_cost`
    (if it prices its tool) per tool call, malformed calls included."""
    ep.done, ep.finish_reason = True, reason or ep.finish_reason
    ep.score = float(ep.env_episode.reward() if self.env.interactive
                     else self.env.reward(ep.task, text))
    ep.reward = ep.score - float(getattr(self.env, "tool_cost", 0.0)) * ep.tool_calls

  def trajectory(self, ep: Episode, traj_id: str = "") -> Trajectory:
    """The episode's record (`traj_id` empty: the prompt id). With `record_routing`, its
    routing covers every position but the last; an episode aborted before its last turn was
    fed (an observation the engine never read) loses that unread tail of non-action tokens,
    which no log-prob depends on."""
    n = len(ep.tokens)
    routes = None
    if self.cfg.record_routing and ep.routes:
      routes = np.concatenate(ep.routes)
      unread = ep.length - 1 - routes.shape[0]
      if unread > 0 and not any(ep.mask[n - unread:]):
        n -= unread
      elif unread:
        routes = None  # cannot happen with an engine that keeps the contract
    return Trajectory(
        prompt_id=ep.task.task_id, prompt_tokens=np.asarray(ep.prompt_ids, np.int32),
        completion_tokens=np.asarray(ep.tokens[:n], np.int32),
        action_mask=np.asarray(ep.mask[:n], bool),
        behavior_logp=np.asarray(ep.logp[:n], np.float32),
        reward=float(ep.reward), policy_version=np.asarray(ep.versions[:n], np.int32),
        finish_reason=ep.finish_reason, num_tool_calls=ep.tool_calls, num_turns=ep.turns,
        env=self.env.name, traj_id=traj_id, routed_experts=routes)

  def step(self, eps: Sequence[Episode], seeds: Sequence[int], should_abort=None) -> bool:
    """One round: every live episode takes a model turn (batched on the engine) and what
    follows it. Returns False if no episode was live."""
    live = [i for i, e in enumerate(eps) if not e.done]
    if live:
      outs = self.engine.generate([self.request(eps[i], seeds[i]) for i in live],
                                  should_abort=should_abort)
      for i, c in zip(live, outs):
        self.advance(eps[i], c)
    return bool(live)

  def run(self, tasks: Sequence[Task], seeds: Sequence[int], should_abort=None):
    """Runs one episode per task to the end; model turns of live episodes are batched.
    Returns (trajectories, episodes) in task order."""
    eps = [self.start(t) for t in tasks]
    while self.step(eps, seeds, should_abort):
      pass
    return [self.trajectory(e, f"{e.task.task_id}#{s}") for e, s in zip(eps, seeds)], eps
