#!/usr/bin/env bash
# Serve PRIMO-R1-7B with stock `vllm serve` for the VLM reward proxy (initial-state image, video,
# current-state image per request). `serve_primo_r1.sh --help` lists every option; e.g. on GPU 2:
#   PRIMO_R1_MODEL_PATH=/models/PRIMO-R1-7B launchers/serve_primo_r1.sh --gpus 2 --port 8002
set -euo pipefail
SCRIPT_NAME=$(basename "$0")
MODEL_LABEL="PRIMO-R1-7B (proxy backend PRIMO-R1, layout primo_interleave)"
MODEL_PATH_ENV=PRIMO_R1_MODEL_PATH
DEFAULT_SERVED_NAME=PRIMO-R1-7B
DEFAULT_PORT=8002
DEFAULT_LIMIT_MM='{"image": 2, "video": 1}'
LAYOUT_NOTE="two images and one video per request"
# shellcheck source=launchers/_serve_vllm.sh
source "$(dirname "${BASH_SOURCE[0]}")/_serve_vllm.sh"
serve_vllm "$@"
