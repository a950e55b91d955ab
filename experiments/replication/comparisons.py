"""The named comparisons: arms (settings), what to measure, and the paper's claimed direction.

Every arm of a comparison shares the task, the warm start, the seeds, the prompts' order and
every setting except the one the comparison varies. Comparisons 3 and 4 run at an exact policy
lag (see `driver`). Metrics are read from a run's result dict by dotted path:
`end.accuracy` (held-out), `curve_last.reward` (mean of the last quarter of updates),
`curve_max.entropy`, `curve_mean.acceptance`, `collapse_update`, `prompts_covered`,
`train_wall_s`. A claim on `equal_time.<key>` compares two arms' held-out evaluations at the
same training seconds (per seed: the shorter of the two runs' times; `at_time`).
"""

from __future__ import annotations

import dataclasses

from experiments.replication.driver import Setting

COPY = dict()  # the copy task: one turn, failures that ramble past 10 tokens are truncated
# lookup: the answer needs the tool; the warm start mixes in copy demos (copy_mix) so that
# the model can copy a digit it sees, and calls the tool in 75% of its tool-task demos.
TOOL = dict(tool=True, max_turns=3, max_new_tokens=10, max_filler=4, tool_rate=0.75,
            copy_mix=0.5)
LAG_DELTA = 0.1  # sequence-trust bound for the lag comparisons (see docs/replication.md)


@dataclasses.dataclass(frozen=True)
class Claim:
  metric: str
  first: str  # arm expected to be higher (higher=True) or lower (higher=False)
  second: str
  higher: bool
  paper: str  # the paper's figure for this direction


@dataclasses.dataclass(frozen=True)
class Comparison:
  name: str
  title: str
  task: str
  paper: str
  arms: dict  # arm name -> Setting
  metrics: tuple  # reported for every arm
  claims: tuple  # directions the paper reports (empty: an open question)
  note: str = ""


def _arms(base: dict, **arms: dict) -> dict:
  return {name: Setting(**{**base, **over}) for name, over in arms.items()}


COMPARISONS = {c.name: c for c in [
    Comparison(
        "signed_vs_positive", "1. signed (batch-centred) vs positive-only feedback",
        "lookup: the digit is hidden, a `?` turn (tool call) reveals it; up to 3 turns",
        "tool use, 7B: 36.2 mean, 3.30 tool calls (signed) vs 9.8, 0.00 (positive-only)",
        _arms(TOOL, signed={}, positive_only=dict(advantage="positive_only")),
        ("end.accuracy", "end.tool_calls_per_trajectory", "curve_last.reward"),
        (Claim("end.accuracy", "signed", "positive_only", True, "36.2 vs 9.8"),
         Claim("end.tool_calls_per_trajectory", "signed", "positive_only", True,
               "3.30 vs 0.00 tool calls"))),
    Comparison(
        "sample_vs_token_mean", "2. sample-mean vs token-mean",
        "copy: failures are long (filler past 10 tokens is truncated and earns 0)",
        "reward 0.477 vs 0.403, length 2,518 vs 3,947, truncation 17.2% vs 45.3%",
        _arms(COPY, sample_mean={}, token_mean=dict(reduction="token_mean")),
        ("end.accuracy", "end.response_length", "end.truncation_rate", "curve_mean.length",
         "curve_mean.truncation"),
        (Claim("end.accuracy", "sample_mean", "token_mean", True, "reward 0.477 vs 0.403"),
         Claim("end.response_length", "sample_mean", "token_mean", False,
               "length 2,518 vs 3,947"),
         Claim("end.truncation_rate", "sample_mean", "token_mean", False,
               "truncation 17.2% vs 45.3%"))),
    Comparison(
        "sequence_vs_token_trust", "3. sequence-level vs token-local trust at the same delta",
        f"copy at an exact policy lag of 8, delta={LAG_DELTA}",
        "sequence stable through 2,160 updates; token-local collapses at 1,237 "
        "(reward 0.18->0.01, entropy 0.37->5.6)",
        _arms(dict(COPY, lag=8, delta=LAG_DELTA), sequence={}, token=dict(trust="token")),
        ("end.accuracy", "curve_last.reward", "curve_last.entropy", "collapse_update",
         "curve_mean.acceptance"),
        (Claim("end.accuracy", "sequence", "token", True, "stable vs collapse"),
         Claim("curve_last.entropy", "sequence", "token", False, "entropy 0.37 vs 5.6"),
         Claim("collapse_update", "sequence", "token", True, "2,160+ vs 1,237 updates"))),
    Comparison(
        "gate_on_off", "4. sequence trust gate on vs off under lag ~4 and ~8",
        f"copy at exact policy lags 4 and 8, delta={LAG_DELTA} vs inf",
        "long CoT at lag ~4: 32.2% (later 33.7%) vs 30.6%; ALFWorld without IS + trust: "
        "35.0 vs 81.0",
        _arms(dict(COPY, delta=LAG_DELTA), lag4_on=dict(lag=4),
              lag4_off=dict(lag=4, delta=float("inf")), lag8_on=dict(lag=8),
              lag8_off=dict(lag=8, delta=float("inf"))),
        ("end.accuracy", "curve_last.reward", "curve_last.entropy", "curve_mean.acceptance"),
        (Claim("end.accuracy", "lag4_on", "lag4_off", True, "32.2% vs 30.6% (lag ~4)"),
         Claim("end.accuracy", "lag8_on", "lag8_off", True, "on > off (lag ~8: no paper row)"))),
    Comparison(
        "fresh_vs_sequential", "5. fresh batch per update vs 4 sequential minibatches",
        "copy, equal data (960 trajectories) and equal update count (60)",
        "28.45 vs 26.80",
        _arms(COPY, fresh={}, sequential=dict(minibatches=4)),
        ("end.accuracy", "curve_last.reward", "curve_mean.acceptance"),
        (Claim("end.accuracy", "fresh", "sequential", True, "28.45 vs 26.80"),)),
    Comparison(
        "flash_vs_grpo", "6. FlashREINFORCE (G=1) vs GRPO (G=4, G=8) at an equal rollout budget",
        "copy, 16 rollouts per update, 60 updates (960 rollouts) for every arm",
        "Qwen2.5-Math-1.5B: 38.0 with 256k rollouts vs GRPO 36.3 with 512k; tool use 37.0 vs "
        "30.3",
        _arms(COPY, flash_g1={}, grpo_g4=dict(loss="grpo", group_size=4),
              grpo_g8=dict(loss="grpo", group_size=8)),
        ("end.accuracy", "prompts_covered", "train_wall_s"),
        (Claim("end.accuracy", "flash_g1", "grpo_g4", True, "38.0 vs 36.3"),
         Claim("end.accuracy", "flash_g1", "grpo_g8", True, "37.0 vs 30.3 (tool use)"),
         Claim("prompts_covered", "flash_g1", "grpo_g4", True, "N vs N/4 prompts"))),
    Comparison(
        "batch_size", "7. batch-size sensitivity of the batch-mean baseline",
        "copy, equal rollout budget (960): B=8 x 120, 16 x 60, 32 x 30, 64 x 15 updates",
        "open question (the paper uses B=64-128)",
        _arms(COPY, b8=dict(batch_size=8, updates=120), b16=dict(batch_size=16, updates=60),
              b32=dict(batch_size=32, updates=30), b64=dict(batch_size=64, updates=15)),
        ("end.accuracy", "curve_last.reward", "train_wall_s"),
        (), note="no claimed direction: the paper leaves this open"),
]}

# On a real model (experiments/replication/lm.py): slow, so not in the default set; run it with
# --only=tool_use_lm.
from experiments.replication.lm import LMSetting  # noqa: E402

COMPARISONS["tool_use_lm"] = Comparison(
    "tool_use_lm", "8. tool use on SmolLM2-135M: signed vs positive-only, from one SFT start",
    "tool_arithmetic: easy 1-digit sums and hard 3-digit x 2-digit products, cpu_agent's "
    "price per tool call (0.2 when measured, 0.4 since); held-out evaluation of 50 items "
    "sampled at T=1, per difficulty",
    "tool use, 7B: 36.2 mean, 3.30 tool calls (signed) vs 9.8, 0.00 (positive-only)",
    {"signed": LMSetting(), "positive_only": LMSetting(advantage="positive_only")},
    ("end.accuracy", "end.hard_accuracy", "end.easy_accuracy", "end.tool_calls_per_trajectory",
     "end.hard_tool_calls", "end.easy_tool_calls", "curve_last.reward"),
    (Claim("end.accuracy", "signed", "positive_only", True, "36.2 vs 9.8"),
     Claim("end.tool_calls_per_trajectory", "signed", "positive_only", True,
           "3.30 vs 0.00 tool calls"),
     Claim("end.hard_accuracy", "signed", "positive_only", True, "(the tool's items)")),
    note="SmolLM2-135M-Instruct after the agent demo's supervised warm start (shared by "
         "every run); 6 updates of 16 rollouts at policy lag 0 with the cpu_agent recipe.")
# The first 24 of `make demo`'s 36 updates, on its schedule (a 5-update warm-up): 768 rollouts
# per run, 50-62 minutes a seed for the three arms here (the budget: docs/replication.md).
HEADLINE_UPDATES = 24
HEAD = dict(config="cpu_default", updates=HEADLINE_UPDATES, schedule=36, batch_size=32,
             eval_n=200, eval_every=HEADLINE_UPDATES // 2)
COMPARISONS["headline_lm"] = Comparison(
    "headline_lm", "The headline on SmolLM2-135M: FlashREINFORCE (asynchronous and "
    "synchronous) vs GRPO (G=8) at an equal rollout budget",
    f"`make demo`'s task and recipe (arithmetic, cpu_default: the base model, constant_length "
    f"at lr 1e-5 after a 5-update warm-up; sample_mean at 5e-6 in runs recorded with those "
    f"overrides), its first {HEADLINE_UPDATES} updates of 32 rollouts for every arm; "
    f"held-out greedy accuracy on the demo's 200 problems",
    "Qwen2.5-Math-1.5B: 38.0 with 256k rollouts vs GRPO 36.3 with 512k; tool use 37.0 vs 30.3 "
    "(GRPO G=8); Qwen3-30B-A3B: 67.1 at lag ~8 vs GRPO 60.3 at lag ~1, same rollouts",
    {"flash_async": LMSetting(**HEAD, system=True, lag=2),
     "flash_sync": LMSetting(**HEAD),
     "grpo_g8": LMSetting(**HEAD, loss="grpo", group_size=8)},
    ("end.accuracy", "gain.accuracy", "end.response_length", "end.truncation_rate",
     "curve_last.reward", "curve_mean.acceptance", "prompts_covered", "train_wall_s"),
    (Claim("end.accuracy", "flash_async", "grpo_g8", True, "37.0 vs 30.3; 67.1 vs 60.3"),
     Claim("end.accuracy", "flash_sync", "grpo_g8", True, "38.0 vs 36.3 (at half the rollouts)"),
     Claim("end.accuracy", "flash_async", "flash_sync", True,
           "asynchrony costs no accuracy (no paper row: lag ~4-8 throughout)"),
     Claim("equal_time.accuracy", "flash_async", "grpo_g8", True,
           "asynchronous beats synchronous GRPO at equal wall-clock time"),
     Claim("equal_time.accuracy", "flash_async", "flash_sync", True,
           "generation overlaps updates"),
     Claim("train_wall_s", "flash_async", "grpo_g8", False, "(the time for equal rollouts)")),
    note="SmolLM2-135M-Instruct from its released weights, as `make demo` starts. "
         "flash_async is `make demo` itself (the system's worker samples at a fixed lag of 2 "
         "while the learner updates), stopped at update 24 of its 36; flash_sync and grpo_g8 are "
         "synchronous (`driver.rl_loop`). GRPO covers 1/8 of the prompts. Training seconds "
         "exclude held-out evaluations; accuracy against rollouts and seconds is in "
         "headline_lm_curves.png.")
SLOW = ("tool_use_lm", "headline_lm")

FAST = Comparison(
    "fast", "fast mode: signed vs positive-only on the copy task, tiny budget",
    "copy, 6 updates of B=8, 2 seeds", "(plumbing check, not a result)",
    _arms(dict(COPY, updates=6, batch_size=8, eval_n=16, sft_steps=20, sft_batch=16,
               copy_check=0.0),
          signed={}, positive_only=dict(advantage="positive_only")),
    ("end.accuracy", "curve_last.reward"),
    (Claim("end.accuracy", "signed", "positive_only", True, "(none: plumbing)"),))


def get(name: str) -> Comparison:
  if name == "fast":
    return FAST
  if name not in COMPARISONS:
    raise KeyError(f"unknown comparison {name!r}; choose from {sorted(COMPARISONS)} or fast")
  return COMPARISONS[name]


def metric(result: dict, path: str) -> float | None:
  """A run's figure by dotted path (see the module docstring)."""
  head, _, key = path.partition(".")
  curve = result["curve"]
  if head == "curve_last":
    tail = curve[-max(1, len(curve) // 4):]
    return sum(r[key] for r in tail) / len(tail)
  if head == "curve_max":
    return max(r[key] for r in curve)
  if head == "curve_mean":
    return sum(r[key] for r in curve) / len(curve)
  if head == "collapse_update":
    return collapse_update(curve)
  if key:
    return float(result[head][key])
  return None if result[head] is None else float(result[head])


def at_time(result: dict, seconds: float, key: str = "accuracy") -> float:
  """A run's held-out `key` at `seconds` of training, linear between its evaluations
  (`result["evals"]`: wall_s and figures; the last one's after its time)."""
  ev = result["evals"]
  for a, b in zip(ev, ev[1:]):
    if a["wall_s"] <= seconds <= b["wall_s"]:
      f = (seconds - a["wall_s"]) / max(b["wall_s"] - a["wall_s"], 1e-9)
      return float(a[key] + f * (b[key] - a[key]))
  return float(ev[-1][key] if seconds >= ev[-1]["wall_s"] else ev[0][key])


def equal_time(first: dict, second: dict, key: str = "accuracy") -> tuple[float, float]:
  """Both runs' held-out `key` at the training seconds of the shorter run."""
  t = min(first["evals"][-1]["wall_s"], second["evals"][-1]["wall_s"])
  return at_time(first, t, key), at_time(second, t, key)


def collapse_update(curve: list, window: int = 5) -> float:
  """The first version at which the moving mean reward (over `window` updates) falls below
  half of its best earlier value (best >= 0.2); the last version + 1 if it never does, so
  a higher number is more stable."""
  best = 0.0
  rewards = [r["reward"] for r in curve]
  for i in range(window - 1, len(rewards)):
    m = sum(rewards[i - window + 1:i + 1]) / window
    if best >= 0.2 and m < 0.5 * best:
      return float(curve[i]["version"])
    best = max(best, m)
  return float(curve[-1]["version"] + 1)
