r"""Tool-call parsing time on adversarial replies: the linear parser (fr_jax.rollout.agent)
against the regex it replaced, `<tool_call>\s*(.*?)\s*</tool_call>`, which backtracks
cubically when no closing tag follows a run of whitespace.

  python -m experiments.benchmarks.agent_parse
  python -m experiments.benchmarks.agent_parse --old_sizes=1000,2000   # quicker

One JSON line per reply shape, size and parser: the median of --repeats parses (one parse for
the regex at sizes where it takes seconds). The regex is the peer, timed in the same run; it
holds the GIL the whole time, which in launch.train stalls the learner's threads too.
"""

from __future__ import annotations

import re
import statistics
import time

from absl import app, flags

from experiments.benchmarks.common import emitter, machine

flags.DEFINE_list("sizes", ["1000", "4000", "10000", "100000"], "reply lengths, new parser")
flags.DEFINE_list("old_sizes", ["1000", "2000", "4000"], "reply lengths, old regex")
flags.DEFINE_integer("repeats", 5, "parses per point")
FLAGS = flags.FLAGS

OLD_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

# Reply shapes of n characters: the regex's worst case, many openings, JSON that crashed the
# old loop (RecursionError, ValueError: too many int digits), and an honest call.
SHAPES = {
    "deep_json": lambda n: "<tool_call>" + "[" * (n - 23) + "</tool_call>",
    "huge_int": lambda n: "<tool_call>" + "1" * (n - 23) + "</tool_call>",
    "open_then_spaces": lambda n: "<tool_call>" + " " * (n - 11),
    "many_openings": lambda n: "<tool_call>" * (n // 11) + "</tool_call>",
    "long_valid_call": lambda n: ('<tool_call>{"name": "python", "arguments": {"code": "'
                                  + "x" * max(0, n - 70) + '"}}</tool_call>'),
}


def _median(fn, repeats):
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def main(argv):
  del argv
  from fr_jax.rollout.agent import parse_tool_call
  emit = emitter("agent_parse")
  emit("machine", **machine())
  for shape, make in SHAPES.items():
    for n in map(int, FLAGS.sizes):
      text = make(n)
      sec = _median(lambda text=text: parse_tool_call(text), FLAGS.repeats)
      emit("parse", parser="linear", shape=shape, chars=len(text),
           median_ms=round(1e3 * sec, 3))
    for n in map(int, FLAGS.old_sizes):
      text = make(n)
      t0 = time.perf_counter()
      OLD_CALL.search(text)
      once = time.perf_counter() - t0
      sec = once if once > 0.5 else _median(lambda text=text: OLD_CALL.search(text),
                                            FLAGS.repeats)
      new = _median(lambda text=text: parse_tool_call(text), FLAGS.repeats)
      emit("parse", parser="old_regex", shape=shape, chars=len(text),
           median_ms=round(1e3 * sec, 3), linear_ms=round(1e3 * new, 3),
           ratio_to_linear=round(sec / max(new, 1e-9), 1))


if __name__ == "__main__":
  app.run(main)
