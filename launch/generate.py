r"""Generate from, or score with, a model.

  python -m launch.generate --model=smollm2-135m-instruct \
      --prompt="The capital of France is" --max_new_tokens=16 --temperature=0 --json
  python -m launch.generate --model=smollm2-135m-instruct --prompt="What is 7*6?" --chat
  python -m launch.generate --model=tiny-llama --score_ids=1,2,3,4 --json

With --prompt it prints the continuation (with --json: one object with prompt_token_ids,
token_ids (generated only), logprobs (one per generated token, under the sampling
distribution: softmax(logits / temperature), renormalised over the nucleus when top_p < 1;
log_softmax(logits) for greedy --temperature=0), text and finish_reason).

With --score_ids it prints token_ids and logprobs, where logprobs[k] = log p(token_ids[k] |
token_ids[:k]) at --temperature (1 if 0) for k >= 1 and logprobs[0] is null.

Unknown model names, missing files and malformed ids print one line on stderr and exit 2.
"""

import json
import sys

from absl import app, flags, logging

flags.DEFINE_string("model", "smollm2-135m-instruct",
                    "registry name, hf:DIR, a HF directory, gguf:FILE or a .gguf path")
flags.DEFINE_string("prompt", None, "text prompt to continue")
flags.DEFINE_string("score_ids", None, "comma-separated token ids to score instead of --prompt")
flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate at most")
flags.DEFINE_float("temperature", 1.0, "sampling temperature; 0 means greedy")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass in (0, 1]")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_bool("chat", False, "wrap the prompt as a user turn in the model's chat template")
flags.DEFINE_bool("json", False, "print one JSON object instead of text")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "parameter and compute dtype")
FLAGS = flags.FLAGS


class UsageError(Exception):
  pass


def _parse_ids(text: str) -> list[int]:
  try:
    ids = [int(x) for x in text.split(",") if x.strip() != ""]
  except ValueError:
    raise UsageError(f"--score_ids={text!r} is malformed: give comma-separated integers") from None
  if not ids:
    raise UsageError("--score_ids is empty: give at least one token id")
  return ids


def _check_flags():
  if (FLAGS.prompt is None) == (FLAGS.score_ids is None):
    raise UsageError("give exactly one of --prompt or --score_ids")
  if FLAGS.max_new_tokens < 1:
    raise UsageError(f"--max_new_tokens={FLAGS.max_new_tokens} must be >= 1")
  if FLAGS.temperature < 0:
    raise UsageError(f"--temperature={FLAGS.temperature} must be >= 0")
  if not 0 < FLAGS.top_p <= 1:
    raise UsageError(f"--top_p={FLAGS.top_p} must be in (0, 1]")


def run() -> dict:
  _check_flags()
  ids = _parse_ids(FLAGS.score_ids) if FLAGS.score_ids is not None else None
  # Heavy imports after flag checks, so usage errors are instant.
  import jax.numpy as jnp

  from fr_jax.models import decoder, registry, scoring
  from fr_jax.models.hf_io import CheckpointError
  from fr_jax.rollout.embedded import EmbeddedEngine
  from fr_jax.rollout.engine import Request
  try:
    m = registry.load(FLAGS.model, param_dtype=FLAGS.dtype, compute_dtype=FLAGS.dtype)
  except (registry.ModelNotFound, CheckpointError, FileNotFoundError) as e:
    raise UsageError(str(e)) from None
  cfg, tok = m.config, m.tokenizer

  if ids is not None:
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
      raise UsageError(f"--score_ids has ids outside [0, {cfg.vocab_size}): {bad[:5]}")
    t = FLAGS.temperature if FLAGS.temperature > 0 else 1.0
    x = jnp.asarray([ids], jnp.int32)
    pos = jnp.arange(len(ids))[None]
    h, _ = decoder.forward(m.params, cfg, x, pos)
    logp, _ = scoring.score_hidden(m.params, cfg, h[:, :-1], x[:, 1:], t)
    return {"model": FLAGS.model, "token_ids": ids,
            "logprobs": [None] + [float(v) for v in logp[0]]}

  if tok is None:
    raise UsageError(f"model {FLAGS.model!r} has no tokenizer; use --score_ids")
  text = FLAGS.prompt
  if FLAGS.chat:
    text = tok.apply_chat_template([{"role": "user", "content": text}])
  prompt_ids = tok.encode(text)
  total = len(prompt_ids) + FLAGS.max_new_tokens
  if total > cfg.max_position_embeddings:
    raise UsageError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({FLAGS.max_new_tokens}) = "
                     f"{total} exceeds the model's {cfg.max_position_embeddings} positions")
  engine = EmbeddedEngine(cfg, m.params, tokenizer=tok, num_slots=1, max_len=total)
  try:
    (c,) = engine.generate([Request("cli", prompt_ids, FLAGS.max_new_tokens,
                                    temperature=FLAGS.temperature, top_p=FLAGS.top_p,
                                    seed=FLAGS.seed, stop_token_ids=tuple(tok.stop_ids()))])
  except ValueError as e:
    raise UsageError(str(e)) from None
  return {"model": FLAGS.model, "prompt_token_ids": prompt_ids, "token_ids": c.token_ids,
          "logprobs": c.logprobs, "text": tok.decode(c.token_ids, skip_special_tokens=True),
          "finish_reason": c.finish_reason}


def parse_flags_or_exit(argv):
  """absl flag parsing, with a one-line error and exit code 2 on a bad flag."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    print(f"{argv[0]}: {e}", file=sys.stderr)
    sys.exit(2)


def main(argv):
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    print(f"generate: unexpected arguments {argv[1:]}", file=sys.stderr)
    sys.exit(2)
  try:
    result = run()
  except UsageError as e:
    print(f"generate: {e}", file=sys.stderr)
    sys.exit(2)
  if FLAGS.json:
    print(json.dumps(result))
  elif "text" in result:
    print(result["text"])
  else:
    for i, lp in zip(result["token_ids"], result["logprobs"]):
      print(i, "" if lp is None else f"{lp:.6f}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags_or_exit)
