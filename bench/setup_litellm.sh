#!/usr/bin/env bash
# Create a separate venv with LiteLLM's proxy for bench/bench_proxy_overhead.py.
# LiteLLM is a benchmark comparison only: it is never installed into the project's .venv.
#   bash bench/setup_litellm.sh            # -> ~/.cache/vlm-reward-proxy/litellm-venv
#   LITELLM_VENV=/some/dir bash bench/setup_litellm.sh
set -euo pipefail
VENV="${LITELLM_VENV:-$HOME/.cache/vlm-reward-proxy/litellm-venv}"
PY="${PYTHON:-python3.11}"
if [ ! -x "$VENV/bin/litellm" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet "litellm[proxy]"
fi
"$VENV/bin/python" -c "import importlib.metadata as m; print('litellm', m.version('litellm'))"
echo "$VENV/bin/litellm"
