# Two commands for a newcomer:  `make serve` (install + run the proxy)  and  `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/libero.yaml
# qwen-vl-utils needs torch + torchvision built for each other: take both from the package index,
# never a lone local CPU torch wheel (its torchvision would not import).
ORACLE_PIP_ENV := PIP_FIND_LINKS=

.PHONY: install serve oracle contract-env test test-fast lint bench demo clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[server,test]'
	touch $@

install: $(VENV)/.installed

serve: install  ## install, then run the proxy on $(CONFIG)
	$(VENV)/bin/vlm-reward-proxy serve --config $(CONFIG)

$(VENV)/.oracle: $(VENV)/.installed
	$(ORACLE_PIP_ENV) $(PY) -m pip install -q -e '.[server,test,oracle]'
	touch $@

oracle: $(VENV)/.oracle  ## the parity oracle (qwen-vl-utils, torch, torchvision: several GB)

contract-env:  ## vLLM 0.32.0's own request model and media decoders, in a venv outside the repo
	@if [ -x scripts/contract_env.sh ]; then bash scripts/contract_env.sh; fi

test: install oracle  ## every tier: unit, integration, parity oracle, vLLM contract
	@set -euo pipefail; \
	if [ -x scripts/contract_env.sh ]; then \
	  export VLM_CONTRACT_PYTHON="$$(bash scripts/contract_env.sh | tail -n 1)"; \
	fi; \
	$(PY) -m pytest

test-fast: install  ## unit + integration only (skips tiers whose environments are missing)
	$(PY) -m pytest -m "not oracle and not contract"

lint: install
	$(VENV)/bin/ruff check proxy rlinf_client tests bench

bench: install
	$(PY) bench/bench_media.py

demo: install  ## no GPU: fake vLLM servers + the real proxy score a synthetic episode
	$(PY) scripts/demo.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis bench/results
