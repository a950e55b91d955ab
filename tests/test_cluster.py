"""launch.cluster: the Slurm, Kubernetes and TPU VM files rendered from launch/cluster/example.py.

What can be checked without a cluster: the files render, the shell scripts parse (`bash -n`)
and run against stub `srun`/`scontrol`/`gcloud`/`python` that record every command line, the
manifests are YAML of the right shape, every flag passed to one of our commands (or to
sglang-router, or to SGLang, or to vLLM) exists, and a bad cluster config is one line with
exit status 2. Both rollout fleets: SGLang (the example's default) and vLLM
(`--cluster.engine=vllm`). Expected values are computed here from the cluster config, not
read back from the renderer.
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
VKEY = "not-a-real-vllm-key-5b2d"  # the vLLM API key: the same
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"  # `make vllm-tools`
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
  task $STUB_PROCID (default 0)."""
  folder.mkdir(exist_ok=True)
  # (a recorder ignores SIGTERM: the script stops a server node's pair when one exits)
  record = ('trap "" TERM\n'
            'printf "%s\\0" "$(basename "$0")" "$@" --ENV-- "${FR_JAX_TOKEN:-}" '
            '"${SGLANG_API_KEY:-}" "${VLLM_API_KEY:-}" > "$(mktemp "$CALLS/call.XXXXXX")"\n')
  scripts = {
      "python": record,
      "scontrol": 'tr "," "\\n" <<< "$3"\n',  # scontrol show hostnames a,b
      "srun": record + 'while [[ "${1:-}" == --* ]]; do shift; done\n'
              'SLURM_PROCID="${STUB_PROCID:-0}" exec "$@"\n',
      "gcloud": record + 'if [[ "$4" == scp ]]; then cp "$5" "$HOME/.fr_jax_token"; fi\n'
                'if [[ "$4" == describe ]]; then echo 10.1.2.3; fi\n',
  }
  for name, body in scripts.items():
    (folder / name).write_text("#!/bin/bash\n" + body)
    (folder / name).chmod(0o755)
  return folder


def calls(folder: Path, env: bool = False, key_var: str = "SGLANG_API_KEY") -> list:
  """Each recorded command line; with `env`, (command line, $FR_JAX_TOKEN, $`key_var`) as the
  command saw them (`key_var`: SGLANG_API_KEY or VLLM_API_KEY)."""
  out = []
  for f in folder.iterdir():
    parts = f.read_bytes().decode().split("\0")[:-1]
    i = parts.index("--ENV--")
    token, sglang_key, vllm_key = parts[i + 1:]
    key = {"SGLANG_API_KEY": sglang_key, "VLLM_API_KEY": vllm_key}[key_var]
    out.append((parts[:i], token, key) if env else parts[:i])
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


def run_slurm(rendered, tmp_path, groups, keys=None, key_var="SGLANG_API_KEY", procid=0):
  """The rendered slurm.sbatch run against stubs, with `keys` ({variable: value}; default:
  the SGLang key) in its environment and srun's tasks numbered `procid`."""
  out, k, _ = rendered
  log = tmp_path / "calls"
  log.mkdir()
  env = {key: v for key, v in ENV.items() if key not in ("SGLANG_API_KEY", "VLLM_API_KEY")}
  env.update(PATH=f"{stubs(tmp_path / 'bin')}:{os.environ['PATH']}", CALLS=str(log),
             TMPDIR=str(tmp_path), STUB_PROCID=str(procid),
             **{k.token_env: TOKEN, **(keys or {k.sglang_key_env: KEY})})
  for i, hosts in enumerate(groups):
    env[f"SLURM_JOB_NODELIST_HET_GROUP_{i}"] = ",".join(hosts)
  r = subprocess.run(["bash", str(out / "slurm.sbatch")], env=env, capture_output=True,
                     text=True, timeout=60)
  return r, calls(log, env=True, key_var=key_var)


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


def sbatch_components(text):
  """The #SBATCH directives of each heterogeneous component, split at `hetjob`."""
  parts = [[]]
  for line in text.splitlines():
    if line.startswith("#SBATCH"):
      d = line.split(None, 1)[1]
      if d == "hetjob":
        parts.append([])
      else:
        parts[-1].append(d)
  return parts


def test_slurm_components_match_config(rendered):
  out, k, _ = rendered
  text = (out / "slurm.sbatch").read_text()
  parts = sbatch_components(text)
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


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_k8s_claims_are_mounted(tmp_path, engine):
  """With claims for the run directory and the checkpoint, each pod mounts what it reads."""
  k = load_example()
  r = cli(f"--cluster={EXAMPLE}", "--target=k8s", f"--out={tmp_path}",
          "--cluster.k8s.run_dir_pvc=runs", "--cluster.k8s.checkpoint_pvc=weights",
          f"--cluster.engine={engine}")
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
    (["--cluster.engine=trtllm"], "engine='trtllm'"),
    (["--cluster.engine=vllm", "--cluster.vllm_key_env=1BAD"], "vllm_key_env"),
    (["--cluster.engine=vllm", "--cluster.vllm.tp_size=3"], "vllm.tp_size=3"),
    (["--cluster.engine=vllm", "--cluster.vllm.port=0"], "vllm.port=0"),
    (["--cluster.engine=vllm", "--cluster.vllm.dtype=float16"], "vllm.dtype"),
    (["--cluster.engine=vllm", "--cluster.vllm.gpu_memory_utilization=1.5"],
     "vllm.gpu_memory_utilization"),
    (["--cluster.engine=vllm", "--cluster.vllm.extra_args=('--api-key=x',)"],
     "vllm.extra_args has --api-key"),
    # one server would get no worker (worker i generates on server i mod vllm.nodes)
    (["--cluster.engine=vllm", "--cluster.workers.count=1"], "workers.count=1 < vllm.nodes"),
    # the recipe's agent.max_total_tokens (4608) would not fit
    (["--cluster.engine=vllm", "--cluster.vllm.max_model_len=4096"], "agent.max_total_tokens"),
    (["--cluster.engine=vllm", "--cluster.k8s.vllm_key_secret=has space"],
     "k8s.vllm_key_secret"),
])
def test_bad_config_is_one_line_and_exit_2(tmp_path, override, named):
  r = cli(f"--cluster={EXAMPLE}", f"--out={tmp_path}", *override)
  assert r.returncode == 2, r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], r.stderr
  assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_lora_run_starts_vllm_servers_with_lora_and_refuses_sglang(tmp_path):
  """A run config with LoRA adapters (qwen25_7b_tool_lora): the vLLM servers of both files
  start with --lora_rank (each version then loads as an adapter); an SGLang fleet, whose
  workers go through the router, is refused by name, nothing written."""
  lora = "--cluster.run_config=experiments/configs/qwen25_7b_tool_lora.py"
  r = cli(f"--cluster={EXAMPLE}", f"--out={tmp_path}", lora, "--cluster.engine=vllm")
  assert r.returncode == 0, r.stderr
  for name in ("slurm.sbatch", "k8s.yaml"):
    text = (tmp_path / name).read_text()
    assert text.count("--lora_rank=16") == 1, name
  out = tmp_path / "sglang"
  r = cli(f"--cluster={EXAMPLE}", f"--out={out}", lora)
  assert r.returncode == 2 and "model.lora.rank=16" in r.stderr and "router" in r.stderr
  assert not out.exists() or list(out.iterdir()) == []


def test_one_target_checks_only_what_it_uses(tmp_path):
  # a v5p-8 has 4 JAX devices, not the example's tpu mesh of 8: only the TPU VM file cares
  r = cli(f"--cluster={EXAMPLE}", "--target=slurm", f"--out={tmp_path}",
          "--cluster.tpu.accelerator_type=v5p-8")
  assert r.returncode == 0, r.stderr
  assert [p.name for p in tmp_path.iterdir()] == ["slurm.sbatch"]
  r = cli(f"--cluster={EXAMPLE}", "--target=tpu_vm", f"--out={tmp_path}",
          "--cluster.tpu.accelerator_type=v5p-8")
  assert r.returncode == 2 and "v5p-8 has 4 JAX devices" in r.stderr, r.stderr


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_tls_reaches_every_grpc_end(tmp_path, engine):
  """With tls.dir, the learner serves mutual TLS and every worker and relay presents the
  client certificate, in all three files."""
  d = "/etc/fr_jax/tls"
  r = cli(f"--cluster={EXAMPLE}", "--target=all", f"--out={tmp_path}", f"--cluster.tls.dir={d}",
          "--cluster.k8s.tls_secret=fr-jax-tls", f"--cluster.engine={engine}")
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


# --- The vLLM fleet (--cluster.engine=vllm): launch.vllm_server per node, no router ---

def kubelet_expand(s: str, env: dict) -> str:
  """Kubernetes' expansion of a container's command and args: `$(NAME)` is NAME's value (left
  as it is when NAME is not defined), `$$` is `$`."""
  out, i = [], 0
  while i < len(s):
    if s[i] == "$" and i + 1 < len(s):
      if s[i + 1] == "(" and (j := s.find(")", i + 2)) != -1:
        out.append(env.get(s[i + 2:j], s[i:j + 1]))
        i = j + 1
        continue
      out.append("$" if s[i + 1] == "$" else s[i:i + 2])
      i += 2
      continue
    out.append(s[i])
    i += 1
  return "".join(out)


@pytest.fixture(scope="module")
def rendered_vllm(tmp_path_factory):
  """(out dir, cluster config, stdout): the Slurm and Kubernetes files of the example with
  engine=vllm, its host paths moved under a temporary folder."""
  base = tmp_path_factory.mktemp("cluster_vllm")
  paths = {"run_dir": base / "run", "workdir": base / "work"}
  (base / "work").mkdir()
  k = load_example()
  k.update_from_flattened_dict({key: str(p) for key, p in paths.items()})
  k.engine = "vllm"
  out = base / "out"
  r = cli(f"--cluster={EXAMPLE}", "--target=all", f"--out={out}", "--cluster.engine=vllm",
          *(f"--cluster.{key}={p}" for key, p in paths.items()),
          env=dict(ENV, **{k.token_env: TOKEN, k.vllm_key_env: VKEY}))
  assert r.returncode == 0, r.stderr
  return out, k, r.stdout


VLLM_PROCID = 3  # the worker task the Slurm stubs run: server 3 mod vllm.nodes


@pytest.fixture(scope="module")
def vllm_slurm_calls(rendered_vllm, tmp_path_factory):
  """slurm.sbatch run against stubs with only the token and the vLLM key in its environment
  (no SGLang key: the vLLM file must not need one)."""
  _, k, _ = rendered_vllm
  groups = ([f"gpu-l{i}" for i in range(k.learner.nodes)],
            [f"gpu-v{i}" for i in range(k.vllm.nodes)],
            [f"cpu-r{i}" for i in range(k.workers.nodes)])
  r, got = run_slurm(rendered_vllm, tmp_path_factory.mktemp("slurm_vllm"), groups,
                     keys={k.vllm_key_env: VKEY}, key_var="VLLM_API_KEY", procid=VLLM_PROCID)
  assert r.returncode == 0, r.stderr
  return groups, [argv for argv, *_ in got], got


def test_vllm_renders_without_secrets(rendered_vllm):
  out, k, stdout = rendered_vllm
  assert [line.split()[0] for line in stdout.splitlines()] == [
      str(out / "slurm.sbatch"), str(out / "k8s.yaml"), str(out / "tpu_vm.sh")]
  assert f"{k.vllm.nodes} vLLM" in stdout and "router" not in stdout
  text = "".join((out / name).read_text() for name in os.listdir(out))
  assert TOKEN not in text and VKEY not in text
  assert "--api-key" not in text  # the key reaches vLLM through launch.vllm_server's env
  r = subprocess.run(["bash", "-n", str(out / "slurm.sbatch")], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr


def test_vllm_slurm_components_match_config(rendered_vllm):
  out, k, _ = rendered_vllm
  parts = sbatch_components((out / "slurm.sbatch").read_text())
  opts = [dict(d.split("=", 1) for d in part if "=" in d) for part in parts]
  assert len(opts) == 3
  assert opts[1]["--nodes"] == str(k.vllm.nodes)
  assert opts[1]["--gpus-per-node"] == str(k.vllm.gpus_per_node)
  assert opts[2]["--ntasks"] == str(k.workers.count)  # the workers alone: no router


def test_vllm_slurm_run_wires_the_hosts(rendered_vllm, vllm_slurm_calls):
  _, k, _ = rendered_vllm
  (learners, servers, _), got, with_env = vllm_slurm_calls
  steps = [c[1:] for c in got if c[0] == "srun"]
  assert len(steps) == 3  # learner, vLLM fleet, workers
  fleet_step = next(s for s in steps if "vllm_node" in s)
  assert fleet_step[:3] == ["--het-group=1", f"--nodes={k.vllm.nodes}", "--ntasks-per-node=1"]
  worker_step = next(s for s in steps if "worker_task" in s)
  assert "--het-group=2" in worker_step and f"--ntasks={k.workers.count}" in worker_step

  py = {m: a for m, a in filter(None, map(module_args, (c for c in got if c[0] == "python")))}
  assert set(py) == {"launch.learner", "launch.vllm_server", "launch.weight_relay",
                     "launch.worker"}
  # No credential on any command line; each process has the ones it uses in its environment.
  assert not [c for c in got if TOKEN in " ".join(c) or VKEY in " ".join(c)]
  seen = {m[0]: (token, key) for c, token, key in with_env if (m := module_args(c))}
  for m in ("launch.learner", "launch.weight_relay", "launch.worker"):
    assert seen[m][0] == TOKEN, m
  for m in ("launch.vllm_server", "launch.weight_relay", "launch.worker"):
    assert seen[m][1] == VKEY, m

  a = py["launch.vllm_server"]
  assert flag_value(a, "model") == k.checkpoint and flag_value(a, "host") == "0.0.0.0"
  assert flag_value(a, "port") == str(k.vllm.port)
  assert flag_value(a, "dtype") == k.vllm.dtype
  assert flag_value(a, "max_model_len") == str(k.vllm.max_model_len)
  assert flag_value(a, "python") == k.vllm.python
  assert "api_key" not in flag_names(a) and "allow_no_key" not in flag_names(a)
  export_dir = flag_value(a, "export_dir")
  vllm_args = a[a.index("--") + 1:]  # vLLM's own, after launch.vllm_server's `--`
  assert flag_value(vllm_args, "tensor-parallel-size") == str(k.vllm.tp_size)
  assert int(flag_value(vllm_args, "data-parallel-size")) * k.vllm.tp_size \
      == k.vllm.gpus_per_node
  assert flag_value(vllm_args, "gpu-memory-utilization") == str(k.vllm.gpu_memory_utilization)
  a = py["launch.weight_relay"]
  assert flag_value(a, "engine") == "vllm"
  assert flag_value(a, "server") == f"http://127.0.0.1:{k.vllm.port}"  # its own server
  assert flag_value(a, "learner") == f"{learners[0]}:{k.learner.port}"
  relay_dir = flag_value(a, "dir")
  assert relay_dir.startswith(k.relay.dir + ".")  # private to the job (mktemp -d)
  assert export_dir == f"{relay_dir}/model"  # the server's untied copy: beside the versions
  a = py["launch.worker"]
  assert flag_value(a, "worker_index") == str(VLLM_PROCID)
  assert flag_value(a, "config.rollout.engine") == "vllm"
  # worker i generates on server i mod vllm.nodes, directly
  assert flag_value(a, "config.rollout.server_url") == \
      f"http://{servers[VLLM_PROCID % k.vllm.nodes]}:{k.vllm.port}"


def test_vllm_slurm_refuses_to_start_without_the_key(rendered_vllm, tmp_path):
  out, k, _ = rendered_vllm
  log = tmp_path / "calls"
  log.mkdir()
  env = {key: v for key, v in ENV.items()
         if key not in (k.token_env, k.vllm_key_env, "SGLANG_API_KEY")}
  env.update(PATH=f"{stubs(tmp_path / 'bin')}:{os.environ['PATH']}", CALLS=str(log),
             **{k.token_env: TOKEN, k.vllm_key_env: ""})
  r = subprocess.run(["bash", str(out / "slurm.sbatch")], env=env, capture_output=True,
                     text=True, timeout=60)
  assert r.returncode != 0 and k.vllm_key_env in r.stderr, r.stderr
  assert calls(log) == []  # nothing was started


def test_vllm_k8s_manifests(rendered_vllm, tmp_path):
  _, k, _ = rendered_vllm
  docs = k8s_docs(rendered_vllm)
  assert sorted(d["kind"] for d in docs) == sorted(
      ["Service"] * 2 + ["Job"] * 2 + ["StatefulSet"] + ["NetworkPolicy"] * 2)  # no router
  by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
  cs = containers(docs)
  svc = f"{k.k8s.namespace}.svc.cluster.local"
  learner0 = f"{k.name}-learner-0.{k.name}-learner.{svc}"
  key_ref = {"name": k.k8s.vllm_key_secret, "key": "key"}

  sts = by[("StatefulSet", f"{k.name}-vllm")]["spec"]
  assert sts["replicas"] == k.vllm.nodes and sts["serviceName"] == f"{k.name}-vllm"
  assert by[("Service", f"{k.name}-vllm")]["spec"]["clusterIP"] == "None"
  pair = cs[("StatefulSet", f"{k.name}-vllm")]
  server, relay = pair["vllm"], pair["weight-relay"]
  assert server["image"] == k.k8s.vllm_image
  assert module_args(server["command"] + server["args"])[0] == "launch.vllm_server"
  a = server["args"]
  assert flag_value(a, "model") == k.checkpoint and flag_value(a, "port") == str(k.vllm.port)
  assert flag_value(a, "host") == "0.0.0.0" and flag_value(a, "python") == k.vllm.python
  assert flag_value(a, "export_dir").startswith(k.relay.dir + "/")
  vllm_args = a[a.index("--") + 1:]
  assert flag_value(vllm_args, "tensor-parallel-size") == str(k.vllm.tp_size)
  assert int(flag_value(vllm_args, "data-parallel-size")) * k.vllm.tp_size \
      == k.vllm.gpus_per_node
  assert server["resources"]["limits"][k.k8s.gpu_resource] == k.vllm.gpus_per_node
  assert server["readinessProbe"]["httpGet"] == {"path": "/health", "port": k.vllm.port}
  assert flag_value(relay["args"], "engine") == "vllm"
  assert flag_value(relay["args"], "server") == f"http://127.0.0.1:{k.vllm.port}"
  assert flag_value(relay["args"], "learner") == f"{learner0}:{k.learner.port}"
  assert flag_value(relay["args"], "dir") == k.relay.dir
  mount = lambda c: {m["name"] for m in c["volumeMounts"] if m["mountPath"] == k.relay.dir}  # noqa
  assert mount(server) & mount(relay)  # the relay writes where the server reads
  vols = {v["name"] for v in sts["template"]["spec"]["volumes"]}
  assert "sglang-key" not in vols
  for (_, name), pod in cs.items():  # secrets from env, never arguments
    for ctr in pod.values():
      argv = ctr["command"] + ctr.get("args", [])
      assert not [x for x in argv if "$(" in x and ("TOKEN" in x or "KEY" in x)], name
      env = {e["name"]: e.get("valueFrom", {}) for e in ctr.get("env", [])}
      assert "SGLANG_API_KEY" not in env, name
      if any(m in argv for m in ("launch.vllm_server", "launch.weight_relay",
                                 "launch.worker")):
        assert env["VLLM_API_KEY"]["secretKeyRef"] == key_ref, (name, ctr["name"])
      if any(m in argv for m in ("launch.weight_relay", "launch.worker")):
        assert env["FR_JAX_TOKEN"]["secretKeyRef"]["name"] == k.k8s.token_secret, name

  # Workers: the pod's shell appends server (index mod vllm.nodes); run it as the kubelet
  # would, against a stub python, for every index.
  workers = by[("Job", f"{k.name}-workers")]["spec"]
  assert workers["completions"] == workers["parallelism"] == k.workers.count
  worker = cs[("Job", f"{k.name}-workers")]["worker"]
  assert worker["command"][:2] == ["/bin/sh", "-c"]
  assert worker["command"][3:] == [k.python, "-m", "launch.worker"]
  log = tmp_path / "calls"
  log.mkdir()
  run_env = dict(ENV, PATH=f"{stubs(tmp_path / 'bin')}:{os.environ['PATH']}", CALLS=str(log),
                 FR_JAX_TOKEN=TOKEN, VLLM_API_KEY=VKEY)
  for i in range(k.workers.count):
    pod_env = {"JOB_COMPLETION_INDEX": str(i)}
    argv = [kubelet_expand(x, pod_env) for x in worker["command"] + worker["args"]]
    r = subprocess.run(argv, env=dict(run_env, **pod_env), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
  got = {}
  for argv, token, key in calls(log, env=True, key_var="VLLM_API_KEY"):
    module, a = module_args(argv)
    assert module == "launch.worker" and (token, key) == (TOKEN, VKEY)
    assert TOKEN not in " ".join(argv) and VKEY not in " ".join(argv)
    assert flag_value(a, "config.rollout.engine") == "vllm"
    assert flag_value(a, "learner") == f"{learner0}:{k.learner.port}"
    got[int(flag_value(a, "worker_index"))] = flag_value(a, "config.rollout.server_url")
  assert got == {i: f"http://{k.name}-vllm-{i % k.vllm.nodes}.{k.name}-vllm.{svc}:"
                    f"{k.vllm.port}" for i in range(k.workers.count)}

  policy = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}

  def admits(target, port):
    rules = policy[f"{k.name}-{target}"]["ingress"]
    return sorted(f["podSelector"]["matchLabels"]["app"] for r in rules
                  if {"port": port} in r["ports"] for f in r["from"])

  # vLLM's weight routes do not check the key: the workers alone may reach the servers
  assert admits("vllm", k.vllm.port) == [f"{k.name}-workers"]
  assert admits("learner", k.learner.port) == [f"{k.name}-vllm", f"{k.name}-workers"]
  assert set(policy) == {f"{k.name}-learner", f"{k.name}-vllm"}


def vllm_commands(rendered_vllm, vllm_slurm_calls, module):
  """The argument lists of `module` in the vLLM Slurm run and Kubernetes file (the workers'
  shell wrapper unwrapped)."""
  got = [a for m, a in filter(None, map(module_args, vllm_slurm_calls[1])) if m == module]
  for cs in containers(k8s_docs(rendered_vllm)).values():
    for c in cs.values():
      argv = c["command"] + c.get("args", [])
      if argv[:2] == ["/bin/sh", "-c"]:
        argv = argv[3:]
      if (m := module_args(argv)) and m[0] == module:
        got.append(m[1])
  assert len(got) == 2, (module, got)  # Slurm and Kubernetes
  return got


@pytest.mark.parametrize("module", ["launch.worker", "launch.weight_relay"])
def test_vllm_our_flags_exist(rendered_vllm, vllm_slurm_calls, module):
  defined = defined_flags(module)
  for args in vllm_commands(rendered_vllm, vllm_slurm_calls, module):
    names = {n for n in flag_names(args) if not n.startswith("config.")}
    assert names <= defined, names - defined


def test_vllm_server_flags_parse(rendered_vllm, vllm_slurm_calls):
  """launch.vllm_server's absl flags (defined inside its main) parse every rendered command
  line; with .venv-vllm, vLLM's own parser takes the whole server command line it builds."""
  commands = vllm_commands(rendered_vllm, vllm_slurm_calls, "launch.vllm_server")
  code = ("import json, sys\nfrom absl import flags\nfrom launch import common, vllm_server\n"
          "def parse(argv):\n  rest = flags.FLAGS(argv)\n"
          "  f = flags.FLAGS\n  print(json.dumps(vllm_server.server_command(\n"
          "      f.model, host=f.host, port=f.port, dtype=f.dtype, python=f.python,\n"
          "      max_model_len=f.max_model_len, extra=rest[1:])))\n  sys.exit(0)\n"
          "common.parse_flags = parse\nvllm_server.main(sys.argv)\n")
  servers = []
  for args in commands:
    r = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True,
                       text=True, env=ENV, timeout=60)
    assert r.returncode == 0, r.stderr
    servers.append(json.loads(r.stdout))
  assert servers[0] == servers[1]  # Slurm and Kubernetes start the same server
  if not VLLM_PYTHON.exists():
    pytest.skip("no .venv-vllm (make vllm-tools): vLLM's own parser not checked")
  check = ("import sys\nfrom vllm.entrypoints.launchers.cli_args import make_arg_parser, "
           "validate_parsed_serve_args\nfrom vllm.utils.argparse_utils import "
           "FlexibleArgumentParser\nargs = make_arg_parser(FlexibleArgumentParser())"
           ".parse_args(sys.argv[1:])\nvalidate_parsed_serve_args(args)\n"
           "print(args.tensor_parallel_size, args.data_parallel_size, "
           "args.gpu_memory_utilization)\n")
  argv = servers[0]
  assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
  r = subprocess.run([str(VLLM_PYTHON), "-c", check, *argv[3:]], capture_output=True,
                     text=True, timeout=300, env=dict(ENV, VLLM_API_KEY=""))
  assert r.returncode == 0, r.stderr[-2000:]
  k = rendered_vllm[1]
  assert r.stdout.split()[-3:] == [str(k.vllm.tp_size),
                                   str(k.vllm.gpus_per_node // k.vllm.tp_size),
                                   str(k.vllm.gpu_memory_utilization)]


def test_vllm_ignores_the_sglang_sections(tmp_path):
  """engine=vllm checks only what its files use: a bad router or SGLang field is no error."""
  r = cli(f"--cluster={EXAMPLE}", "--target=all", f"--out={tmp_path}", "--cluster.engine=vllm",
          "--cluster.router.port=70000", "--cluster.sglang.tp_size=3",
          "--cluster.sglang_key_env=1BAD")
  assert r.returncode == 0, r.stderr
