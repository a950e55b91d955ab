"""cpu_lora (`make demo LORA=1`): `make demo` (cpu_default) with LoRA. The learner trains
rank-16 adapters (alpha 32, scale 2) on every projection of SmolLM2-135M-Instruct and
nothing else: no gradient of a base weight, Adam's moments for the adapters only (4.9M
parameters against 135M); the engine runs the merged model (`fr_jax.models.lora`).

  make demo LORA=1
  python -m launch.train --config=experiments/configs/cpu_lora.py --run_dir=runs/demo_lora
  python -m launch.export --checkpoint=runs/demo_lora --format=peft --out=/tmp/demo-adapter

Hardware: 2 cores and about 10 GB of memory (peak RSS 9.1-9.3 GiB against cpu_default's
12.9-13.7: no AdamW moments or gradients for the 135M base weights). Time: as cpu_default's,
13-26 minutes (0.83-1.00x cpu_default's on the same seed, back to back: docs/lora.md).
Held-out gain on seeds 0/1/2: +15.5 / +17.5 / +12.5 points, against cpu_default's +21.0 /
+16.5 / +17.5 in the same session; full fine-tuning learns more where memory allows.

Everything else is cpu_default's (the same prompts, batches, evaluations and lag), but the
learning rate and the reduction. LoRA's best rate is about 10x full fine-tuning's (Schulman et
al., "LoRA Without Regret", 2025, measured it for RL and SFT), so 5e-5 against the 5e-6 that
cpu_default had then; not tuned here. The reduction stays sample_mean, with which the figures
above were measured: cpu_default moved to `constant_length` at lr 1e-5 afterwards (issue 56),
and LoRA under that recipe has not been measured.
"""

from experiments.configs import cpu_default


def get_config():
  c = cpu_default.get_config()
  c.model.lora.rank = 16
  c.model.lora.alpha = 32.0
  c.model.lora.targets = "wq,wk,wv,wo,w_gate,w_up,w_down"
  c.optim.lr = 5e-5
  c.objective.reduction = "sample_mean"  # as measured (docs/lora.md); cpu_default's is not
  return c
