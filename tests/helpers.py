"""Shared by the tests: the tiny learner config and its synthetic batches, the tiny_test run
config, synthetic records whose ids follow the `producer/seq` rule, routing-replay data for
them, and the learner's side as lists for a worker (`Collect`) and a gateway (`Recorder`)."""

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from scipy.special import log_softmax

from fr_jax.learner import config as lcfg
from fr_jax.learner import synthetic
from fr_jax.learner.synthetic import synthetic_trajectory
from fr_jax.models import decoder


def wait_for(cond, timeout, what, procs=()):
  """Polls `cond` until it holds; fails if `timeout` seconds pass (a hang guard: make it
  minutes, never the expected time) or one of `procs` exits first."""
  t_end = time.monotonic() + timeout
  while time.monotonic() < t_end:
    if cond():
      return
    for p in procs:
      assert p.poll() is None, f"{what}: a process exited early ({p.args[2]})"
    time.sleep(0.05)
  raise AssertionError(f"timed out waiting for {what}")


def tiny_config(**kw):
  """A learner config for tiny-llama: B=8, one bucket of 8 rows x 128 tokens, no trust mask,
  lr 1e-2 constant over 10 steps; `kw` overrides dotted fields ("optim.lr": 1e-3)."""
  c = lcfg.default_config()
  c.model.name = "tiny-llama"
  c.batch_size = 8
  c.packing.row_len = 128
  c.packing.row_buckets = (8,)
  c.objective.delta = math.inf
  c.optim.lr = 1e-2
  c.optim.warmup_frac = 0.0
  c.optim.total_steps = 10
  c.log.peak_flops = 1e11
  for k, v in kw.items():
    node = c
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    node[last] = v
  return c


def batches(n, B=8, seed=0, **kw):
  """n batches of B synthetic records (tokens below 256, at most 100 long)."""
  it = iter(synthetic.dataset(seed=seed, vocab_size=256, max_len=100, **kw).to_iter_dataset())
  return [synthetic.take(it, B) for _ in range(n)]


def max_diff(a, b):
  """The largest absolute difference between two pytrees of arrays, in float64."""
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def cfg(run_dir=None, **over):
  """tiny_test's config with `run_dir` and flattened overrides ({"service.x": 1, ...})."""
  from experiments.configs import tiny_test
  c = tiny_test.get_config()
  c.run_dir = str(run_dir) if run_dir else ""
  c.update_from_flattened_dict(over)
  return c


def synth(i, version=0, producer="w/n", **kw):
  """Synthetic record `i` (tokens below tiny-chat's vocabulary), id `producer/i` (`t<i>`
  with no producer)."""
  t = synthetic_trajectory(i, seed=5, vocab_size=259, version=version, **kw)
  t.traj_id = f"{producer}/{i}" if producer else f"t{i}"
  return t


def with_routing(t, layers=2, k=3, num_experts=40, dtype=np.int8, seed=0):
  """`t` carrying valid routed_experts [length - 1, layers, k] (k distinct experts per
  position and layer, as a router picks them), in `dtype`."""
  rng = np.random.default_rng(seed)
  scores = rng.random((t.length - 1, layers, num_experts))
  t.routed_experts = np.argsort(scores, axis=-1)[..., :k].astype(dtype)
  return t


# The decoder's forward, compiled, for the tests' references: called eagerly, it compiles each
# of its operations for every new shape (about 1 s a call for a tiny model on 2 cores).
forward = jax.jit(decoder.forward, static_argnums=1,
                  static_argnames=("remat", "window", "routing_out"))


@functools.partial(jax.jit, static_argnums=1)
def _logits(params, cfg, tokens_1xL):
  h, _ = decoder.forward(params, cfg, tokens_1xL, jnp.arange(tokens_1xL.shape[1])[None])
  return decoder.logits_from_hidden(params, cfg, h)


def teacher_forced(params, cfg, prompt, out, temperature, pad_to=64):
  """Log-probabilities of `out` after `prompt` from one full causal forward of the decoder
  (the reference that sampled log-probabilities are checked against), log-softmax in float64
  at `temperature`. The input is padded at its end to a multiple of `pad_to` so that one
  compiled forward serves many lengths: under the causal mask no position before the padding
  sees it."""
  seq = np.array(list(prompt) + list(out))
  n = len(seq) - 1
  tokens = np.zeros((1, -(-n // pad_to) * pad_to), np.int32)
  tokens[0, :n] = seq[:-1]
  z = np.asarray(_logits(params, cfg, tokens), np.float64)[0, :n] / temperature
  lp = log_softmax(z, -1)[np.arange(n), seq[1:]]
  return lp[len(prompt) - 1:]


class Collect:
  """The learner's side for a worker (records and heartbeats), in the test's process."""

  def __init__(self):
    self.got, self.heartbeats = [], 0

  def heartbeat(self, stats):
    self.heartbeats += 1
    return {"version": 0, "hf_dir": "", "shutdown": False}

  def push(self, traj, stop):
    self.got.append(traj)


class Recorder:
  """The learner side as a list (the gateway's client interface): push keeps each record;
  no heartbeats, no weights."""

  def __init__(self):
    self.got = []

  def push(self, t, stop=None):
    self.got.append(t)
    return True, "admitted"

  def heartbeat(self, stats):
    return None

  def get_weights(self, v):
    return None
