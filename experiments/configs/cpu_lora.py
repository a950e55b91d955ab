"""cpu_lora (`make demo LORA=1`): `make demo` (cpu_default) with LoRA. The learner trains
rank-16 adapters (alpha 32, scale 2) on every projection of SmolLM2-135M-Instruct and
nothing else: no gradient of a base weight, Adam's moments for the adapters only (4.9M
parameters against 135M); the engine runs the merged model (`fr_jax.models.lora`).

  make demo LORA=1
  python -m launch.train --config=experiments/configs/cpu_lora.py --run_dir=runs/demo_lora
  python -m launch.export --checkpoint=runs/demo_lora --format=peft --out=/tmp/demo-adapter

Hardware: cpu_default's (2 cores, about 14 GB of memory; less here: no AdamW moments or
gradients for the 135M base weights). Expected time: not yet measured for this config; a
LoRA update took 1.05-1.19x a full one on 2 cores (docs/lora.md), so about cpu_default's
13-26 minutes or a little more.

Everything else is cpu_default's (the same prompts, batches, evaluations and lag), but the
learning rate: LoRA's best rate is about 10x full fine-tuning's (Schulman et al., "LoRA
Without Regret", 2025, measured it for RL and SFT), so 5e-5 instead of 5e-6; untested here
yet (issue 57's demo-quality runs will say what it gains).
"""

from experiments.configs import cpu_default


def get_config():
  c = cpu_default.get_config()
  c.model.lora.rank = 16
  c.model.lora.alpha = 32.0
  c.model.lora.targets = "wq,wk,wv,wo,w_gate,w_up,w_down"
  c.optim.lr = 5e-5
  return c
