"""vLLM's own offline `LLM.generate` on a list of requests: the peer the vLLM engine's answers
are checked against (tests/test_vllm.py). Runs with .venv-vllm's python, not .venv's.

  .venv-vllm/bin/python tests/vllm_offline.py MODEL_DIR DTYPE REQUESTS.json OUT.json

Each request is {"prompt_ids", "max_new_tokens", "temperature", "top_p", "seed",
"stop_token_ids", "stop"}; each answer {"token_ids", "logprobs", "finish_reason"}, in order,
with the same sampling settings the server is given (fr_jax/rollout/vllm.py: processed
log-probs, EOS ignored unless listed, a stop string kept in the output).
"""

import json
import sys


def main(model_dir, dtype, requests_path, out_path):
  from vllm import LLM, SamplingParams
  from vllm.inputs import TokensPrompt
  reqs = json.load(open(requests_path))
  llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, max_model_len=512,
            logprobs_mode="processed_logprobs", seed=0)
  prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in reqs]
  params = [SamplingParams(max_tokens=r["max_new_tokens"], temperature=r["temperature"],
                           top_p=r["top_p"], seed=r["seed"], logprobs=0, ignore_eos=True,
                           stop_token_ids=r["stop_token_ids"] or None,
                           stop=r.get("stop") or None, include_stop_str_in_output=True,
                           skip_special_tokens=False) for r in reqs]
  outs = llm.generate(prompts, params, use_tqdm=False)
  answers = []
  for o in outs:
    c = o.outputs[0]
    answers.append({"token_ids": list(c.token_ids),
                    "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                    "finish_reason": c.finish_reason})
  json.dump(answers, open(out_path, "w"))


if __name__ == "__main__":
  main(*sys.argv[1:])
