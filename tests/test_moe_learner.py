"""The learner on an MoE model (tiny-qwen3-moe: 4 sparse layers, 8 experts, top-2): a (data,
fsdp) mesh, and one with an expert axis (expert parallelism), makes the same gradients and
updates as one device, with routing replay and without, and the expert stacks are split on
the expert axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from fr_jax.learner import mesh as meshlib
from fr_jax.learner.learner import Learner
from fr_jax.models import decoder, registry
from tests.helpers import batches, max_diff, tiny_config

MODEL = "tiny-qwen3-moe"
EXPERTS = ("experts_gate", "experts_up", "experts_down")


def moe_config(replay=True, impl="ragged", **kw):
  # lr 1e-3 as in test_learner's mesh test: Adam turns float-reordering noise in near-zero
  # gradients into sign flips of size ~lr.
  return tiny_config(**{"model.name": MODEL, "routing_replay": replay, "model.moe_impl": impl,
                        "optim.lr": 1e-3, **kw})


def with_own_routing(trajs, model):
  """`trajs` carrying routed_experts [length - 1, sparse layers, k]: the experts the model's
  own routers pick at each position (what an engine sampling from it records), from one
  unpacked forward of every record, padded at the end (causal: padding changes nothing
  before it)."""
  cfg = model.config
  seqs = [np.concatenate([t.prompt_tokens, t.completion_tokens])[:-1] for t in trajs]
  L = max(len(s) for s in seqs)
  tokens_BxL = np.zeros((len(seqs), L), np.int32)
  for i, s in enumerate(seqs):
    tokens_BxL[i, :len(s)] = s
  positions_BxL = np.broadcast_to(np.arange(L), tokens_BxL.shape)
  own = jax.jit(lambda p, x, pos: decoder.forward(p, cfg, x, pos, routing_out=True)[2].experts)
  experts = np.asarray(own(model.params, tokens_BxL, positions_BxL))  # [B, L, layers, k]
  for t, s, e in zip(trajs, seqs, experts):
    t.routed_experts = e[:len(s)].astype(cfg.routing_dtype)
  return trajs


@pytest.fixture(scope="module")
def model():
  return registry.load(MODEL)


@pytest.fixture(scope="module")
def data(model):
  return [with_own_routing(b, model) for b in batches(2)]


def largest(tree):
  return max(float(np.max(np.abs(x))) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("replay,impl", [
    (True, "ragged"),
    pytest.param(False, "ragged", marks=pytest.mark.slow),
    pytest.param(True, "dense", marks=pytest.mark.slow)])
def test_mesh_equals_single_device(model, data, replay, impl):
  single = Learner(moe_config(replay, impl), model=model, devices=jax.devices()[:1])
  meshes = {shape: Learner(moe_config(replay, impl, **{"mesh.data": shape[0],
                                                       "mesh.fsdp": shape[1]}), model=model)
            for shape in ((4, 2), (1, 8))}
  # The same gradient, subtree by subtree (the experts' are ~30x smaller than the rest's).
  _, g1 = single.accumulated(data[0])
  g1, loss1 = g1["grads"], float(g1["sums"]["loss"])
  assert largest(g1["moe"]) > 1e-5
  for shape, L in meshes.items():
    _, g = L.accumulated(data[0])
    g, loss = g["grads"], float(g["sums"]["loss"])
    assert loss == pytest.approx(loss1, rel=1e-5, abs=1e-7), shape
    for k in g1:
      assert max_diff(g1[k], g[k]) <= 1e-5 * largest(g1[k]), (shape, k)
  # The same updates.
  for b in data:
    m1 = single.update(b)
    assert m1["grad_norm"] > 0
    for shape, L in meshes.items():
      m = L.update(b)
      for k in ("loss", "grad_norm", "router_balance", "acceptance_rate"):
        assert m[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), (shape, k)
      assert m["routing_drift"] == pytest.approx(m1["routing_drift"], abs=1e-6), shape
  # One update moved the routers: some recorded experts are no longer their top-k.
  assert m1["routing_drift"] > 0
  for shape, L in meshes.items():
    assert L.version == single.version == len(data)
    assert max_diff(single.params, L.params) <= 1e-5, shape
  assert max_diff(single.params, model.params) > 1e-3  # it trained (Adam: ~lr a step)
  # The expert stacks (and their Adam moments) are split on the expert axis, E/fsdp whole
  # experts per device; the router follows the largest-dimension rule (D = 64 > E = 8).
  for (_, fsdp), L in meshes.items():
    moe = L.state.params["moe"]
    for name in EXPERTS:
      assert moe[name].sharding.spec == P(None, "fsdp", None, None), (fsdp, name)
      shard = moe[name].addressable_shards[0].data.shape
      assert shard[1] == moe[name].shape[1] // fsdp and shard[2:] == moe[name].shape[2:]
    assert moe["router"].sharding.spec == P(None, "fsdp", None)
    moments = [x for path, x in jax.tree_util.tree_leaves_with_path(L.state.opt_state)
               if jax.tree_util.DictKey("experts_gate") in path]
    assert len(moments) == 2  # Adam's mu and nu
    assert all(x.sharding.spec == P(None, "fsdp", None, None) for x in moments)
  for L in (single, *meshes.values()):
    L.close()


@pytest.mark.parametrize("replay,shape", [(True, (1, 2, 4)), (False, (2, 1, 4))])
def test_expert_parallel_mesh_equals_single_device(model, data, replay, shape):
  """Expert parallelism: 8 devices, an expert axis of 4 ranks (2 of the 8 experts each,
  stored split over fsdp where fsdp is 2); the tokens travel by all-to-all. The same loss and
  gradients as one device, and the same parameters after two updates."""
  single = Learner(moe_config(replay), model=model, devices=jax.devices()[:1])
  ep = Learner(moe_config(replay, **{"mesh.data": shape[0], "mesh.fsdp": shape[1],
                                     "mesh.expert": shape[2]}), model=model)
  assert dict(ep.mesh.shape) == {"data": shape[0], "fsdp": shape[1], "expert": shape[2]}
  assert ep.model_config.expert_parallel_axis == "expert"  # moe dispatches by all-to-all
  _, g1 = single.accumulated(data[0])
  _, g = ep.accumulated(data[0])
  assert float(g["sums"]["loss"]) == pytest.approx(float(g1["sums"]["loss"]), rel=1e-5,
                                                   abs=1e-7)
  assert largest(g1["grads"]["moe"]) > 1e-5
  for k in g1["grads"]:
    assert max_diff(g1["grads"][k], g["grads"][k]) <= 1e-5 * largest(g1["grads"][k]), k
  for b in data:
    m1, m = single.update(b), ep.update(b)
    for k in ("loss", "grad_norm", "router_balance", "acceptance_rate"):
      assert m[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), k
    assert m["expert_drop_rate"] == m1["expert_drop_rate"] == 0  # dropless by default
  assert max_diff(single.params, ep.params) <= 1e-5
  split = ("expert", "fsdp") if shape[1] > 1 else "expert"
  dense = ("fsdp", "expert") if shape[1] > 1 else "expert"
  assert ep.state.params["layers"]["wq"].sharding.spec == P(None, dense, None)
  for name in EXPERTS:
    x = ep.state.params["moe"][name]
    assert x.sharding.spec == P(None, split, None, None), name
    assert x.addressable_shards[0].data.shape[1] == x.shape[1] // (shape[1] * shape[2])
  single.close()
  ep.close()


def test_expert_parallel_config_errors():
  from fr_jax.learner import config as lcfg
  from fr_jax.learner.compile import learner_model_config
  from fr_jax.models.config import ConfigError
  moe_cfg = registry.TINY_CONFIGS[MODEL]
  with pytest.raises(ConfigError, match="does not divide the model's 8 experts"):
    learner_model_config(tiny_config(**{"mesh.expert": 4, "mesh.fsdp": 4}), moe_cfg)
  with pytest.raises(ConfigError, match="expert parallelism is for MoE models"):
    learner_model_config(tiny_config(**{"mesh.expert": 2}), registry.TINY_CONFIGS["tiny-llama"])
  with pytest.raises(ConfigError, match="data\\*fsdp\\*expert=4"):
    lcfg.ensure_valid(tiny_config(**{"mesh.expert": 4, "packing.row_buckets": (2,)}))


def test_param_spec_rules():
  mesh = meshlib.make_mesh(1, 8)
  sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
  tree = {"embed": sds(256, 64),
          "layers": {"wq": sds(8, 64, 64), "attn_norm": sds(16, 4)},
          # 8 experts: on the expert axis, though D and F are larger
          "moe": {"experts_gate": sds(4, 8, 64, 32), "router": sds(4, 64, 8)},
          # an MoE model's dense layers: a stack too, never split on its layer axis
          "mlp": {"w_gate": sds(8, 4, 12)}}
  got = jax.tree.map(lambda s: s.spec, meshlib.params_sharding(tree, mesh))
  assert got == {"embed": P("fsdp", None), "layers": {"wq": P(None, "fsdp", None),
                                                      "attn_norm": P()},
                 "moe": {"experts_gate": P(None, "fsdp", None, None),
                         "router": P(None, "fsdp", None)},
                 "mlp": {"w_gate": P()}}
  # 6 experts do not split 8 ways: the largest evenly divisible dim instead.
  assert meshlib.param_spec((4, 6, 64, 32), 8, True, expert_axis=1) == P(None, None, "fsdp",
                                                                         None)
  assert meshlib.param_spec((4, 6, 64, 32), 1, True, expert_axis=1) == P()
  # With an expert axis: E over ("expert", "fsdp"), expert-major (rank r's experts are the
  # r-th contiguous E / expert, split over fsdp within).
  assert meshlib.param_spec((4, 8, 64, 32), 2, True, 1, expert=4) == P(None, ("expert", "fsdp"),
                                                                       None, None)
  assert meshlib.param_spec((4, 8, 64, 32), 1, True, 1, expert=4) == P(None, "expert", None,
                                                                       None)
  with pytest.raises(ValueError, match="6 experts do not split over expert=4 x fsdp=1"):
    meshlib.param_spec((4, 6, 64, 32), 1, True, 1, expert=4)
  # Every other weight: fsdp x expert ways on its largest dim, else fsdp alone.
  assert meshlib.param_spec((8, 64, 64), 2, True, expert=4) == P(None, ("fsdp", "expert"), None)
  assert meshlib.param_spec((8, 64, 64), 1, True, expert=4) == P(None, "expert", None)
  assert meshlib.param_spec((8, 12, 6), 2, True, expert=4) == P(None, "fsdp", None)


def test_weight_decay_covers_routers_and_experts_not_norms():
  from fr_jax.learner import optim
  mask = optim.decay_mask(registry.load("tiny-qwen3-moe").params)
  assert all(mask["moe"].values()), mask["moe"]
  assert mask["layers"]["wq"] and not mask["layers"]["mlp_norm"] and not mask["final_norm"]
