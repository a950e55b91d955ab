"""The engine protocol: what the agent loop and workers need from any inference backend.

`generate(requests) -> completions`. Each completion carries the sampled token ids, their
behaviour log-probs (from the distribution that sampled them: softmax(logits / T), and with
top_p < 1 the renormalised nucleus; greedy reports log_softmax(logits)), the finish reason
(stop, length or abort) and the policy version that produced each token. Backends: the
embedded JAX engine (`fr_jax.rollout.embedded`), an SGLang server or gateway
(`fr_jax.rollout.sglang`) and a vLLM server (`fr_jax.rollout.vllm`); `fr_jax.system`'s engine
factory builds the one a config names.

Streaming. A request's `on_token` hears each token as it is sampled (the embedded engine calls
it after every decode step) and may abort that request alone by returning False.

Routing replay (mixture-of-experts models). A request with `routed_experts_start = s` (not
None) asks for the experts each fed position used: the completion's `routed_experts` is an
integer array [n, sparse layers, k] for positions s .. prompt_len + len(token_ids) - 2 (every
position the model read, from s on; the last sampled token is never fed). A position's row is
the routing its own forward pass used, when it was first computed (a reused cache entry keeps
the routing it was computed with). An engine that cannot report routing raises rather than
return None.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

FINISH = ("stop", "length", "abort")


@dataclasses.dataclass
class Request:
  request_id: str
  prompt_ids: list[int]
  max_new_tokens: int = 256
  temperature: float = 1.0  # 0 = greedy
  top_p: float = 1.0
  seed: int = 0  # per request: the same seed gives the same tokens in any batch
  stop_token_ids: tuple[int, ...] = ()
  stop_strings: tuple[str, ...] = ()
  # Routing replay: report the experts of positions >= this one (None: do not report).
  routed_experts_start: int | None = None
  # Streaming: called with each token as it is sampled (its id and behaviour log-prob), on
  # the engine's thread, so it must not block. Returning False aborts this request alone: its
  # completion keeps what was sampled, finish_reason "abort". The vLLM and SGLang engines
  # stream such a request from their server (SGLang's without routing replay).
  on_token: Callable[[int, float], bool] | None = dataclasses.field(default=None, repr=False,
                                                                    compare=False)

  def check(self, vocab_size: int | None = None):
    if not self.prompt_ids:
      raise ValueError(f"request {self.request_id!r}: empty prompt")
    if self.max_new_tokens < 1:
      raise ValueError(f"request {self.request_id!r}: max_new_tokens={self.max_new_tokens} < 1")
    if self.temperature < 0 or not 0 < self.top_p <= 1:
      raise ValueError(f"request {self.request_id!r}: temperature={self.temperature} must be "
                       f">= 0 and top_p={self.top_p} in (0, 1]")
    s = self.routed_experts_start
    if s is not None and not 0 <= s <= len(self.prompt_ids):
      raise ValueError(f"request {self.request_id!r}: routed_experts_start={s} outside "
                       f"[0, {len(self.prompt_ids)}]")
    if vocab_size is not None and not all(0 <= t < vocab_size for t in self.prompt_ids):
      raise ValueError(f"request {self.request_id!r}: prompt ids outside [0, {vocab_size})")


@dataclasses.dataclass
class Completion:
  request_id: str
  token_ids: list[int]
  logprobs: list[float]
  finish_reason: str  # stop | length | abort
  versions: list[int]  # policy version that sampled each token
  prompt_len: int = 0
  ttft_s: float = 0.0  # time to first token
  # int [n, sparse layers, k]: experts of the positions routed_experts_start.. (Request);
  # None unless the request asked.
  routed_experts: Any = None


def hand_over(r: Request, ids: Sequence[int], logprobs: Sequence[float]) -> bool:
  """Gives `r.on_token` each of `ids` in order; False once it has asked to stop."""
  if r.on_token is None:
    return True
  for t, lp in zip(ids, logprobs):
    if r.on_token(int(t), float(lp)) is False:
      return False
  return True


class Engine(Protocol):
  version: int
  weight_format: str  # what update_weights takes: "arrays" (parameters) or "hf" (a directory)
  errors: tuple  # exception types a worker rides out (a server down, restarting, refusing)

  def generate(self, requests: Sequence[Request],
               should_abort: Callable[[], bool] | None = None) -> list[Completion]:
    ...

  def update_weights(self, weights, version: int) -> None:
    """Swap in new policy weights (arrays for the embedded engine, an HF directory for
    SGLang and vLLM) between decode steps; tokens sampled afterwards carry `version`."""
