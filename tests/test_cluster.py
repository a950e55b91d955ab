"""launch.cluster: the Slurm, Kubernetes and TPU VM files rendered from launch/cluster/example.py.

What can be checked without a cluster: the files render, the shell scripts parse (`bash -n`)
and run against stub `srun`/`scontrol`/`gcloud`/`python` that record every command line, the
manifests are YAML of the right shape, every flag passed to one of our commands (or to
sglang-router, or to SGLang) exists, and a bad cluster config is one line with exit status 2.
Expected values are computed here from the cluster config, not read back from the renderer.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests import XLA_TEST_FLAGS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "launch/cluster/example.py"
TOKEN = "not-a-real-token-7f3a"  # must never reach a rendered file or a command line
KEY = "not-a-real-key-9c1e"  # the SGLang API key: the same
ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=XLA_TEST_FLAGS)
# sglang.launch_server needs CUDA and is not installed here: its arguments are checked against
# this list, copied from SGLang's documentation of server arguments
# (https://docs.sglang.io/advanced_features/server_arguments.html).
SGLANG_DOCUMENTED_FLAGS = {
    "model-path", "tokenizer-path", "host", "port", "tp-size", "dp-size",
    "mem-fraction-static", "context-length", "trust-remote-code", "dtype", "load-format",
    "skip-server-warmup", "served-model-name", "api-key", "log-level", "config"}


def load_example():
  spec = importlib.util.spec_from_file_location("_example_cluster", ROOT / EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def cli(*args, env=None):
  return subprocess.run([sys.executable, "-m", "launch.cluster", *args], cwd=ROOT,
                        capture_output=True, text=True, env=env or ENV, timeout=120)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
  """(out dir, cluster config, stdout): all three files from the example, with its host paths
  moved under a temporary folder so the scripts can run against stubs here."""
  base = tmp_path_factory.mktemp("cluster")
  paths = {"run_dir": base / "run", "workdir": base / "work"}
  (base / "work").mkdir()
  k = load_example()
  k.update_from_flattened_dict({key: str(p) for key, p in paths.items()})
  out = base / "out"
  r = cli(f"--cluster={EXAMPLE}", "--target=all", f"--out={out}",
          *(f"--cluster.{key}={p}" for key, p in paths.items()),
          env=dict(ENV, **{k.token_env: TOKEN, k.sglang_key_env: KEY}))
  assert r.returncode == 0, r.stderr
  return out, k, r.stdout


def stubs(folder: Path) -> Path:
  """srun, scontrol, gcloud and python that record their arguments (NUL-separated), then the
  credentials in their environment, in $CALLS; srun runs the command it was given, as
  task 0."""
  folder.mkdir(exist_ok=True)
  # (a recorder ignores SIGTERM: the script stops an SGLang node's pair when one exits)
  record = ('trap "" TERM\n'
            'printf "%s\\0" "$(basename "$0")" "$@" --ENV-- "${FR_JAX_TOKEN:-}" '
            '"${SGLANG_API_KEY:-}" > "$(mktemp "$CALLS/call.XXXXXX")"\n')
  scripts = {
      "python": record,
      "scontrol": 'tr "," "\\n" <<< "$3"\n',  # scontrol show hostnames a,b
      "srun": record + 'while [[ "${1:-}" == --* ]]; do shift; done\n'
              'SLURM_PROCID=0 exec "$@"\n',
      "gcloud": record + 'if [[ "$4" == scp ]]; then cp "$5" "$HOME/.fr_jax_token"; fi\n'
                'if [[ "$4" == describe ]]; then echo 10.1.2.3; fi\n',
  }
  for name, body in scripts.items():
    (folder / name).write_text("#!/bin/bash\n" + body)
    (folder / name).chmod(0o755)
  return folder


def calls(folder: Path, env: bool = False) -> list:
  """Each recorded command line; with `env`, (command line, $FR_JAX_TOKEN, $SGLANG_API_KEY)
  as the command saw them."""
  out = []
  for f in folder.iterdir():
    parts = f.read_bytes().decode().split("\0")[:-1]
    i = parts.index("--ENV--")
    out.append((parts[:i], *parts[i + 1:]) if env else parts[:i])
  return out


def module_args(argv):
  """(module, args) for a `python -m MODULE args...` command line, else None."""
  if len(argv) >= 3 and argv[1] == "-m":
    return argv[2], argv[3:]
  return None


def flag_names(args):
  return {a[2:].split("=", 1)[0] for a in args if a.startswith("--")}


def flag_value(args, name):
  values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
  assert len(values) == 1, (name, args)
  return values[0]


def after(args, flag):
  """The values following a space-separated flag, up to the next flag."""
  i = args.index(flag) + 1
  j = next((n for n in range(i, len(args)) if args[n].startswith("--")), len(args))
  return args[i:j]


def run_slurm(rendered, tmp_path, groups):
  out, k, _ = rendered
  log = tmp_path / "calls"
  log.mkdir()
  env = dict(ENV, PATH=f"{stubs(tmp_path / 'bin')}:{os.environ['PATH']}", CALLS=str(log),
             TMPDIR=str(tmp_path), **{k.token_env: TOKEN, k.sglang_key_env: KEY})
  for i, hosts in enumerate(groups):
    env[f"SLURM_JOB_NODELIST_HET_GROUP_{i}"] = ",".join(hosts)
  r = subprocess.run(["bash", str(out / "slurm.sbatch")], env=env, capture_output=True,
                     text=True, timeout=60)
  return r, calls(log, env=True)


@pytest.fixture(scope="module")
def slurm_calls(rendered, tmp_path_factory):
  _, k, _ = rendered
  groups = ([f"gpu-l{i}" for i in range(k.learner.nodes)],
            [f"gpu-s{i}" for i in range(k.sglang.nodes)],
            [f"cpu-r{i}" for i in range(k.workers.nodes)])
  r, got = run_slurm(rendered, tmp_path_factory.mktemp("slurm"), groups)
  assert r.returncode == 0, r.stderr
  return groups, [argv for argv, *_ in got], got


def k8s_docs(rendered):
  return list(yaml.safe_load_all((rendered[0] / "k8s.yaml").read_text()))


def containers(docs):
  """{(kind, name): {container name: container}}."""
  return {(d["kind"], d["metadata"]["name"]):
          {c["name"]: c for c in d["spec"]["template"]["spec"]["containers"]}
          for d in docs if d["kind"] in ("Job", "StatefulSet", "Deployment")}


def k8s_commands(docs):
  return [module_args(c["command"] + c.get("args", [])) for cs in containers(docs).values()
          for c in cs.values()]


@pytest.fixture(scope="module")
def tpu_calls(rendered, tmp_path_factory):
  """The TPU VM script run with --create against stubs, then its remote command run here."""
  out, k, _ = rendered
  tmp = tmp_path_factory.mktemp("tpu")
  log, home = tmp / "calls", tmp / "home"
  log.mkdir()
  home.mkdir()
  env = dict(ENV, PATH=f"{stubs(tmp / 'bin')}:{os.environ['PATH']}", CALLS=str(log),
             HOME=str(home), **{k.token_env: TOKEN})
  r = subprocess.run(["bash", str(out / "tpu_vm.sh"), "--create"], env=env,
                     capture_output=True, text=True, timeout=60)
  assert r.returncode == 0, r.stderr
  local, stdout = calls(log), r.stdout
  ssh = next(c for c in local if c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"])
  remote = flag_value(ssh, "command")
  for f in log.iterdir():
    f.unlink()
  r = subprocess.run(["bash", "-c", remote], env=env, capture_output=True, text=True,
                     timeout=60)
  assert r.returncode == 0, r.stderr
  t_end = time.monotonic() + 10  # the learner was started in the background
  while not any(log.iterdir()) and time.monotonic() < t_end:
    time.sleep(0.05)
  remote_calls = calls(log, env=True)
  return local, remote, [argv for argv, *_ in remote_calls], stdout, remote_calls


def test_renders_each_file_and_prints_one_line_per_file(rendered):
  out, _, stdout = rendered
  lines = stdout.splitlines()
  assert [line.split()[0] for line in lines] == [
      str(out / "slurm.sbatch"), str(out / "k8s.yaml"), str(out / "tpu_vm.sh")]
  text = "".join((out / name).read_text() for name in os.listdir(out))
  assert TOKEN not in text  # the token comes from the environment or a Secret at run time


@pytest.mark.parametrize("name", ["slurm.sbatch", "tpu_vm.sh"])
def test_bash_n(rendered, name):
  r = subprocess.run(["bash", "-n", str(rendered[0] / name)], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr


def test_slurm_components_match_config(rendered):
  out, k, _ = rendered
  text = (out / "slurm.sbatch").read_text()
  directives = [line.split(None, 1)[1] for line in text.splitlines()
                if line.startswith("#SBATCH")]
  parts = [[]]
  for d in directives:
    if d == "hetjob":
      parts.append([])
    else:
      parts[-1].append(d)
  assert len(parts) == 3
  opts = [dict(d.split("=", 1) for d in part if "=" in d) for part in parts]
  assert opts[0]["--nodes"] == str(k.learner.nodes)
  assert opts[0]["--gpus-per-node"] == str(k.learner.devices_per_node)
  assert opts[0]["--ntasks-per-node"] == "1"  # one learner process per host
  assert opts[1]["--nodes"] == str(k.sglang.nodes)
  assert opts[1]["--gpus-per-node"] == str(k.sglang.gpus_per_node)
  assert opts[2]["--nodes"] == str(k.workers.nodes)
  assert opts[2]["--ntasks"] == str(k.workers.count + 1)  # the workers and the router
  assert "--gpus-per-node" not in opts[2] and "--gres" not in opts[2]
  assert all(o["--time"] == k.slurm.time for o in opts)


def test_slurm_run_wires_the_hosts(rendered, slurm_calls):
  _, k, _ = rendered
  (learners, servers, rollout), got, with_env = slurm_calls
  steps = [c[1:] for c in got if c[0] == "srun"]
  assert len(steps) == 4  # learner, SGLang fleet, router, workers
  learner_step = next(s for s in steps if "launch.learner" in s)
  assert learner_step[:3] == ["--het-group=0", f"--nodes={k.learner.nodes}",
                              "--ntasks-per-node=1"]
  fleet_step = next(s for s in steps if "sglang_node" in s)
  assert fleet_step[:2] == ["--het-group=1", f"--nodes={k.sglang.nodes}"]
  worker_step = next(s for s in steps if "worker_task" in s)
  assert "--het-group=2" in worker_step and f"--ntasks={k.workers.count}" in worker_step

  py = {m: a for m, a in filter(None, map(module_args, (c for c in got if c[0] == "python")))}
  assert set(py) == {"launch.learner", "sglang.launch_server", "launch.weight_relay",
                     "launch.router", "launch.worker"}
  # No credential on any command line; each process has the ones it uses in its environment.
  assert not [c for c in got if TOKEN in " ".join(c) or KEY in " ".join(c)]
  seen = {m[0]: (token, key) for c, token, key in with_env if (m := module_args(c))}
  for m in ("launch.learner", "launch.weight_relay", "launch.worker"):
    assert seen[m][0] == TOKEN, m
  for m in ("launch.weight_relay", "launch.worker", "launch.router"):
    assert seen[m][1] == KEY, m
  learner0 = f"{learners[0]}:{k.learner.port}"
  a = py["launch.learner"]
  assert "--distributed" in a and flag_value(a, "address") == f"0.0.0.0:{k.learner.port}"
  assert flag_value(a, "run_dir") == k.run_dir and flag_value(a, "config") == k.run_config
  assert "auth_token" not in flag_names(a)  # $FR_JAX_TOKEN, from the job's environment
  assert flag_value(a, "config.mesh.data") == str(k.learner.mesh_data)
  assert flag_value(a, "config.mesh.fsdp") == str(k.learner.mesh_fsdp)
  assert flag_value(a, "config.model.name") == f"hf:{k.checkpoint}"
  # Weights go through the relays: no HF export, or workers would reload via the router.
  assert flag_value(a, "config.service.export_hf") == "False"
  a = py["sglang.launch_server"]
  assert after(a, "--model-path") == [k.checkpoint] and after(a, "--port") == [str(k.sglang.port)]
  assert len(after(a, "--config")) == 1 and "--api-key" not in a  # the key file, removed after
  assert after(a, "--tp-size") == [str(k.sglang.tp_size)]
  assert int(after(a, "--dp-size")[0]) * k.sglang.tp_size == k.sglang.gpus_per_node
  assert a[-len(k.sglang.extra_args):] == list(k.sglang.extra_args)
  a = py["launch.weight_relay"]
  assert flag_value(a, "config") == k.run_config  # the model's HF config and tokenizer
  assert flag_value(a, "config.model.name") == f"hf:{k.checkpoint}"
  assert flag_value(a, "learner") == learner0
  assert flag_value(a, "server") == f"http://127.0.0.1:{k.sglang.port}"
  assert flag_value(a, "dir").startswith(k.relay.dir + ".")  # private to the job (mktemp -d)
  assert "auth_token" not in flag_names(a)
  a = py["launch.router"]
  assert after(a, "--worker-urls") == [f"http://{h}:{k.sglang.port}" for h in servers]
  assert after(a, "--port") == [str(k.router.port)]
  router_step = next(s for s in steps if "launch.router" in s)
  assert f"--nodelist={rollout[0]}" in router_step
  a = py["launch.worker"]
  assert flag_value(a, "learner") == learner0
  assert flag_value(a, "worker_index") == "0"  # srun's task id (the stub runs task 0)
  assert flag_value(a, "num_workers") == str(k.workers.count)
  assert flag_value(a, "config.rollout.engine") == "sglang"
  assert flag_value(a, "config.rollout.server_url") == f"http://{rollout[0]}:{k.router.port}"


def test_scripts_refuse_to_start_without_the_token(rendered, tmp_path):
  out, k, _ = rendered
  log = tmp_path / "calls"
  log.mkdir()
  env = {key: v for key, v in ENV.items() if key not in (k.token_env, k.sglang_key_env)}
  env.update(PATH=f"{stubs(tmp_path / 'bin')}:{os.environ['PATH']}", CALLS=str(log),
             HOME=str(tmp_path))
  for name in ("slurm.sbatch", "tpu_vm.sh"):
    r = subprocess.run(["bash", str(out / name)], env=dict(env, **{k.sglang_key_env: KEY}),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and k.token_env in r.stderr, (name, r.stderr)
  for bad in ("", "has space", "quote'd"):  # no key, or one that cannot go into its YAML file
    r = subprocess.run(["bash", str(out / "slurm.sbatch")],
                       env=dict(env, **{k.token_env: TOKEN, k.sglang_key_env: bad}),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and k.sglang_key_env in r.stderr, (bad, r.stderr)
  assert calls(log) == []  # nothing was started


def test_k8s_manifests(rendered):
  _, k, _ = rendered
  docs = k8s_docs(rendered)
  kinds = sorted(d["kind"] for d in docs)
  assert kinds == sorted(["Service"] * 3 + ["Job"] * 2 + ["StatefulSet", "Deployment"]
                         + ["NetworkPolicy"] * 3)
  assert all(d["metadata"]["namespace"] == k.k8s.namespace for d in docs)
  by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
  cs = containers(docs)
  svc = f"{k.k8s.namespace}.svc.cluster.local"
  learner0 = f"{k.name}-learner-0.{k.name}-learner.{svc}"

  job = by[("Job", f"{k.name}-learner")]["spec"]
  assert job["completionMode"] == "Indexed"
  assert job["completions"] == job["parallelism"] == k.learner.nodes
  pod = job["template"]["spec"]
  head = by[("Service", f"{k.name}-learner")]["spec"]
  assert head["clusterIP"] == "None" and pod["subdomain"] == f"{k.name}-learner"
  assert head["selector"].items() <= job["template"]["metadata"]["labels"].items()
  c = cs[("Job", f"{k.name}-learner")]["learner"]
  a = c["args"]
  assert flag_value(a, "coordinator_address") == f"{learner0}:{k.learner.coordinator_port}"
  assert flag_value(a, "num_processes") == str(k.learner.nodes)
  assert flag_value(a, "process_id") == "$(JOB_COMPLETION_INDEX)"
  assert flag_value(a, "config.service.export_hf") == "False"
  assert flag_value(a, "address") == f"0.0.0.0:{k.learner.port}"
  assert "auth_token" not in flag_names(a)  # $FR_JAX_TOKEN, from the Secret
  env = {e["name"]: e["valueFrom"] for e in c["env"]}
  assert "job-completion-index" in env["JOB_COMPLETION_INDEX"]["fieldRef"]["fieldPath"]
  assert env["FR_JAX_TOKEN"]["secretKeyRef"]["name"] == k.k8s.token_secret
  for (_, name), pod in cs.items():  # every fr_jax process reads its secrets from env
    for ctr in pod.values():
      assert not [x for x in ctr["command"] + ctr.get("args", []) if "$(" in x and "TOKEN" in x]
      env = {e["name"]: e.get("valueFrom", {}) for e in ctr.get("env", [])}
      if any(m in ctr["command"] for m in ("launch.worker", "launch.weight_relay")):
        assert env["FR_JAX_TOKEN"]["secretKeyRef"]["name"] == k.k8s.token_secret, name
      if any(m in ctr["command"] for m in ("launch.worker", "launch.weight_relay",
                                           "launch.router")):
        assert env["SGLANG_API_KEY"]["secretKeyRef"] == {"name": k.k8s.sglang_key_secret,
                                                         "key": "key"}, name
  assert c["resources"]["limits"][k.k8s.gpu_resource] == k.learner.devices_per_node

  sts = by[("StatefulSet", f"{k.name}-sglang")]["spec"]
  assert sts["replicas"] == k.sglang.nodes and sts["serviceName"] == f"{k.name}-sglang"
  pair = cs[("StatefulSet", f"{k.name}-sglang")]
  server, relay = pair["sglang"], pair["weight-relay"]
  assert server["resources"]["limits"][k.k8s.gpu_resource] == k.sglang.gpus_per_node
  assert after(server["args"], "--port") == [str(k.sglang.port)]
  (key_dir,) = [m["mountPath"] for m in server["volumeMounts"] if m["name"] == "sglang-key"]
  assert after(server["args"], "--config") == [f"{key_dir}/sglang.yaml"]
  vols = {v["name"]: v for v in by[("StatefulSet", f"{k.name}-sglang")]["spec"]["template"]
          ["spec"]["volumes"]}
  assert vols["sglang-key"]["secret"]["secretName"] == k.k8s.sglang_key_secret
  assert flag_value(relay["args"], "server") == f"http://127.0.0.1:{k.sglang.port}"
  assert flag_value(relay["args"], "learner") == f"{learner0}:{k.learner.port}"
  assert flag_value(relay["args"], "dir") == k.relay.dir
  assert flag_value(relay["args"], "config.model.name") == f"hf:{k.checkpoint}"
  mount = lambda c: {m["name"] for m in c["volumeMounts"] if m["mountPath"] == k.relay.dir}  # noqa
  assert mount(server) & mount(relay)  # the relay writes where the server reads

  assert cs[("Deployment", f"{k.name}-router")]["router"]["command"][1:] == ["-m",
                                                                            "launch.router"]
  router = cs[("Deployment", f"{k.name}-router")]["router"]["args"]
  assert after(router, "--worker-urls") == [
      f"http://{k.name}-sglang-{i}.{k.name}-sglang.{svc}:{k.sglang.port}"
      for i in range(k.sglang.nodes)]
  assert by[("Service", f"{k.name}-router")]["spec"]["ports"][0]["port"] == k.router.port

  workers = by[("Job", f"{k.name}-workers")]["spec"]
  assert workers["completions"] == workers["parallelism"] == k.workers.count
  a = cs[("Job", f"{k.name}-workers")]["worker"]["args"]
  assert flag_value(a, "worker_index") == "$(JOB_COMPLETION_INDEX)"
  assert flag_value(a, "num_workers") == str(k.workers.count)
  assert flag_value(a, "learner") == f"{learner0}:{k.learner.port}"
  assert flag_value(a, "config.rollout.server_url") == f"http://{k.name}-router.{svc}:" \
                                                      f"{k.router.port}"

  # Who may reach which port (the policies select pods by the labels the workloads carry).
  policy = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}

  def admits(target, port):
    rules = policy[f"{k.name}-{target}"]["ingress"]
    return sorted(f["podSelector"]["matchLabels"]["app"] for r in rules
                  if {"port": port} in r["ports"] for f in r["from"])

  assert admits("learner", k.learner.port) == [f"{k.name}-sglang", f"{k.name}-workers"]
  assert admits("learner", k.learner.coordinator_port) == [f"{k.name}-learner"]
  assert admits("sglang", k.sglang.port) == [f"{k.name}-router"]
  assert admits("router", k.router.port) == [f"{k.name}-workers"]
  labels = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]["app"]
            for d in docs if d["kind"] in ("Job", "StatefulSet", "Deployment")}
  for spec in policy.values():
    assert spec["podSelector"]["matchLabels"]["app"] in labels.values()


def test_k8s_claims_are_mounted(tmp_path):
  """With claims for the run directory and the checkpoint, each pod mounts what it reads."""
  k = load_example()
  r = cli(f"--cluster={EXAMPLE}", "--target=k8s", f"--out={tmp_path}",
          "--cluster.k8s.run_dir_pvc=runs", "--cluster.k8s.checkpoint_pvc=weights")
  assert r.returncode == 0, r.stderr
  docs = list(yaml.safe_load_all((tmp_path / "k8s.yaml").read_text()))
  for d in docs:
    if d["kind"] not in ("Job", "StatefulSet", "Deployment"):
      continue
    pod = d["spec"]["template"]["spec"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
              for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
    for c in pod["containers"]:
      if "launch.router" in c["command"]:
        continue  # the router reads nothing
      mounted = {m["mountPath"]: claims.get(m["name"]) for m in c.get("volumeMounts", [])}
      assert mounted.get(k.checkpoint) == "weights", (d["metadata"]["name"], c["name"])
      if "launch.learner" in c["command"]:
        assert mounted.get(k.run_dir) == "runs"


def test_tpu_vm_script(rendered, tpu_calls):
  _, k, _ = rendered
  local, remote, remote_calls, stdout, with_env = tpu_calls
  verbs = {c[4]: c for c in local if c[0] == "gcloud"}
  assert set(verbs) == {"create", "scp", "ssh", "describe"}
  create = verbs["create"]
  assert create[5] == k.tpu.name and f"--zone={k.tpu.zone}" in create
  assert f"--accelerator-type={k.tpu.accelerator_type}" in create
  assert f"--version={k.tpu.runtime_version}" in create
  ssh = verbs["ssh"]
  assert ssh[5] == k.tpu.name and "--worker=all" in ssh and f"--zone={k.tpu.zone}" in ssh
  assert "--worker=all" in verbs["scp"] and TOKEN not in remote
  r = subprocess.run(["bash", "-n", "-c", remote], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr
  (module, a), = [module_args(c) for c in remote_calls]
  assert module == "launch.learner"
  assert "--distributed" in a and flag_value(a, "address") == f"0.0.0.0:{k.learner.port}"
  assert "auth_token" not in flag_names(a)
  assert [token for _, token, _ in with_env] == [TOKEN]  # read on the host from the copied file
  assert flag_value(a, "config.mesh.data") == str(k.tpu.mesh_data)
  assert flag_value(a, "config.mesh.fsdp") == str(k.tpu.mesh_fsdp)
  assert flag_value(a, "config.service.export_hf") == "False"
  assert f"10.1.2.3:{k.learner.port}" in stdout  # where workers and relays connect


def test_tpu_vm_script_creates_only_when_asked(rendered, tmp_path):
  out, k, _ = rendered
  log = tmp_path / "calls"
  log.mkdir()
  env = dict(ENV, PATH=f"{stubs(tmp_path / 'bin')}:{os.environ['PATH']}", CALLS=str(log),
             HOME=str(tmp_path), **{k.token_env: TOKEN})
  r = subprocess.run(["bash", str(out / "tpu_vm.sh")], env=env, capture_output=True,
                     text=True, timeout=60)
  assert r.returncode == 0, r.stderr
  assert {c[4] for c in calls(log)} == {"scp", "ssh", "describe"}


def all_commands(rendered, slurm_calls, tpu_remote_calls=()):
  """(where, module, args) for every command line the files run."""
  got = [("slurm", *m) for m in map(module_args, slurm_calls[1]) if m]
  got += [("k8s", *m) for m in k8s_commands(k8s_docs(rendered)) if m]
  got += [("tpu_vm", *m) for m in map(module_args, tpu_remote_calls) if m]
  return got


def defined_flags(module):
  code = ("import json, importlib, sys\nfrom absl import flags\n"
          "importlib.import_module(sys.argv[1])\nprint(json.dumps(sorted(flags.FLAGS)))")
  r = subprocess.run([sys.executable, "-c", code, module], cwd=ROOT, capture_output=True,
                     text=True, env=ENV, timeout=60)
  assert r.returncode == 0, r.stderr
  return set(json.loads(r.stdout))


def has_path(config, dotted):
  for part in dotted.split("."):
    if not hasattr(config, "keys") or part not in config:
      return False
    config = config[part]
  return True


@pytest.mark.parametrize("module", ["launch.learner", "launch.worker", "launch.weight_relay"])
def test_our_flags_exist(rendered, slurm_calls, tpu_calls, module):
  if importlib.util.find_spec(module) is None:
    pytest.skip(f"{module} is not in the tree yet; this test checks it once it lands")
  used = {}
  for where, m, args in all_commands(rendered, slurm_calls, tpu_calls[2]):
    if m == module:
      for name in flag_names(args):
        used.setdefault(name, set()).add(where)
  assert used, f"no rendered file runs {module}"
  defined = defined_flags(module)
  spec = importlib.util.spec_from_file_location("_run_config", ROOT / rendered[1].run_config)
  run_module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(run_module)
  run_config = run_module.get_config()
  overrides = {n for n in used if n.startswith("config.")}
  bad = {n: used[n] for n in overrides if not has_path(run_config, n[len("config."):])}
  assert not bad, f"--config overrides naming no field of {rendered[1].run_config}: {bad}"
  missing = {n: used[n] for n in set(used) - overrides - defined}
  assert not missing, f"{module} has no flag(s) {missing} (used in the files named)"


def test_router_flags_exist(rendered, slurm_calls):
  r = subprocess.run([sys.executable, "-m", "sglang_router.launch_router", "--help"],
                     capture_output=True, text=True, env=ENV, timeout=60)
  assert r.returncode == 0, r.stderr
  defined = set(re.findall(r"--([a-z][a-z0-9-]*)", r.stdout))
  commands = [args for _, m, args in all_commands(rendered, slurm_calls)
              if m == "launch.router"]  # sglang_router's own flags, with the key from env
  assert len(commands) == 2  # Slurm and Kubernetes
  for args in commands:
    assert flag_names(args) <= defined, flag_names(args) - defined


def test_sglang_flags_are_documented(rendered, slurm_calls):
  commands = [args for _, m, args in all_commands(rendered, slurm_calls)
              if m == "sglang.launch_server"]
  assert len(commands) == 2
  for args in commands:
    assert flag_names(args) <= SGLANG_DOCUMENTED_FLAGS, \
        flag_names(args) - SGLANG_DOCUMENTED_FLAGS


@pytest.mark.parametrize("override,named", [
    (["--cluster.learner.nodes=0"], "learner.nodes=0"),
    (["--cluster.router.port=70000"], "router.port=70000"),
    (["--cluster.learner.devices_per_node=8"], "learner.mesh_data * learner.mesh_fsdp"),
    # 16 devices: the recipe's packing.row_buckets (8, 16, ...) do not split over them
    (["--cluster.learner.devices_per_node=8", "--cluster.learner.mesh_fsdp=8"], "row_buckets"),
    # two learner pods writing checkpoint shards to their own emptyDirs
    (["--cluster.k8s.run_dir_pvc="], "k8s.run_dir_pvc"),
    (["--cluster.tls.dir=/etc/fr_jax/tls"], "k8s.tls_secret"),
    (["--cluster.sglang_key_env=1BAD"], "sglang_key_env"),
])
def test_bad_config_is_one_line_and_exit_2(tmp_path, override, named):
  r = cli(f"--cluster={EXAMPLE}", f"--out={tmp_path}", *override)
  assert r.returncode == 2, r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], r.stderr
  assert list(tmp_path.iterdir()) == []  # nothing written


def test_one_target_checks_only_what_it_uses(tmp_path):
  # a v5p-8 has 4 JAX devices, not the example's tpu mesh of 8: only the TPU VM file cares
  r = cli(f"--cluster={EXAMPLE}", "--target=slurm", f"--out={tmp_path}",
          "--cluster.tpu.accelerator_type=v5p-8")
  assert r.returncode == 0, r.stderr
  assert [p.name for p in tmp_path.iterdir()] == ["slurm.sbatch"]
  r = cli(f"--cluster={EXAMPLE}", "--target=tpu_vm", f"--out={tmp_path}",
          "--cluster.tpu.accelerator_type=v5p-8")
  assert r.returncode == 2 and "v5p-8 has 4 JAX devices" in r.stderr, r.stderr


def test_tls_reaches_every_grpc_end(tmp_path):
  """With tls.dir, the learner serves mutual TLS and every worker and relay presents the
  client certificate, in all three files."""
  d = "/etc/fr_jax/tls"
  r = cli(f"--cluster={EXAMPLE}", "--target=all", f"--out={tmp_path}", f"--cluster.tls.dir={d}",
          "--cluster.k8s.tls_secret=fr-jax-tls")
  assert r.returncode == 0, r.stderr
  server = [f"--tls_cert={d}/server.pem", f"--tls_key={d}/server.key",
            f"--tls_client_ca={d}/ca.pem"]
  client = [f"--tls_ca={d}/ca.pem", f"--tls_cert={d}/client.pem", f"--tls_key={d}/client.key"]
  docs = list(yaml.safe_load_all((tmp_path / "k8s.yaml").read_text()))
  for pod in containers(docs).values():
    for c in pod.values():
      a = c["command"] + c.get("args", [])
      want = server if "launch.learner" in a else client if (
          "launch.worker" in a or "launch.weight_relay" in a) else []
      assert [x for x in a if x.startswith("--tls")] == want, c["name"]
      if want:
        assert {"name": "tls", "mountPath": d, "readOnly": True} in c["volumeMounts"]
  for name in ("slurm.sbatch", "tpu_vm.sh"):
    text = (tmp_path / name).read_text()
    assert all(f in text for f in server), name
  assert (tmp_path / "slurm.sbatch").read_text().count(client[1]) == 2  # relays, workers
