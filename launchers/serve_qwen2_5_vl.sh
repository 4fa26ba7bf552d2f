#!/usr/bin/env bash
# Serve Qwen2.5-VL-7B-Instruct with stock `vllm serve` for the VLM reward proxy (one video per
# request). `serve_qwen2_5_vl.sh --help` lists every option; e.g. on GPUs 0,1 with TP=2:
#   QWEN2_5_VL_MODEL_PATH=/models/Qwen2.5-VL-7B-Instruct launchers/serve_qwen2_5_vl.sh --gpus 0,1
set -euo pipefail
SCRIPT_NAME=$(basename "$0")
MODEL_LABEL="Qwen2.5-VL-7B-Instruct (proxy backend qwen2_5_vl_vllm, layout qwen_video)"
MODEL_PATH_ENV=QWEN2_5_VL_MODEL_PATH
DEFAULT_SERVED_NAME=Qwen2.5-VL-7B-Instruct
DEFAULT_PORT=8001
DEFAULT_LIMIT_MM='{"video": 1}'
LAYOUT_NOTE="one video per request"
# shellcheck source=launchers/_serve_vllm.sh
source "$(dirname "${BASH_SOURCE[0]}")/_serve_vllm.sh"
serve_vllm "$@"
