"""How a gateway call's turns meet the episode's tokens (`fr_jax.rollout.gateway`'s docstring
says why): a call aligned with the episode's last segment (`align_chat`, `align_text`), and the
text of what the engine samples, whole (`reply_text`) or as it comes (`TextStream`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fr_jax.rollout.chat_render import Renderer, reply_mark
from fr_jax.rollout.gateway_state import Segment


def align_chat(renderer: Renderer, prev: Segment | None, msgs, tools,
               version: int) -> tuple[Segment, str | None]:
  """(the segment a chat call feeds, why it is a new one): `prev` extended by the call's new
  turns (a copy; reason None), or a new segment (reason "first", or why the call does not
  continue `prev`)."""
  reason = "first"
  if prev is not None:
    j = len(prev.msgs)
    if prev.kind != "chat":
      reason = "endpoint_changed"
    elif len(msgs) <= j or msgs[:j] != prev.msgs:
      reason = "history_changed"
    elif msgs[j] != prev.last_reply:
      reason = "reply_changed"
    elif tools != prev.tools:
      reason = "tools_changed"
    else:
      r = renderer.render(msgs, tools, prev.replies + [j])
      head = prev.rendered + reply_mark(j)
      if r.exact and r.text.startswith(head):
        rest = r.text[len(head):]
        if prev.stop_text and rest.startswith(prev.stop_text):
          rest = rest[len(prev.stop_text):]
        seg = prev.copy()
        seg.extend(renderer.encode(rest, r.texts), action=False, version=version)
        seg.msgs, seg.rendered, seg.replies = msgs, r.text, prev.replies + [j]
        return seg, None
      reason = "template_not_append_only"
  r = renderer.render(msgs, tools)
  return Segment("chat", renderer.prompt(r), msgs=msgs, tools=tools, rendered=r.text), reason


def align_text(tok, prev: Segment | None, prompt, version: int) -> tuple[Segment, str | None]:
  """As `align_chat`, for /v1/completions: a prompt that starts with `prev`'s whole sequence
  (token ids) or its whole text (a string) continues it."""
  if isinstance(prompt, list):
    ids, kind = list(prompt), "tokens"
  else:
    ids, kind = tok.encode(prompt), "text"
  reason = "first"
  if prev is not None:
    if prev.kind != kind:
      reason = "endpoint_changed"
    elif kind == "tokens" and len(ids) > len(prev.seq) and ids[:len(prev.seq)] == prev.seq:
      seg = prev.copy()
      seg.extend(ids[len(prev.seq):], action=False, version=version)
      return seg, None
    elif kind == "text" and len(prompt) > len(prev.text) and prompt.startswith(prev.text):
      seg = prev.copy()
      seg.extend(tok.encode(prompt[len(prev.text):], add_bos=False), action=False,
                 version=version)
      return seg, None
    else:
      reason = "history_changed"
  return Segment(kind, ids), reason


def reply_text(tok, stop_ids: Sequence[int], ids: Sequence[int],
               stops: Sequence[str]) -> tuple[str, bool]:
  """(the reply's text, whether a stop string ended it): sampled `ids` less stop tokens, cut
  before the first of `stops` it holds."""
  text = tok.decode([t for t in ids if t not in stop_ids])
  cut = [text.find(x) for x in stops if x in text]
  return (text[:min(cut)], True) if cut else (text, False)


class TextStream:
  """A reply's text as the engine samples it: `on_token` (a Request's) hands `on_text` each
  piece of text that no later token can change, so that the pieces join to `reply_text` of the
  whole reply. Held back until the next token: a trailing incomplete character (a token may
  end inside a UTF-8 sequence) and a tail that could begin one of `stops`. Returns False (the
  engine aborts the request) once `cancelled()`."""

  def __init__(self, tok, stop_ids: Sequence[int], stops: Sequence[str],
               on_text: Callable[[str], None] | None, cancelled: Callable[[], bool]):
    self.tok, self.stop_ids, self.stops = tok, tuple(stop_ids), tuple(stops)
    self.on_text, self.cancelled = on_text, cancelled
    self.ids: list[int] = []
    self.sent = ""
    self.ended = False  # a stop string was sampled: nothing after it is text

  def on_token(self, token: int, logprob: float) -> bool:
    del logprob
    if self.cancelled():
      return False
    if self.on_text is None or self.ended:
      return True
    self.ids.append(token)
    text, self.ended = reply_text(self.tok, self.stop_ids, self.ids, self.stops)
    if not self.ended:
      text = text[:len(text) - self._held(text)]
    if len(text) > len(self.sent) and text.startswith(self.sent):
      delta, self.sent = text[len(self.sent):], text
      self.on_text(delta)
    return True

  def _held(self, text: str) -> int:
    """How many characters at the end of `text` may still change."""
    n = 0
    while n < len(text) and text[len(text) - 1 - n] == "\ufffd":
      n += 1
    for x in self.stops:
      for k in range(min(len(x) - 1, len(text)), n, -1):
        if text.endswith(x[:k]):
          n = k
          break
    return n
