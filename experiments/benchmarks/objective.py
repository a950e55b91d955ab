r"""Benchmark: the FlashREINFORCE objective on packed batches, and packing efficiency.

  .venv/bin/python -m experiments.benchmarks.objective [--action_tokens=65536] [--repeats=15]

Prints JSON lines:
  * `loss_grad`: loss + gradient (w.r.t. the learner log-probs) over one update's packed
    micro-batches of about --action_tokens action tokens; JAX (jit) against a PyTorch
    implementation of the same loss on the same data in the same run. Medians of --repeats
    timed calls after warm-up, the ratio torch/jax, and the max |difference| of loss and grad.
  * `packing`: packing efficiency (real tokens / buffer tokens) over --packing_trials batches
    drawn from a heavy-tailed lognormal length distribution, with a padded [B, max_len] layout
    as the peer.
  * `machine`: where it ran.
"""

import json
import os
import platform
import statistics
import time

import numpy as np
from absl import app, flags

flags.DEFINE_integer("action_tokens", 65536, "action tokens per update batch")
flags.DEFINE_integer("repeats", 15, "timed calls per implementation (median reported)")
flags.DEFINE_integer("packing_trials", 50, "random batches for the packing-efficiency figure")
flags.DEFINE_integer("row_len", 4096, "packed row length")
flags.DEFINE_list("row_buckets", None,
                  "allowed rows per micro-batch (default: PackingSpec's default buckets)")
flags.DEFINE_float("median_len", 400.0, "median completion length (lognormal)")
flags.DEFINE_float("sigma", 1.0, "lognormal sigma of completion lengths (heavy tail)")
flags.DEFINE_integer("seed", 0, "random seed")
F = flags.FLAGS


def emit(kind, **kw):
  print(json.dumps({"bench": "objective", "kind": kind, **kw}), flush=True)


def machine():
  import jax
  info = {"platform": platform.platform(), "python": platform.python_version(),
          "cpu_count": os.cpu_count(), "jax": jax.__version__,
          "jax_backend": jax.default_backend(),
          "devices": [str(d) for d in jax.devices()][:4]}
  try:
    import torch
    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
  except ImportError:
    info["torch"] = None
  return info


def lognormal_trajectories(rng, action_tokens, median_len, sigma, max_len):
  """Trajectories until about `action_tokens` action tokens; 90% of completion tokens are
  actions (the rest stand for tool output)."""
  from fr_jax.trajectory import Trajectory
  trajs, n_act, i = [], 0, 0
  while n_act < action_tokens:
    P = int(rng.integers(30, 200))
    C = int(np.clip(rng.lognormal(np.log(median_len), sigma), 1, max_len - P))
    mask = rng.random(C) < 0.9
    mask[0] = True
    blogp = np.where(mask, np.log(rng.uniform(0.05, 1.0, C)), 0.0).astype(np.float32)
    trajs.append(Trajectory(f"p{i}", rng.integers(0, 49152, P), rng.integers(0, 49152, C),
                            mask, blogp, float(rng.integers(0, 2)), 0))
    n_act += int(mask.sum())
    i += 1
  return trajs, n_act


def _spec():
  from fr_jax.packing import PackingSpec
  kw = {} if F.row_buckets is None else {"row_buckets": tuple(int(r) for r in F.row_buckets)}
  return PackingSpec(row_len=F.row_len, max_segments_per_row=64, **kw)


def bench_loss_grad(rng):
  import jax
  import jax.numpy as jnp
  import torch

  from fr_jax import objective as obj
  from fr_jax.packing import pack

  trajs, n_act = lognormal_trajectories(rng, F.action_tokens, F.median_len, F.sigma, F.row_len)
  spec = _spec()
  packed = pack(trajs, spec)
  # Learner log-probs: behaviour log-probs plus drift (so the gate does real work).
  logps = []
  for b in packed.batches:
    noise = 0.05 * rng.standard_normal(b.behavior_logp.shape)
    logps.append(np.minimum(np.where(b.action_mask, b.behavior_logp, -1.0) + noise,
                            -1e-4).astype(np.float32))
  B = len(trajs)
  # Whole-batch normalisers shared by every micro-batch, as the learner computes them.
  stats = obj.BatchStats(jnp.float32(B), jnp.float32(sum(t.reward for t in trajs)),
                         jnp.float32(n_act))

  @jax.jit
  def jax_step(logp, b, stats):
    def f(lp):
      return obj.flash_reinforce_loss_packed(lp, b.behavior_logp, b.action_mask, b.segment_ids,
                                             b.rewards, b.segment_valid, delta=3e-3,
                                             stats=stats)[0]
    return jax.value_and_grad(f)(logp)

  dev_batches = [jax.device_put(b) for b in packed.batches]
  dev_logps = [jax.device_put(lp) for lp in logps]

  def run_jax():
    out = [jax_step(lp, b, stats) for lp, b in zip(dev_logps, dev_batches)]
    jax.block_until_ready(out)
    return out

  tb = [dict(mask=torch.from_numpy(b.action_mask), seg=torch.from_numpy(b.segment_ids).long(),
             blogp=torch.from_numpy(b.behavior_logp), rewards=torch.from_numpy(b.rewards),
             valid=torch.from_numpy(b.segment_valid)) for b in packed.batches]
  t_logps = [torch.from_numpy(lp) for lp in logps]
  Bt, Rt = torch.tensor(float(B)), torch.tensor(sum(t.reward for t in trajs) / B)

  def run_torch():
    out = []
    for lp, b in zip(t_logps, tb):
      lp = lp.clone().requires_grad_(True)
      # Whole-batch B and mean(R): rescale the per-micro-batch form to global normalisers.
      loss = torch_global_loss(lp, b, Bt, Rt)
      loss.backward()
      out.append((loss.detach(), lp.grad))
    return out

  def timeit(fn):
    fn()
    fn()  # warm-up: compile / allocator
    ts = []
    for _ in range(F.repeats):
      t0 = time.perf_counter()
      fn()
      ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts

  jx = run_jax()
  th = run_torch()
  loss_diff = abs(sum(float(loss) for loss, _ in jx) - sum(float(loss) for loss, _ in th))
  grad_diff = max(float(np.abs(np.asarray(g) - gt.numpy()).max()) for (_, g), (_, gt)
                  in zip(jx, th))
  t_jax, all_jax = timeit(run_jax)
  t_torch, all_torch = timeit(run_torch)
  emit("loss_grad", trajectories=B, action_tokens=n_act, micro_batches=len(packed.batches),
       shapes=[list(b.shape) for b in packed.batches], buffer_tokens=packed.buffer_tokens,
       jax_median_ms=round(t_jax * 1e3, 3), torch_median_ms=round(t_torch * 1e3, 3),
       torch_over_jax=round(t_torch / t_jax, 2),
       jax_mtok_per_s=round(n_act / t_jax / 1e6, 2),
       jax_ms_all=[round(t * 1e3, 2) for t in all_jax],
       torch_ms_all=[round(t * 1e3, 2) for t in all_torch],
       loss_abs_diff=loss_diff, grad_max_abs_diff=grad_diff, repeats=F.repeats)


def torch_global_loss(lp, b, B, mean_r):
  """The same objective written independently in PyTorch (index_add_ segment sums), with
  the whole batch's B and mean reward, as each micro-batch of an update sees them."""
  import torch
  S = b["rewards"].shape[0]
  seg = b["seg"].reshape(-1)
  maskf = b["mask"].reshape(-1).float()

  def to_traj(x):
    return torch.zeros(S + 1, dtype=x.dtype).index_add_(0, seg, x.reshape(-1))[1:]

  T = to_traj(maskf)
  A = torch.where(b["valid"], b["rewards"] - mean_r, torch.zeros_like(b["rewards"]))
  flat = lp.reshape(-1)
  bl = b["blogp"].reshape(-1)
  p = bl.exp().clamp(1e-6, 1 - 1e-6)
  q = flat.detach().exp().clamp(1e-6, 1 - 1e-6)
  d = (p * (p.log() - q.log()) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))) * maskf
  D = (to_traj(d) / T.clamp(min=1)).clamp(min=0)
  m = ((D <= 3e-3) & b["valid"]).float()
  rho = torch.exp((flat.detach() - bl) * maskf)
  w = torch.cat([m.new_zeros(1), m])[seg] * maskf * rho
  return -(A / T.clamp(min=1) / B * to_traj(w * flat)).sum()


def bench_packing(rng):
  from fr_jax.packing import pack
  spec = _spec()
  effs, padded_effs, secs, n_batches = [], [], [], []
  for _ in range(F.packing_trials):
    trajs, _ = lognormal_trajectories(rng, F.action_tokens, F.median_len, F.sigma, F.row_len)
    t0 = time.perf_counter()
    packed = pack(trajs, spec)
    secs.append(time.perf_counter() - t0)
    effs.append(packed.efficiency)
    n_batches.append(len(packed.batches))
    lens = [t.length for t in trajs]
    padded_effs.append(sum(lens) / (len(lens) * max(lens)))
  emit("packing", distribution=f"lognormal(median={F.median_len}, sigma={F.sigma})",
       row_len=F.row_len, row_buckets=list(spec.row_buckets), trials=F.packing_trials,
       efficiency_median=round(statistics.median(effs), 4), efficiency_min=round(min(effs), 4),
       padded_efficiency_median=round(statistics.median(padded_effs), 4),
       micro_batches_median=statistics.median(n_batches),
       pack_ms_median=round(statistics.median(secs) * 1e3, 2), target=0.95,
       meets_target=statistics.median(effs) >= 0.95)


def main(argv):
  del argv
  rng = np.random.default_rng(F.seed)
  emit("machine", **machine())
  bench_packing(rng)
  bench_loss_grad(rng)


if __name__ == "__main__":
  app.run(main)
