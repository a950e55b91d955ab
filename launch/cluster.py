r"""Launch files for a cluster (Slurm, Kubernetes, TPU VM), rendered from one cluster config.

  python -m launch.cluster --cluster=launch/cluster/example.py --target=all --out=build/cluster
  # one target, with a field changed on the command line
  python -m launch.cluster --cluster=launch/cluster/example.py --target=slurm --out=DIR \
      --cluster.learner.nodes=4 --cluster.learner.mesh_data=4

It writes DIR/slurm.sbatch, DIR/k8s.yaml and/or DIR/tpu_vm.sh from the Jinja templates in
launch/cluster/ (`<file>.j2`) and prints one line per file. Before writing anything it checks
the cluster config (an impossible value: one line, exit status 2) and runs the run config
through its own validation with the overrides the files pass (`--config.model.name`,
`--config.mesh.*`, `--config.rollout.*`), so a recipe that cannot run on this layout fails
here rather than after the nodes start. `engine` picks the rollout fleet of the Slurm and
Kubernetes files: "sglang" (SGLang servers behind sglang-router) or "vllm" (launch.vllm_server
servers, no router: worker i generates on server i mod vllm.nodes). No secret is ever written
into a file or onto a command line: the gRPC token comes from the environment variable
`token_env` (Slurm, TPU VM) or the Secret `k8s.token_secret`, the servers' API key from
`sglang_key_env` or `k8s.sglang_key_secret` (vLLM: `vllm_key_env`, `k8s.vllm_key_secret`),
and every process reads them from its environment (SGLang from a private --config file).
BUILD.md ("Cluster launch templates") says what each file assumes; docs/system.md ("Threat
model") what each port and credential protects.
"""

import importlib.util
import json
import re
import shlex
import stat
from pathlib import Path

import jinja2
from absl import flags
from ml_collections import config_flags

from launch import common

TEMPLATES = Path(__file__).with_name("cluster")
FILES = {"slurm": "slurm.sbatch", "k8s": "k8s.yaml", "tpu_vm": "tpu_vm.sh"}
# The rollout fleets: the engine's name in messages and the variable its clients read the API
# key from (fr_jax's SGLangEngine / VLLMEngine `api_key_env`; launch.router, launch.vllm_server).
ENGINES = {"sglang": ("SGLang", "SGLANG_API_KEY"), "vllm": ("vLLM", "VLLM_API_KEY")}
VLLM_DTYPES = ("float32", "bfloat16")  # launch.vllm_server --dtype's choices

CLUSTER = config_flags.DEFINE_config_file(
    "cluster", None, "cluster config file (get_config(), e.g. launch/cluster/example.py); "
    "override any field with --cluster.x=y")
flags.DEFINE_enum("target", "all", [*FILES, "all"], "which file to render")
flags.DEFINE_string("out", None, "folder for the rendered files (created if missing)")
FLAGS = flags.FLAGS

_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}")
_PLAIN = re.compile(r"[^\s'\"\\$`]+")  # a value written into #SBATCH lines or YAML unquoted
# JAX devices per accelerator-type unit: v2/v3 count TensorCores (one device each), v4/v5p count
# TensorCores of megacore chips (one device per two), v5e/v6e count single-core chips.
_TPU_DEVICES_PER_UNIT = {"v2": 1, "v3": 1, "v4": 0.5, "v5p": 0.5, "v5litepod": 1, "v5e": 1,
                         "v6e": 1}


class ClusterError(Exception):
  """An impossible cluster config value: printed as one line, exit status 2."""


def _need(ok: bool, message: str):
  if not ok:
    raise ClusterError(message)


def tpu_devices(accelerator_type: str):
  """The JAX device count of a TPU slice named like v5p-16, or None for an unknown family."""
  family, _, n = accelerator_type.rpartition("-")
  if family not in _TPU_DEVICES_PER_UNIT or not n.isdigit():
    return None
  return int(int(n) * _TPU_DEVICES_PER_UNIT[family])


def _get(k, field: str):
  for part in field.split("."):
    k = k[part]
  return k


def _ints(k, fields, low=1, high=None, what="an integer >= 1"):
  for field in fields:
    v = _get(k, field)
    _need(isinstance(v, int) and not isinstance(v, bool) and v >= low
          and (high is None or v <= high), f"{field}={v!r}: give {what}")


def _ports(k, fields):
  _ints(k, fields, 1, 65535, "a port, an integer in [1, 65535]")


def validate(k, targets) -> None:
  """Raises ClusterError naming the first impossible field among those `targets` use
  (KeyError or AttributeError where one is missing)."""
  _need(bool(_DNS_LABEL.fullmatch(k.name)) and len(k.name) <= 40,
        f"name={k.name!r}: use lower-case letters, digits and '-', starting with a letter, "
        "at most 40 characters (Kubernetes names are built from it)")
  for field in ("run_dir", "checkpoint", "workdir"):
    value = _get(k, field)
    _need(value.startswith("/") and bool(_PLAIN.fullmatch(value)),
          f"{field}={value!r}: give an absolute path without spaces or quotes (the same on "
          "every host)")
  _need(bool(_PLAIN.fullmatch(k.run_config)) and not k.run_config.startswith("/"),
        f"run_config={k.run_config!r}: give a path relative to workdir (the repository)")
  _need(k.engine in ENGINES, f"engine={k.engine!r}: choose one of {', '.join(ENGINES)}")
  for field in ("token_env", f"{k.engine}_key_env"):
    _need(bool(_ENV_NAME.fullmatch(k[field])),
          f"{field}={k[field]!r}: give an environment variable name")
  _need(k.tls.dir == "" or (k.tls.dir.startswith("/") and bool(_PLAIN.fullmatch(k.tls.dir))),
        f"tls.dir={k.tls.dir!r}: an absolute path without spaces or quotes, or empty (no TLS)")
  _need(bool(_PLAIN.fullmatch(k.python)), f"python={k.python!r}: give an interpreter path")
  _ports(k, ["learner.port"])
  if {"slurm", "k8s"} & set(targets):
    _validate_fleet(k)
  if "slurm" in targets:
    _validate_slurm(k.slurm)
  if "k8s" in targets:
    _validate_k8s(k)
  if "tpu_vm" in targets:
    _validate_tpu(k.tpu)


def _validate_fleet(k):
  """The GPU learner, the `engine` servers with their relays (SGLang: and the router) and
  the workers."""
  e = k.engine
  _ints(k, ["learner.nodes", "learner.devices_per_node", "learner.mesh_data",
            "learner.mesh_fsdp", f"{e}.nodes", f"{e}.gpus_per_node", f"{e}.tp_size",
            "workers.count", "workers.nodes", "workers.cpus"])
  _ports(k, ["learner.coordinator_port", f"{e}.port"])
  _need(k.learner.port != k.learner.coordinator_port,
        f"learner.port and learner.coordinator_port are both {k.learner.port}: they share a host")
  devices = k.learner.nodes * k.learner.devices_per_node
  _need(k.learner.mesh_data * k.learner.mesh_fsdp == devices,
        f"learner.mesh_data * learner.mesh_fsdp = {k.learner.mesh_data * k.learner.mesh_fsdp}, "
        f"but learner.nodes * learner.devices_per_node = {devices}: make them equal")
  s = k[e]
  _need(s.gpus_per_node % s.tp_size == 0,
        f"{e}.tp_size={s.tp_size} must divide {e}.gpus_per_node={s.gpus_per_node}")
  _need(isinstance(s.extra_args, (tuple, list)) and all(isinstance(a, str) for a in s.extra_args),
        f"{e}.extra_args={s.extra_args!r}: give a tuple of strings")
  _need(not [a for a in s.extra_args if a.startswith("--api-key")],
        f"{e}.extra_args has --api-key: the key comes from {e}_key_env (a command line is "
        "public on its host)")
  _need(bool(_PLAIN.fullmatch(s.python)), f"{e}.python={s.python!r}: give an interpreter path")
  _need(k.workers.nodes <= k.workers.count,
        f"workers.nodes={k.workers.nodes} exceeds workers.count={k.workers.count}")
  _need(k.relay.dir.startswith("/") and bool(_PLAIN.fullmatch(k.relay.dir)),
        f"relay.dir={k.relay.dir!r}: give an absolute path without spaces or quotes")
  if e == "sglang":
    _ints(k, ["router.startup_timeout_s"])
    _ports(k, ["router.port"])
    _need(0 < s.mem_fraction_static < 1,
          f"sglang.mem_fraction_static={s.mem_fraction_static} must be in (0, 1)")
  else:
    _ints(k, ["vllm.max_model_len"])
    _need(s.dtype in VLLM_DTYPES, f"vllm.dtype={s.dtype!r}: choose one of {VLLM_DTYPES}")
    _need(0 < s.gpu_memory_utilization <= 1,
          f"vllm.gpu_memory_utilization={s.gpu_memory_utilization} must be in (0, 1]")
    _need(k.workers.count >= s.nodes,
          f"workers.count={k.workers.count} < vllm.nodes={s.nodes}: worker i generates on "
          "server i mod vllm.nodes, so some servers would get no worker")


def _validate_slurm(s):
  for field in ("partition", "account", "output"):
    _need(s[field] == "" or bool(_PLAIN.fullmatch(s[field])),
          f"slurm.{field}={s[field]!r}: no spaces or quotes")
  _need(bool(_SLURM_TIME.fullmatch(s.time)),
        f"slurm.time={s.time!r}: give minutes, HH:MM:SS or D-HH:MM:SS")
  _need(s.gpu_directive in ("gpus-per-node", "gres"),
        f"slurm.gpu_directive={s.gpu_directive!r}: choose gpus-per-node or gres")


def _validate_k8s(k):
  _need(bool(_DNS_LABEL.fullmatch(k.k8s.namespace)),
        f"k8s.namespace={k.k8s.namespace!r}: not a Kubernetes namespace name")
  for field in (f"{k.engine}_image", "gpu_resource", "token_secret", f"{k.engine}_key_secret"):
    _need(bool(_PLAIN.fullmatch(k.k8s[field])), f"k8s.{field}={k.k8s[field]!r}: give a name")
  _need(bool(k.tls.dir) == bool(k.k8s.tls_secret),
        f"tls.dir={k.tls.dir!r} and k8s.tls_secret={k.k8s.tls_secret!r}: set both (TLS, the "
        "Secret mounted at tls.dir) or neither")
  _need(k.k8s.tls_secret == "" or bool(_DNS_LABEL.fullmatch(k.k8s.tls_secret)),
        f"k8s.tls_secret={k.k8s.tls_secret!r}: a Secret name, or empty")
  _need(k.learner.nodes == 1 or k.k8s.run_dir_pvc != "",
        f"learner.nodes={k.learner.nodes} with k8s.run_dir_pvc empty: each learner pod would "
        "write its checkpoint shards to its own emptyDir (multi-host Orbax needs one shared "
        "directory) and the admission log would die with pod 0; set k8s.run_dir_pvc to a "
        "ReadWriteMany claim")
  _need(bool(_PLAIN.fullmatch(k.image)), f"image={k.image!r}: give a container image")
  for field in ("run_dir_pvc", "checkpoint_pvc"):
    _need(k.k8s[field] == "" or bool(_DNS_LABEL.fullmatch(k.k8s[field])),
          f"k8s.{field}={k.k8s[field]!r}: a claim name, or empty")


def _validate_tpu(t):
  _need(bool(_DNS_LABEL.fullmatch(t.name)), f"tpu.name={t.name!r}: lower-case letters, digits "
        "and '-', starting with a letter")
  for field in ("zone", "runtime_version"):
    _need(bool(_PLAIN.fullmatch(t[field])), f"tpu.{field}={t[field]!r}: give a value")
  _need(bool(re.fullmatch(r"[a-z0-9]+-\d+", t.accelerator_type)),
        f"tpu.accelerator_type={t.accelerator_type!r}: give a type such as v5p-16")
  for field in ("mesh_data", "mesh_fsdp"):
    _need(isinstance(t[field], int) and t[field] >= 1,
          f"tpu.{field}={t[field]!r}: give an integer >= 1")
  n = tpu_devices(t.accelerator_type)
  _need(n is None or t.mesh_data * t.mesh_fsdp == n,
        f"tpu.mesh_data * tpu.mesh_fsdp = {t.mesh_data * t.mesh_fsdp}, but a "
        f"{t.accelerator_type} has {n} JAX devices: make them equal")


def learner_overrides(k, mesh) -> dict:
  """The --config.* fields the learner commands set; `mesh` is (data, fsdp). Weights reach
  the servers through the relays, so the learner exports no HF directory: a worker that saw
  one in its heartbeat would ask its server (SGLang: the router, which has no such route) to
  load a path on the learner's disk."""
  return {"model.name": f"hf:{k.checkpoint}", "mesh.data": mesh[0], "mesh.fsdp": mesh[1],
          "service.export_hf": False}


def worker_overrides(k) -> dict:
  """The --config.* fields the worker commands set, besides rollout.server_url (SGLang: the
  router's URL; vLLM: server i mod vllm.nodes for worker i), which each template writes in
  its own terms."""
  return {"model.name": f"hf:{k.checkpoint}", "rollout.engine": k.engine}


def relay_overrides(k) -> dict:
  """The --config.* fields the weight relays set (they build the HF config and tokenizer
  files from the run config's model)."""
  return {"model.name": f"hf:{k.checkpoint}"}


def relay_flags(k) -> list:
  """The relays' flags besides --config, --learner, --server, --dir and TLS: the engine
  (launch.weight_relay's default is sglang)."""
  return [] if k.engine == "sglang" else [f"--engine={k.engine}"]


def vllm_args(k) -> tuple:
  """(launch.vllm_server's flags, vLLM's own after `--`), less --export_dir (each template
  names its relay folder in its own terms). The key is $VLLM_API_KEY, never an argument."""
  v = k.vllm
  ours = [f"--model={k.checkpoint}", "--host=0.0.0.0", f"--port={v.port}", f"--dtype={v.dtype}",
          f"--max_model_len={v.max_model_len}", f"--python={v.python}"]
  theirs = [f"--tensor-parallel-size={v.tp_size}",
            f"--data-parallel-size={v.gpus_per_node // v.tp_size}",
            f"--gpu-memory-utilization={v.gpu_memory_utilization}", *v.extra_args]
  return ours, theirs


def tls_flags(k) -> dict:
  """The learner's and the clients' (workers, relays) TLS flags; empty without tls.dir."""
  d = k.tls.dir
  if not d:
    return dict(learner_tls=[], client_tls=[])
  return dict(learner_tls=[f"--tls_cert={d}/server.pem", f"--tls_key={d}/server.key",
                           f"--tls_client_ca={d}/ca.pem"],
              client_tls=[f"--tls_ca={d}/ca.pem", f"--tls_cert={d}/client.pem",
                          f"--tls_key={d}/client.key"])


def check_run_config(k, targets):
  """Loads run_config (relative to this repository) with each command's overrides and runs
  the run config's own validation; raises ClusterError with its message. Returns the
  workers' run config."""
  from fr_jax import config as rcfg
  path = Path(k.run_config)
  _need(path.is_file(), f"run_config={k.run_config!r}: no such file here (paths are relative "
        "to the repository root, here and in workdir on the hosts)")
  spec = importlib.util.spec_from_file_location("_cluster_run_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  sets = [("worker", worker_overrides(k) | {"rollout.server_url": "http://router:1"})]
  if {"slurm", "k8s"} & set(targets):
    sets.append(("learner", learner_overrides(k, (k.learner.mesh_data, k.learner.mesh_fsdp))))
    sets.append(("weight relay", relay_overrides(k)))
  if "tpu_vm" in targets:
    sets.append(("tpu learner", learner_overrides(k, (k.tpu.mesh_data, k.tpu.mesh_fsdp))))
  run = None
  for who, overrides in sets:
    c = module.get_config()
    for key, value in overrides.items():
      *parents, leaf = key.split(".")
      node = c
      try:
        for p in parents:
          node = node[p]
        node[leaf] = value
      except (KeyError, AttributeError, TypeError) as e:
        raise ClusterError(f"run_config {k.run_config}: cannot set {key}={value!r} "
                           f"({type(e).__name__}: {e})") from None
    try:
      rcfg.validate(c)
    except rcfg.ConfigError as e:
      raise ClusterError(f"run_config {k.run_config} with the {who}'s overrides "
                         f"{overrides}: {e}") from None
    if who == "worker" and k.engine == "vllm" and {"slurm", "k8s"} & set(targets):
      _need(k.vllm.max_model_len >= c.agent.max_total_tokens,
            f"vllm.max_model_len={k.vllm.max_model_len} is below run_config {k.run_config}'s "
            f"agent.max_total_tokens={c.agent.max_total_tokens}: the servers would refuse "
            "the longest episodes")
    run = run or c
  return run


def lora_fleet(k, run, targets) -> dict:
  """What a LoRA run (run config model.lora.rank > 0) changes in the fleet's files: vLLM
  servers start with --lora_rank (each version then loads as an adapter, docs/lora.md).
  SGLang fleets are refused: their workers generate through sglang-router, which would send
  a request naming the newest adapter to a server whose relay has not loaded it yet."""
  rank = run.model.lora.rank
  if not rank or not {"slurm", "k8s"} & set(targets):
    return {}
  _need(k.engine == "vllm",
        f"run_config {k.run_config} trains LoRA adapters (model.lora.rank={rank}) and "
        f"engine={k.engine!r}: SGLang fleets generate through sglang-router, which may send a "
        "request to a server that has not loaded its adapter yet; use engine='vllm' (each "
        "worker generates on one server)")
  ours, theirs = vllm_args(k)
  return {"vllm_flags": [*ours, f"--lora_rank={rank}"], "vllm_engine_args": theirs}


def context(k, source: str, targets) -> dict:
  """What the templates see: the cluster config and the values derived from the fields the
  targets use."""
  ctx = dict(k=k.to_dict(), source=source, **tls_flags(k))
  if {"slurm", "k8s"} & set(targets):
    e, fleet = k.engine, k[k.engine]
    ctx.update(learner_overrides=learner_overrides(k, (k.learner.mesh_data, k.learner.mesh_fsdp)),
               worker_overrides=worker_overrides(k), relay_overrides=relay_overrides(k),
               relay_flags=relay_flags(k), engine=e, fleet=fleet.to_dict(),
               engine_name=ENGINES[e][0], key_var=ENGINES[e][1], key_env=k[f"{e}_key_env"],
               server_dp=fleet.gpus_per_node // fleet.tp_size)
    if e == "vllm":
      ctx.update(zip(("vllm_flags", "vllm_engine_args"), vllm_args(k)))
  if "k8s" in targets:
    e, fleet = k.engine, k[k.engine]
    svc = f"{k.k8s.namespace}.svc.cluster.local"
    learner0 = f"{k.name}-learner-0.{k.name}-learner.{svc}"  # indexed Job pod 0's DNS name
    server = f"http://{k.name}-{e}-{{}}.{k.name}-{e}.{svc}:{fleet.port}"  # StatefulSet pod {}
    ctx.update(
        k8s_learner0=learner0,
        k8s_coordinator=f"{learner0}:{k.learner.coordinator_port}",
        k8s_key_secret=k.k8s[f"{e}_key_secret"],
        k8s_server_urls=[server.format(i) for i in range(fleet.nodes)])
    if e == "sglang":
      ctx.update(k8s_router_url=f"http://{k.name}-router.{svc}:{k.router.port}")
    else:  # worker i: server i mod nodes, picked by the pod's shell (`$$` is kubelet's `$`)
      ctx.update(k8s_worker_server_url=server.format(
          f"$$((JOB_COMPLETION_INDEX % {fleet.nodes}))"))
  if "tpu_vm" in targets:
    ctx.update(tpu_overrides=learner_overrides(k, (k.tpu.mesh_data, k.tpu.mesh_fsdp)))
  return ctx


def summary(k, target: str) -> str:
  if target in ("slurm", "k8s"):
    fleet = f"{k[k.engine].nodes} {ENGINES[k.engine][0]}"
  if target == "slurm":
    return (f"{k.learner.nodes} learner + {fleet} + {k.workers.nodes} rollout "
            f"nodes, {k.workers.count} workers")
  if target == "k8s":
    router = ", a router" if k.engine == "sglang" else ""
    return (f"namespace {k.k8s.namespace}: {k.learner.nodes} learner pods, {fleet} "
            f"pods{router}, {k.workers.count} workers")
  return f"{k.tpu.accelerator_type} {k.tpu.name} in {k.tpu.zone}: the learner"


def render(targets, out: Path, ctx: dict) -> list:
  """Writes each target's file into `out`; returns their paths."""
  env = jinja2.Environment(
      loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
      trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
  env.filters["q"] = lambda v: shlex.quote(str(v))  # one shell word
  env.filters["j"] = lambda v: json.dumps(str(v))  # one YAML (JSON) string
  env.filters["chomp"] = lambda v: str(v).rstrip("\n")  # a macro's lines, less the last newline
  out.mkdir(parents=True, exist_ok=True)
  written = []
  for target in targets:
    name = FILES[target]
    text = env.get_template(name + ".j2").render(ctx, file=name, target=target)
    path = out / name
    path.write_text(text)
    if name.endswith((".sh", ".sbatch")):
      path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    written.append(path)
  return written


def main(argv):
  if len(argv) > 1:
    common.fail(f"unexpected arguments {argv[1:]}")
  if not FLAGS.out:
    common.fail("--out is required (a folder for the rendered files)")
  try:
    k = CLUSTER.value
    if k is not None:
      k.keys()  # a config file that failed to load raises here
  except OSError as e:  # how ml_collections reports a config file it could not load
    common.fail("--cluster: " + " ".join(line.strip() for line in str(e).splitlines()))
  if k is None:
    common.fail("--cluster is required (e.g. launch/cluster/example.py)")
  targets = list(FILES) if FLAGS.target == "all" else [FLAGS.target]
  source = FLAGS["cluster"].config_filename
  try:
    validate(k, targets)
    ctx = context(k, source, targets)
    summaries = [summary(k, t) for t in targets]
  except (KeyError, AttributeError) as e:  # a field the cluster config lacks
    while e.args and isinstance(e.args[0], Exception):  # ConfigDict wraps its KeyError
      e = e.args[0]
    what = " ".join(str(e.args[0] if e.args else e).split())
    common.fail(f"cluster config {source}: a field is missing: {what} (start from "
                "launch/cluster/example.py)")
  except ClusterError as e:
    common.fail(f"cluster config {source}: {e}")
  try:
    ctx.update(lora_fleet(k, check_run_config(k, targets), targets))
  except ClusterError as e:
    common.fail(f"cluster config {source}: {e}")
  try:
    written = render(targets, Path(FLAGS.out), ctx)
  except jinja2.UndefinedError as e:  # StrictUndefined: a field a template needs is missing
    common.fail(f"cluster config {source}: a template needs a field it lacks: {e}")
  for path, line in zip(written, summaries):
    print(f"{path}  {line}", flush=True)


if __name__ == "__main__":
  common.run(main)
