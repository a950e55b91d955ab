"""An example cluster: the Qwen2.5-Math-1.5B recipe on a 2-node learner and a 2-node SGLang
fleet (Slurm or Kubernetes), or on a v5p-16 TPU VM for the learner.

  python -m launch.cluster --cluster=launch/cluster/example.py --target=all --out=build/cluster
  python -m launch.cluster --cluster=launch/cluster/example.py --target=slurm --out=DIR \\
      --cluster.learner.nodes=4 --cluster.learner.mesh_data=4
  # a vLLM fleet instead (launch.vllm_server on each node; no router)
  python -m launch.cluster --cluster=launch/cluster/example.py --target=all --out=DIR \\
      --cluster.engine=vllm

Hardware: 8 learner GPUs (2 nodes x 4) and 16 SGLang (or vLLM) GPUs (2 nodes x 8) plus one
CPU node for the router (SGLang only) and 8 rollout workers; or a v5p-16 (2 hosts, 8 chips)
for the learner. Time: rendering takes a few seconds; the run takes what the recipe says
(experiments/configs/qwen25_math_1p5b.py).

Every path is the same on every host: `workdir` holds this repository (and the run config,
relative to it), `checkpoint` an HF checkpoint directory (on local disk or in the image). Only
the learner hosts share `run_dir` (each learner process writes its part of a checkpoint).
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.name = "fr-math"  # job name; Kubernetes objects are named NAME-learner, NAME-sglang, ...
  c.run_config = "experiments/configs/qwen25_math_1p5b.py"  # relative to workdir
  c.run_dir = "/shared/runs/fr-math"  # shared by the learner hosts only
  c.checkpoint = "/ckpt/Qwen2.5-Math-1.5B"  # HF checkpoint dir: SGLang's --model-path too
  c.workdir = "/opt/fr_jax"  # this repository on every host (the image's copy on Kubernetes)
  c.python = "python"  # interpreter with fr_jax's requirements (and sglang-router)
  c.image = "registry.example.com/fr_jax:latest"  # Kubernetes: fr_jax + sglang-router
  # The rollout fleet (Slurm, Kubernetes): "sglang" (the `sglang` and `router` sections) or
  # "vllm" (the `vllm` section: no router, worker i generates on server i mod vllm.nodes).
  c.engine = "sglang"
  # The shared gRPC token: read from this environment variable (Slurm, TPU VM) or the Secret
  # k8s.token_secret (key "token"); never written into a rendered file.
  c.token_env = "FR_JAX_TOKEN"
  # The SGLang servers' API key (their --api-key; the router, the relays and the workers
  # present it): read from this environment variable (Slurm) or the Secret
  # k8s.sglang_key_secret; never on a command line or in a rendered file.
  c.sglang_key_env = "SGLANG_API_KEY"
  # The vLLM servers' API key (engine="vllm"): from this environment variable (Slurm) or the
  # Secret k8s.vllm_key_secret; launch.vllm_server, the relays and the workers read it as
  # $VLLM_API_KEY. vLLM 0.32 checks it on generation only (/v1, /inference): its weight routes
  # answer anyone who reaches vllm.port (BUILD.md, "Cluster launch templates").
  c.vllm_key_env = "VLLM_API_KEY"
  # Mutual TLS for gRPC (learner <-> workers and relays): a folder on every host (a Secret
  # mounted there on Kubernetes) holding ca.pem, server.pem, server.key (the learner's, for
  # the name the others dial) and client.pem, client.key. Empty: the token alone, in clear
  # text: keep the network private.
  c.tls = ml_collections.ConfigDict(dict(dir=""))
  c.learner = ml_collections.ConfigDict(dict(
      nodes=2,
      devices_per_node=4,
      port=50051,  # gRPC, served by process 0
      coordinator_port=1234,  # jax.distributed on Kubernetes (Slurm and TPU VM pick their own)
      mesh_data=2,  # --config.mesh.data; data * fsdp == nodes * devices_per_node
      mesh_fsdp=4,
  ))
  c.sglang = ml_collections.ConfigDict(dict(
      nodes=2,  # one server (and one weight relay) per node
      gpus_per_node=8,
      tp_size=1,  # tensor parallel; the server runs gpus_per_node / tp_size data-parallel copies
      port=30000,
      mem_fraction_static=0.8,
      python="python",  # interpreter with sglang installed (Slurm)
      extra_args=("--context-length=8192",),  # more sglang.launch_server arguments
  ))
  c.vllm = ml_collections.ConfigDict(dict(
      nodes=2,  # one launch.vllm_server (and one weight relay) per node
      gpus_per_node=8,
      tp_size=1,  # --tensor-parallel-size; --data-parallel-size is gpus_per_node / tp_size
      port=30000,
      dtype="bfloat16",  # launch.vllm_server --dtype: bfloat16 or float32
      max_model_len=8192,  # prompt + completion; at least the run config's agent.max_total_tokens
      gpu_memory_utilization=0.85,  # vLLM's share of each GPU's memory (weights + KV cache)
      # the vLLM environment's interpreter, absolute or relative to workdir: vLLM for the
      # nodes' GPUs (`make vllm-tools` builds .venv-vllm with the CPU build)
      python=".venv-vllm/bin/python",
      extra_args=(),  # more vLLM arguments (after launch.vllm_server's `--`)
  ))
  c.router = ml_collections.ConfigDict(dict(  # engine="sglang" only
      port=8000,
      startup_timeout_s=1800,  # how long the router waits for the servers to load the model
  ))
  c.workers = ml_collections.ConfigDict(dict(
      count=8,  # rollout worker processes: prompt shards 0..count-1
      nodes=1,  # Slurm: CPU nodes for the router and the workers
      cpus=4,  # per worker (and for the SGLang router)
  ))
  c.relay = ml_collections.ConfigDict(dict(
      # local disk beside each server: the weights it loads (Slurm: a private
      # folder named after this one plus a random suffix, made with mktemp -d for each job
      # and removed at the end)
      dir="/tmp/fr_jax_relay",
  ))
  c.slurm = ml_collections.ConfigDict(dict(
      partition="",  # empty: the cluster's default
      account="",
      time="24:00:00",
      gpu_directive="gpus-per-node",  # or "gres" (--gres=gpu:N) on older clusters
      output="slurm-%j.out",
  ))
  c.k8s = ml_collections.ConfigDict(dict(
      namespace="default",
      sglang_image="lmsysorg/sglang:latest",  # pin the tag you tested
      gpu_resource="nvidia.com/gpu",
      token_secret="fr-jax-token",  # a Secret with key "token" (see BUILD.md)
      # a Secret with keys "key" (the API key) and "sglang.yaml" ("api-key: <the key>", the
      # servers' --config file)
      sglang_key_secret="fr-jax-sglang",
      # engine="vllm": the image that runs launch.vllm_server: this repository at workdir with
      # fr_jax's requirements (python) and vLLM's environment at vllm.python
      vllm_image="registry.example.com/fr_jax-vllm:latest",
      vllm_key_secret="fr-jax-vllm",  # a Secret with key "key" (the vLLM servers' API key)
      tls_secret="",  # with tls.dir: a Secret holding the TLS files, mounted at tls.dir
      # ReadWriteMany claim mounted at run_dir (every learner pod writes its checkpoint
      # shards there, and the admission log must outlive pod 0); required with > 1 pod
      run_dir_pvc="fr-math-runs",
      checkpoint_pvc="",  # claim holding the checkpoint, mounted read-only; empty: in the image
  ))
  c.tpu = ml_collections.ConfigDict(dict(
      name="fr-learner",
      zone="us-east5-a",
      accelerator_type="v5p-16",  # 8 chips on 2 hosts
      runtime_version="v2-alpha-tpuv5",
      mesh_data=2,  # data * fsdp == the slice's JAX devices
      mesh_fsdp=4,
  ))
  return c
