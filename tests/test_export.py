"""Exports for serving, each read back by something other than its writer: the GGUF writer
through fr_jax's own loader (params and logits; f32 exact, f16 equal to the params rounded
to f16, q8_0 within half a quantum of a NumPy Q8_0 of our own) and its tokenizer fields
against the source GGUF's; llama.cpp's logits and tokens on the GGUF (skipped where
llama-cpp-python is not installed); `launch.export` end to end on a learner checkpoint, its
HF directory loaded by transformers and its GGUF by the loader; and its one-line errors.
`launch.evaluate` on the same checkpoint against a Learner that restored it, and the two
commands' shared --checkpoint resolution."""

import json
import subprocess
import sys

import gguf
import jax
import numpy as np
import pytest
import torch
import transformers

from experiments.configs import tiny_test
from fr_jax.learner.learner import Learner
from fr_jax.models import decoder, lora, registry
from fr_jax.models.gguf_io import (
  load_gguf,
  save_gguf,
  tokenizer_kv_from_gguf,
  tokenizer_kv_from_tokenizer,
)
from fr_jax.models.hf_io import CheckpointError
from fr_jax.models.tokenizer import Tokenizer
from tests.helpers import forward

BYTE_VOCAB = 320  # the byte-level tokenizer's 259 tokens, padded as tiny-chat's embedding is
FAMILIES = {"llama": "tiny-chat", "qwen2": "tiny-qwen2", "qwen3": "tiny-qwen3"}
TEXT = "<|im_start|>user\nWhat is 12 + 30? héllo ✓<|im_end|>\n"


def tiny(family):
  """A tiny config of `family` with the byte-level tokenizer's vocabulary and its eos id (as
  the GGUF writes it), and every tensor random: norms and biases too, so a bias or norm
  written to the wrong place changes the logits."""
  cfg = registry.TINY_CONFIGS[FAMILIES[family]].replace(vocab_size=BYTE_VOCAB,
                                                        eos_token_id=258)
  return cfg, random_params(cfg, seed=len(family))


def random_params(cfg, seed):
  rng = np.random.default_rng(seed)
  shapes = decoder.param_shapes(cfg)

  def draw(name, shape):
    if name.endswith("norm"):
      return (1.0 + 0.3 * rng.standard_normal(shape)).astype(np.float32)
    return ((0.3 if name.startswith("b") else 0.15) * rng.standard_normal(shape)).astype(
        np.float32)

  out = {k: draw(k, s) for k, s in shapes.items() if not isinstance(s, dict)}
  # The stacks: "layers", and an MoE model's "moe" (and "mlp").
  out.update({k: {n: draw(n, x) for n, x in s.items()} for k, s in shapes.items()
              if isinstance(s, dict)})
  return out


def logits(params, cfg, ids):
  ids = np.asarray([ids])
  h, _ = forward(params, cfg, ids, np.arange(ids.shape[1])[None])
  return np.asarray(decoder.logits_from_hidden(params, cfg, h))[0]


def leaves(params):
  return dict((jax.tree_util.keystr(k), np.asarray(v))
              for k, v in jax.tree_util.tree_flatten_with_path(params)[0])


def matrices(params):
  """{name: matrix} of the linear weights and embeddings (fr_jax layout; layer stacks keep
  their leading axis), the tensors a GGUF may store below f32."""
  out = {f"['{k}']": v for k, v in params.items() if k != "layers" and v.ndim == 2}
  out.update({f"['layers']['{k}']": v for k, v in params["layers"].items() if v.ndim == 3})
  return out


def f16_rounded(params):
  """What an f16 GGUF holds: matrices rounded to f16; 1-D tensors (norms, biases) f32, as
  llama.cpp's converter writes them."""
  r = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
  out = {k: (r(v) if v.ndim == 2 else v) for k, v in params.items() if k != "layers"}
  out["layers"] = {k: (r(v) if v.ndim == 3 else v) for k, v in params["layers"].items()}
  return out


# --- GGUF: the writer read back by fr_jax's loader ---------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gguf_f32_reads_back_exactly(family, tmp_path):
  cfg, params = tiny(family)
  tok = Tokenizer.byte_level()
  path = save_gguf(tmp_path / "m.gguf", params, cfg, tokenizer_kv_from_tokenizer(tok))
  got_cfg, got, reader = load_gguf(path)
  assert got_cfg == cfg
  want = leaves(params)
  assert leaves(got).keys() == want.keys()
  for k, a in leaves(got).items():
    np.testing.assert_array_equal(a, want[k], err_msg=k)
  ids = tok.encode(TEXT)
  want_logits = logits(params, cfg, ids)
  assert np.abs(want_logits).max() > 1.0  # a non-trivial model
  np.testing.assert_array_equal(logits(got, got_cfg, ids), want_logits)
  # The tokenizer fr_jax builds from the file encodes as the original does.
  assert Tokenizer.from_gguf(reader).encode(TEXT) == ids
  tokens = reader.fields["tokenizer.ggml.tokens"].contents()
  types = reader.fields["tokenizer.ggml.token_type"].contents()
  assert len(tokens) == BYTE_VOCAB and tokens[-1] == f"[PAD{BYTE_VOCAB - 1}]"
  assert types[256:260] == [3, 3, 3, gguf.TokenType.UNUSED]  # ChatML specials, then padding


def test_gguf_f16_holds_the_params_rounded_to_f16(tmp_path):
  cfg, params = tiny("qwen2")  # biases and an untied head
  path = save_gguf(tmp_path / "m.gguf", params, cfg,
                   tokenizer_kv_from_tokenizer(Tokenizer.byte_level()), dtype="f16")
  got_cfg, got, reader = load_gguf(path)
  assert got_cfg == cfg
  types = {t.name: t.tensor_type for t in reader.tensors}
  assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
  assert types["output.weight"] == gguf.GGMLQuantizationType.F16
  assert types["blk.0.attn_q.bias"] == types["blk.0.attn_norm.weight"] == \
      gguf.GGMLQuantizationType.F32
  rounded = leaves(f16_rounded(params))
  for k, a in leaves(got).items():
    np.testing.assert_array_equal(a, rounded[k], err_msg=k)
  ids = Tokenizer.byte_level().encode(TEXT)
  np.testing.assert_array_equal(logits(got, cfg, ids), logits(f16_rounded(params), cfg, ids))


def test_gguf_q8_0_is_within_half_a_quantum(tmp_path):
  cfg, params = tiny("llama")  # rows of 64, 128: whole 32-blocks
  path = save_gguf(tmp_path / "m.gguf", params, cfg,
                   tokenizer_kv_from_tokenizer(Tokenizer.byte_level()), dtype="q8_0")
  _, got, reader = load_gguf(path)
  assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == \
      {gguf.GGMLQuantizationType.Q8_0}
  # Q8_0 by hand: per 32 values along the input axis, scale d = max|x| / 127 stored as f16,
  # values round(x / d); so |x - d16 * q| <= d / 2 + |d16 - d| * 127.
  want, have, mats = leaves(params), leaves(got), matrices(params)
  for k, x in want.items():
    if k not in mats:
      np.testing.assert_array_equal(have[k], x, err_msg=k)  # 1-D tensors stay f32
      continue

    def hf(a, k=k):  # [out, in]
      return np.swapaxes(a, -1, -2) if "layers" in k else a

    blocks = hf(x).reshape(-1, 32).astype(np.float64)
    d = np.abs(blocks).max(-1, keepdims=True) / 127
    bound = d / 2 + np.abs(d.astype(np.float16).astype(np.float64) - d) * 127 + 1e-7
    err = np.abs(hf(have[k]).reshape(-1, 32) - blocks)
    assert (err <= bound).all(), (k, float((err - bound).max()))
    assert (err > 0).any()  # it was quantized
  ids = Tokenizer.byte_level().encode(TEXT)
  want_logits = logits(params, cfg, ids)
  assert np.abs(logits(got, cfg, ids) - want_logits).max() < 0.1 * np.abs(want_logits).max()


def test_gguf_tokenizer_copied_from_the_source_gguf(tmp_path):
  source = gguf.GGUFReader(str(registry.smollm2_gguf_path()))
  cfg = registry.TINY_CONFIGS["tiny-chat"].replace(vocab_size=49152, bos_token_id=1,
                                                   eos_token_id=2)
  params = random_params(cfg, seed=5)
  path = save_gguf(tmp_path / "m.gguf", params, cfg, tokenizer_kv_from_gguf(source),
                   dtype="f16")
  got_cfg, _, reader = load_gguf(path)
  assert got_cfg == cfg
  keys = sorted(k for k in source.fields if k.startswith("tokenizer."))
  assert keys == sorted(k for k in reader.fields if k.startswith("tokenizer."))
  for k in keys:
    assert reader.fields[k].contents() == source.fields[k].contents(), k
    assert reader.fields[k].types == source.fields[k].types, k


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "qwen2", "llama-bpe"])
def test_bpe_tokenizer_reads_back_from_the_gguf(pre, tmp_path):
  """A byte-level BPE tokenizer with merges, written as GGUF fields, encodes as before once
  fr_jax rebuilds it from the file."""
  import tokenizers

  from fr_jax.models import tokenizer as toklib
  chars = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet(), key=toklib._BYTE_OF.get)
  merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("a", "t"), ("c", "at")]
  vocab = {ch: i for i, ch in enumerate(chars)}
  for a, b in merges:
    vocab[a + b] = len(vocab)
  t = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
  t.pre_tokenizer = toklib._pre_tokenizer(pre)
  t.decoder = tokenizers.decoders.ByteLevel()
  t.add_special_tokens([tokenizers.AddedToken("<|im_end|>", special=True, normalized=False)])
  tok = Tokenizer(t, eos_token="<|im_end|>")
  kv = tokenizer_kv_from_tokenizer(tok)
  assert kv["tokenizer.ggml.pre"].value == {"gpt2": "gpt-2"}.get(pre, pre)  # llama.cpp's names
  cfg = registry.TINY_CONFIGS["tiny-chat"].replace(eos_token_id=len(vocab))
  path = save_gguf(tmp_path / "m.gguf", random_params(cfg, 1), cfg, kv)
  back = Tokenizer.from_gguf(gguf.GGUFReader(str(path)))
  text = "Then the cat sat, 12345 cats at the  door.<|im_end|>"
  ids = tok.encode(text)
  assert len(ids) < len(text.encode())  # the merges were used
  assert back.encode(text) == ids and back.eos_id == len(vocab)


def test_gguf_refuses_what_the_loader_cannot_read(tmp_path):
  tok = Tokenizer.byte_level()
  cfg = registry.TINY_CONFIGS["tiny-llama"].replace(vocab_size=BYTE_VOCAB)  # Llama-3 rope
  params = random_params(cfg, 0)
  with pytest.raises(CheckpointError, match=r"rope_llama3=.*export --format=hf"):
    save_gguf(tmp_path / "m.gguf", params, cfg, tokenizer_kv_from_tokenizer(tok))
  small = registry.TINY_CONFIGS["tiny-qwen2"]  # 256 rows for 259 tokens
  with pytest.raises(CheckpointError, match="259 tokens but the model's embedding has 256"):
    save_gguf(tmp_path / "m.gguf", random_params(small, 0), small,
              tokenizer_kv_from_tokenizer(tok))
  with pytest.raises(CheckpointError, match="GGUF dtype 'q4_0'"):
    save_gguf(tmp_path / "m.gguf", params, cfg, {}, dtype="q4_0")
  assert not list(tmp_path.iterdir())  # nothing half-written
  import tokenizers
  wordpiece = Tokenizer(tokenizers.Tokenizer(tokenizers.models.WordPiece({"[UNK]": 0, "a": 1},
                                                                         unk_token="[UNK]")))
  with pytest.raises(CheckpointError, match="only byte-level BPE"):
    tokenizer_kv_from_tokenizer(wordpiece)


# --- llama.cpp runs the GGUF --------------------------------------------------------------------

@pytest.mark.parametrize("family,dtype,atol", [("llama", "f32", 2e-5), ("qwen2", "f32", 2e-5),
                                               ("qwen3", "f32", 2e-5), ("llama", "q8_0", 0.1)])
def test_llama_cpp_logits_and_tokens_match(family, dtype, atol, tmp_path):
  llama_cpp = pytest.importorskip("llama_cpp")
  cfg, params = tiny(family)
  tok = Tokenizer.byte_level()
  path = save_gguf(tmp_path / "m.gguf", params, cfg, tokenizer_kv_from_tokenizer(tok),
                   dtype=dtype)
  ids = tok.encode(TEXT)
  llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False,
                        n_threads=2, type_k=0, type_v=0)  # an f32 KV cache
  assert llm.tokenize(TEXT.encode(), add_bos=False, special=True) == ids
  llm.eval(ids)
  got = np.asarray(llm.scores[:len(ids)])
  want = logits(params, cfg, ids)
  assert np.abs(want).max() > 1.0
  np.testing.assert_allclose(got, want, atol=atol * np.abs(want).max(), rtol=0)
  assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9


# --- launch.export end to end ------------------------------------------------------------------

def _export(*args):
  return subprocess.run([sys.executable, "-m", "launch.export", *args], capture_output=True,
                        text=True, timeout=300)


def _evaluate(*args):
  return subprocess.run([sys.executable, "-m", "launch.evaluate", f"--config={tiny_test.__file__}",
                         *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """A run directory holding one learner checkpoint of tiny_test (tiny-chat), whose params
  were replaced by random ones (so an export of the base model's init would fail), the
  end-of-turn token's (tied) embedding scaled so that greedy replies stop after a number of
  tokens that varies by prompt: held-out numbers that depend on the parameters."""
  return _random_run(tmp_path_factory.mktemp("run"), "tiny-chat", seed=9, eos_scale=1.8)


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
  """tiny_run's checkpoint for tiny_test on tiny-chat-moe (a Qwen3-MoE)."""
  return _random_run(tmp_path_factory.mktemp("moe_run"), "tiny-chat-moe", seed=10)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  """tiny_run's checkpoint for tiny_test with LoRA (rank 4, every projection), its
  adapters random too."""
  return _random_run(tmp_path_factory.mktemp("lora_run"), "tiny-chat", seed=11,
                     **{"model.lora.rank": 4, "model.lora.alpha": 8.0})


def _random_run(run, model_name, seed, eos_scale=1.0, **over):
  c = tiny_test.get_config()
  c.update_from_flattened_dict(over)
  c.model.name = model_name
  c.checkpoint.dir = str(run / "checkpoints")
  learner = Learner(c)
  cfg = learner.model_config
  params = random_params(cfg, seed=seed)
  params["embed"][Tokenizer.byte_level().token_id("<|im_end|>")] *= eos_scale
  shardings = jax.tree.map(lambda a: a.sharding, learner.state.params)
  learner.state = learner.state._replace(params=jax.device_put(params, shardings))
  assert learner.save(force=True)
  learner.close()
  return run, cfg, params


def test_export_hf_loads_in_transformers(tiny_run, tmp_path):
  run, cfg, params = tiny_run
  r = _export(f"--checkpoint={run}", "--format=hf", f"--out={tmp_path / 'hf'}")
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert (out["format"], out["step"], out["model"]) == ("hf", 0, "tiny-chat")
  assert out["checkpoint"] == str(run / "checkpoints")
  assert "export: restored 0.1M parameters" in r.stderr
  model = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "hf", attn_implementation="eager", dtype=torch.float32).eval()
  hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
  ids = Tokenizer.byte_level().encode(TEXT)
  assert hf_tok(TEXT, add_special_tokens=False)["input_ids"] == ids
  with torch.no_grad():
    want = model(torch.as_tensor([ids])).logits[0].numpy()
  np.testing.assert_allclose(logits(params, cfg, ids), want, atol=1e-4, rtol=0)


def test_export_gguf_reads_back(tiny_run, tmp_path):
  run, cfg, params = tiny_run
  r = _export(f"--checkpoint={run / 'checkpoints'}", "--step=0", "--format=gguf",
              "--dtype=f16", f"--out={tmp_path}")
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["out"] == str(tmp_path / "model-f16.gguf") and out["dtype"] == "f16"
  assert out["checkpoint"] == str(run / "checkpoints")
  assert "tokenizer built from its BPE tokenizer" in r.stderr
  got_cfg, got, reader = load_gguf(tmp_path / "model-f16.gguf")
  # tiny-chat has no eos id of its own; the GGUF carries the tokenizer's (<|im_end|>).
  assert got_cfg == cfg.replace(eos_token_id=258)
  rounded = leaves(f16_rounded(params))
  for k, a in leaves(got).items():
    np.testing.assert_array_equal(a, rounded[k], err_msg=k)
  assert Tokenizer.from_gguf(reader).encode(TEXT) == Tokenizer.byte_level().encode(TEXT)


def test_export_errors_are_one_line(tiny_run, tmp_path):
  run, _, _ = tiny_run
  cases = [  # --checkpoint's errors: test_evaluate_and_export_resolve_checkpoint_alike
      ((f"--checkpoint={run}", "--format=onnx", f"--out={tmp_path / 'o'}"),
       "error: flag --format=onnx: value should be one of <hf|gguf|peft>"),
      ((f"--checkpoint={run}", "--format=gguf", "--dtype=bf16", f"--out={tmp_path / 'o'}"),
       "error: --dtype=bf16 is not available for --format=gguf: choose one of"),
  ]
  for args, message in cases:
    r = _export(*args)
    assert r.returncode == 2 and message in r.stderr, (args, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
  assert not (tmp_path / "o").exists()


def test_evaluate_and_export_resolve_checkpoint_alike(tiny_run, tmp_path):
  """One --checkpoint/--step resolver: a run directory and its checkpoints/ name the same
  step; a missing directory, a directory with no committed step (but a warm start's) and a
  missing step give both commands the same one-line error."""
  from launch import common
  run, _, _ = tiny_run
  assert common.find_checkpoint(str(run)) == common.find_checkpoint(str(run / "checkpoints")) \
      == (run / "checkpoints", 0)
  warm = tmp_path / "warm"
  (warm / "sft").mkdir(parents=True)
  (warm / "sft" / "checkpoints").symlink_to(run / "checkpoints")  # a committed step 0
  cases = [
      ((f"--checkpoint={warm}",),
       f"error: --checkpoint={warm}: no committed checkpoint in {warm}/checkpoints or {warm}; "
       f"the warm start's checkpoints are in {warm}/sft: pass --checkpoint={warm}/sft\n"),
      ((f"--checkpoint={tmp_path / 'nope'}",),
       f"error: --checkpoint={tmp_path / 'nope'}: no such directory; give a run directory"),
      ((f"--checkpoint={run}", "--step=3"),
       f"error: --step=3: {run}/checkpoints has committed steps [0]\n"),
  ]
  for args, message in cases:
    ex = _export(*args, "--format=hf", f"--out={tmp_path / 'o'}")
    ev = _evaluate(*args)
    assert ex.returncode == 2 and message in ex.stderr, (args, ex.stderr)
    assert len(ex.stderr.strip().splitlines()) == 1, ex.stderr
    assert (ev.returncode, ev.stderr) == (2, ex.stderr), (args, ev.stderr)
  assert not (tmp_path / "o").exists()


def test_evaluate_checkpoint_matches_the_restored_learner(tiny_run):
  """launch.evaluate --checkpoint=<run> reads the parameters alone (no Learner) and reports
  what evaluating the params of a Learner that restored the run's full train state gives."""
  from fr_jax import envs, system
  from fr_jax.evaluate import evaluate
  from launch import common
  run, _, params = tiny_run
  r = _evaluate(f"--checkpoint={run}", "--n=6")
  assert r.returncode == 0, r.stderr
  got = json.loads(r.stdout.strip().splitlines()[-1])
  c = tiny_test.get_config()
  c.checkpoint.dir = str(run / "checkpoints")
  model = registry.load_configured(c.model)
  learner = Learner(c, model=model)
  learner.restore()
  restored = leaves(learner.params)
  # The shared reader's parameters: the saved ones, as the learner restores them.
  read, meta = common.read_checkpoint(run / "checkpoints" / "0")
  assert meta["policy_version"] == learner.version == 0
  for k, a in leaves(read).items():
    np.testing.assert_array_equal(restored[k], leaves(params)[k], err_msg=k)
    assert a.dtype == restored[k].dtype == np.float32, k
    np.testing.assert_array_equal(a, restored[k], err_msg=k)
  env = envs.make(c.env.name, **c.env.kwargs.to_dict())
  want = evaluate(model.config, learner.params, model.tokenizer, env, system.agent_config(c),
                  n=6)
  learner.close()
  assert 0 < want["truncation_rate"] < 1  # replies stop at lengths set by the parameters
  assert got.pop("seconds") >= 0 and want.pop("seconds") >= 0
  assert got == {"model": "tiny-chat", "checkpoint": str(run / "checkpoints" / "0"),
                 "version": 0, **want}


def test_export_moe_hf_loads_in_transformers_and_gguf_is_refused(moe_run, tmp_path):
  run, cfg, params = moe_run
  assert cfg.is_moe
  r = _export(f"--checkpoint={run}", "--format=hf", f"--out={tmp_path / 'hf'}")
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert (out["model"], out["family"]) == ("tiny-chat-moe", "qwen3_moe")
  model = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "hf", attn_implementation="eager", dtype=torch.float32).eval()
  assert type(model) is transformers.Qwen3MoeForCausalLM
  ids = Tokenizer.byte_level().encode(TEXT)
  with torch.no_grad():
    want = model(torch.as_tensor([ids])).logits[0].numpy()
  np.testing.assert_allclose(logits(params, cfg, ids), want, atol=1e-4, rtol=0)
  r = _export(f"--checkpoint={run}", "--format=gguf", f"--out={tmp_path / 'g'}")
  # The refusal comes once the run's model is known (after the progress lines): one line.
  last = r.stderr.strip().splitlines()[-1]
  assert r.returncode == 2 and last.startswith("error: family 'qwen3_moe'"), r.stderr
  assert "qwen3moe GGUF tensor layout" in last and last.endswith("--format=hf"), r.stderr
  assert not (tmp_path / "g").exists()


def test_export_lora_as_peft_and_merged(lora_run, tiny_run, tmp_path):
  """A LoRA run: --format=peft loads with PEFT (adapter and base/) and --format=hf holds the
  merged model; both give the adapted model's logits in transformers."""
  import peft
  run, cfg, params = lora_run
  assert cfg.lora_rank == 4 and "wq_lora_a" in params["layers"]
  ids = Tokenizer.byte_level().encode(TEXT)
  ours = logits(params, cfg, ids)
  r = _export(f"--checkpoint={run}", "--format=peft", f"--out={tmp_path / 'peft'}")
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["format"] == "peft" and str(tmp_path / "peft" / "base" / "config.json") in out["files"]
  model = peft.AutoPeftModelForCausalLM.from_pretrained(
      tmp_path / "peft", attn_implementation="eager", dtype=torch.float32).eval()
  with torch.no_grad():
    got = model(torch.as_tensor([ids])).logits[0].numpy()
    base = model.get_base_model()
    with model.disable_adapter():
      without = model(torch.as_tensor([ids])).logits[0].numpy()
  assert np.abs(got - ours).max() <= 1e-5, np.abs(got - ours).max()
  assert np.abs(without - got).max() > 0.1 and type(base) is transformers.LlamaForCausalLM
  r = _export(f"--checkpoint={run}", "--format=hf", f"--out={tmp_path / 'hf'}")
  assert r.returncode == 0, r.stderr
  assert "folding the LoRA adapters (rank 4) into their weights" in r.stderr
  merged = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "hf", attn_implementation="eager", dtype=torch.float32).eval()
  with torch.no_grad():
    got = merged(torch.as_tensor([ids])).logits[0].numpy()
  # The merged model is what fr_jax's engines run (lora.merged); folding A B into W rounds
  # differently from applying them on the fly, within float32's noise on these logits.
  plain = cfg.replace(lora_rank=0, lora_targets=())
  want = logits(jax.tree.map(np.asarray, lora.merged(params, cfg)), plain, ids)
  assert np.abs(got - want).max() <= 1e-5, np.abs(got - want).max()
  assert np.abs(got - ours).max() <= 1e-4, np.abs(got - ours).max()
