r"""Export a training run's checkpoint for serving: a Hugging Face directory or a GGUF file.

  python -m launch.export --checkpoint=runs/demo --format=hf --out=/tmp/demo-hf
  python -m launch.export --checkpoint=runs/demo --format=gguf --dtype=f16 --out=/tmp/demo-gguf
  python -m launch.export --checkpoint=runs/demo/checkpoints --step=20 --format=gguf \
      --dtype=q8_0 --out=/tmp/demo.q8_0.gguf
  python -m launch.export --checkpoint=runs/lora --format=peft --out=/tmp/lora-adapter

--checkpoint is a run directory written by `launch.train` (its `checkpoints/` holds the
Orbax steps) or that `checkpoints/` directory itself; --step picks a committed step (default:
the newest). Only the parameters are read from the step (an Orbax partial restore, straight
to host NumPy arrays: no optimizer state, no device copy). The model's config and tokenizer
come from the run's own config (`model.name`, read as `registry.load` reads it, metadata
only), so the base model's files must still be where the run found them.

  --format=hf    config.json, model.safetensors (sharded above 5 GiB) and the tokenizer's
                 files (`hf_io.export_hf`, the learner's own export): transformers, SGLang,
                 vLLM. --dtype f32 (default) or bf16.
  --format=gguf  one GGUF file (`gguf_io.save_gguf`, the inverse of fr_jax's loader):
                 llama.cpp, Ollama. --dtype f32 (default), f16 or q8_0. --out ending in .gguf
                 names the file; otherwise it is a directory and the file is
                 model-{dtype}.gguf in it. The tokenizer is copied from the base model's
                 GGUF, or built from its byte-level BPE tokenizer.
  --format=peft  a run trained with LoRA (model.lora.rank > 0): the adapters as a PEFT
                 adapter directory (adapter_config.json, adapter_model.safetensors, f32),
                 and the base model it adapts as a HF directory in its base/ (named by the
                 adapter config's base_model_name_or_path), so that
                 `peft.AutoPeftModelForCausalLM.from_pretrained(OUT)` loads the pair.

A LoRA run's hf and gguf exports hold the merged model (each adapter folded into its
weight: `fr_jax.models.lora.merged`).

Progress lines go to stderr; the last stdout line is a JSON summary. A bad flag, a missing
checkpoint or step and a model that cannot be written in the format print one line and exit
with status 2.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from absl import flags

from launch import common

flags.DEFINE_string("checkpoint", None, "a run directory (with checkpoints/) or its "
                    "checkpoints/ directory")
flags.DEFINE_enum("format", None, ["hf", "gguf", "peft"], "hf: safetensors directory; gguf: "
                  "one llama.cpp file; peft: a LoRA run's adapters (and base/)")
flags.DEFINE_string("out", None, "output directory (gguf: or a .gguf file path)")
flags.DEFINE_integer("step", None, "checkpoint step to export (default: the newest committed)")
flags.DEFINE_enum("dtype", "f32", ["f32", "bf16", "f16", "q8_0"],
                  "hf: f32 or bf16; gguf: f32, f16 or q8_0")
for _name in ("checkpoint", "format", "out"):
  flags.mark_flag_as_required(_name)
FLAGS = flags.FLAGS

DTYPES = {"hf": ("f32", "bf16"), "gguf": ("f32", "f16", "q8_0"), "peft": ("f32",)}
log = logging.getLogger("fr_jax.export")


# --- the model ---------------------------------------------------------------------------------

def model_of_run(config: dict, params):
  """The run's ModelConfig (as the learner built it), tokenizer and source GGUF reader,
  checked against the checkpoint's parameter shapes."""
  from fr_jax.models import decoder, lora, registry
  from fr_jax.models.config import ConfigError
  from fr_jax.models.hf_io import CheckpointError
  from fr_jax.transport.codec import flatten
  m = config["model"]
  try:
    info = registry.describe(m["name"])
    cfg, tok, reader = info.config, info.tokenizer, info.gguf_reader
  except (registry.ModelNotFound, CheckpointError) as e:
    raise common.UsageError(f"the run's model.name={m['name']!r}: {e} (a relative path is read "
                            "from this directory; run from where the run was started)") from None
  # As the learner builds it; the head is tied where the checkpoint has no lm_head.
  try:
    cfg = cfg.replace(param_dtype=m["param_dtype"], compute_dtype=m["compute_dtype"],
                      attention=m["attention"], tie_embeddings="lm_head" not in params,
                      **lora.config_fields(m))
  except ConfigError as e:
    raise common.UsageError(f"the run's model config: {e}") from None
  common.check_params(params, flatten(decoder.param_shapes(cfg)), m["name"])
  return cfg, tok, reader


# --- export ------------------------------------------------------------------------------------

def export(checkpoint: str, fmt: str, out: str, step=None, dtype: str = "f32") -> dict:
  """Writes the export; returns the summary printed as the last stdout line."""
  if dtype not in DTYPES[fmt]:
    raise common.UsageError(f"--dtype={dtype} is not available for --format={fmt}: choose "
                            f"one of {DTYPES[fmt]}")
  d, step = common.find_checkpoint(checkpoint, step)
  t0 = time.perf_counter()
  log.info("reading step %d from %s (parameters only)", step, d)
  params, meta = common.read_checkpoint(d / str(step))
  import jax
  import numpy as np

  from fr_jax.transport.codec import flatten
  n = sum(a.size for a in flatten(params).values())
  nbytes = sum(a.nbytes for a in flatten(params).values())
  log.info("restored %.1fM parameters (%.0f MB) in %.1fs", n / 1e6, nbytes / 1e6,
           time.perf_counter() - t0)
  t1 = time.perf_counter()
  cfg, tok, reader = model_of_run(meta["config"], params)
  log.info("model %s (%s family): config and tokenizer read in %.1fs",
           meta["config"]["model"]["name"], cfg.family, time.perf_counter() - t1)
  from fr_jax.models import gguf_io, hf_io, lora
  if fmt == "peft" and not cfg.lora_rank:
    raise common.UsageError("--format=peft exports LoRA adapters, and this run trained none "
                            "(model.lora.rank = 0): use --format=hf or --format=gguf")
  if fmt != "peft" and cfg.lora_rank:
    log.info("folding the LoRA adapters (rank %d) into their weights", cfg.lora_rank)
    params = jax.tree.map(np.asarray, lora.merged(params, cfg))
    cfg = cfg.replace(lora_rank=0, lora_targets=())
  t1 = time.perf_counter()
  try:
    if fmt == "peft":
      _, base = lora.split(params)
      base_dir = Path(out).absolute() / "base"
      log.info("writing the base model (HF, f32) to %s", base_dir)
      base_cfg = cfg.replace(lora_rank=0, lora_targets=())
      hf_io.export_hf(base_dir, base, base_cfg, tok)
      log.info("writing the PEFT adapter (rank %d, targets %s) to %s", cfg.lora_rank,
               ",".join(cfg.lora_targets), out)
      path = hf_io.save_peft(out, params, cfg, base_model=str(base_dir))
      files = sorted(str(p) for p in [*path.iterdir(), *base_dir.iterdir()] if p.is_file())
    elif fmt == "hf":
      import ml_dtypes
      np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bf16" else np.dtype(np.float32)
      params = {k: _cast(v, np_dtype) for k, v in params.items()}
      cfg = cfg.replace(param_dtype="bfloat16" if dtype == "bf16" else "float32")
      log.info("writing a Hugging Face directory (%s%s) to %s", dtype,
               "" if tok is not None else ", no tokenizer: the base model has none", out)
      path = hf_io.export_hf(out, params, cfg, tok)
      files = sorted(str(p) for p in path.iterdir() if p.is_file())
    else:
      gguf_io.check_gguf_exportable(cfg)
      if reader is not None:
        kv = gguf_io.tokenizer_kv_from_gguf(reader)
        source = f"copied from {getattr(reader.data, 'filename', 'the base GGUF')}"
      elif tok is not None:
        kv, source = gguf_io.tokenizer_kv_from_tokenizer(tok), "built from its BPE tokenizer"
      else:
        raise common.UsageError(f"model {meta['config']['model']['name']!r} has no "
                                "tokenizer, and llama.cpp needs one in the GGUF; use "
                                "--format=hf")
      path = Path(out) if out.endswith(".gguf") else Path(out) / f"model-{dtype}.gguf"
      log.info("writing GGUF %s (%s; tokenizer %s)", path, dtype, source)
      name = f"{meta['config']['model']['name']} fr_jax step {step}"
      path = gguf_io.save_gguf(path, params, cfg, kv, dtype=dtype, name=name)
      files = [str(path)]
  except hf_io.CheckpointError as e:
    raise common.UsageError(str(e)) from None
  size = sum(Path(f).stat().st_size for f in files)
  log.info("done: %s (%.1f MB) in %.1fs", path, size / 1e6, time.perf_counter() - t1)
  return {"format": fmt, "dtype": dtype, "checkpoint": str(d), "step": step,
          "model": meta["config"]["model"]["name"], "family": cfg.family, "out": str(path),
          "files": files, "bytes": size, "seconds": round(time.perf_counter() - t0, 1)}


def _cast(tree, np_dtype):
  if isinstance(tree, dict):
    return {k: _cast(v, np_dtype) for k, v in tree.items()}
  return tree.astype(np_dtype, copy=False)


def _progress_to_stderr():
  """fr_jax's INFO lines (this script's, the GGUF writer's) on stderr, as `export: ...`; the
  gguf package's own chatter and Orbax's stay quiet."""
  h = logging.StreamHandler(sys.stderr)
  h.setFormatter(logging.Formatter("export: %(message)s"))
  lg = logging.getLogger("fr_jax")
  lg.addHandler(h)
  lg.setLevel(logging.INFO)
  lg.propagate = False
  logging.getLogger("gguf").setLevel(logging.WARNING)


def main(argv):
  if len(argv) > 1:
    common.fail(f"unexpected arguments {argv[1:]}")
  from absl import logging as absl_logging
  if not FLAGS["verbosity"].present:
    absl_logging.set_verbosity(absl_logging.WARNING)
  _progress_to_stderr()
  common.print_json(export(FLAGS.checkpoint, FLAGS.format, FLAGS.out, FLAGS.step, FLAGS.dtype))


if __name__ == "__main__":
  common.run(main)
