#!/usr/bin/env bash
# Build (or reuse) the "contract tier" virtualenv: the smallest install of vLLM 0.32.0 that can
# import, on a CPU-only machine, the code the proxy's requests are checked with:
#   vllm.entrypoints.openai.chat_completion.protocol   (ChatCompletionRequest)
#   vllm.entrypoints.generate.base.protocol            (validate_request_mm_kwargs)
#   vllm.multimodal.media                              (MediaConnector, ImageMediaIO, VideoMediaIO)
#   vllm.renderers.chat_utils / vllm.renderers.params  (message parsing, media_io_kwargs merge)
#   vllm.entrypoints.serve.exception_handling.error_response (the server's error bodies)
# tests/contract/vllm_oracle.py runs with this venv's python.
#
# vllm is installed with --no-deps; only the packages those imports need are added, resolved
# under vllm's own version pins (read from the installed vllm's metadata). torchvision,
# torchaudio and torchcodec break the import on a CPU torch and are kept out.
#
# Environment:
#   VLM_CONTRACT_VENV         venv path (default ~/.cache/vlm-reward-proxy/contract-venv-vllm0.32.0)
#   VLM_CONTRACT_BASE_PYTHON  interpreter to create the venv with (default python3; needs >= 3.11)
#   VLM_CONTRACT_TORCH_INDEX  optional index URL for torch, e.g. https://download.pytorch.org/whl/cpu
#                             (PyPI's default Linux torch is the CUDA build: it works on CPU but
#                             pulls ~3 GB of nvidia-* wheels)
#   VLM_CONTRACT_REBUILD=1    rebuild even if the marker says the venv is complete
#
# Idempotent. The LAST stdout line is the venv's python path, so callers can do
#   export VLM_CONTRACT_PYTHON="$(scripts/contract_env.sh | tail -n1)"
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
# Found by trial (import, read the ModuleNotFoundError, add); their own dependencies come with them.
PACKAGES=(
  "torch==${TORCH_VERSION}"
  numpy packaging regex pydantic openai transformers fastapi
  aiohttp requests urllib3 pillow pybase64 cbor2 psutil pyzmq
  oss-harmony cachetools prometheus_client msgspec cloudpickle uvloop py-cpuinfo
)
EXCLUDED=(torchvision torchaudio torchcodec)
ENV_ID="vllm==${VLLM_VERSION} torch==${TORCH_VERSION} pkgs=${PACKAGES[*]} layout=1"

VENV="${VLM_CONTRACT_VENV:-$HOME/.cache/vlm-reward-proxy/contract-venv-vllm${VLLM_VERSION}}"
BASE_PYTHON="${VLM_CONTRACT_BASE_PYTHON:-python3}"
MARKER="$VENV/.vlm-contract-env"
PY="$VENV/bin/python"

log() { echo "[contract_env] $*" >&2; }
die() { echo "[contract_env] ERROR: $*" >&2; exit 1; }
trap 'rc=$?; if [ $rc -ne 0 ]; then echo "[contract_env] FAILED (exit $rc): contract venv $VENV is NOT ready (no completion marker; the next run rebuilds it)." >&2; fi' EXIT

IMPORT_CHECK='
import time; t = time.perf_counter()
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.generate.base.protocol import validate_request_mm_kwargs
from vllm.multimodal.media import ImageMediaIO, MediaConnector, VideoMediaIO
from vllm.multimodal.media.connector import merge_media_io_kwargs
from vllm.renderers import chat_utils
from vllm.renderers.params import ChatParams, merge_kwargs
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
import importlib.util, vllm, torch
bad = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
assert not bad, f"must be absent: {bad}"
assert vllm.__version__ == "'"$VLLM_VERSION"'", vllm.__version__
assert torch.__version__.split("+")[0] == "'"$TORCH_VERSION"'", torch.__version__
print(f"import ok in {time.perf_counter() - t:.1f}s (vllm {vllm.__version__}, torch {torch.__version__})")
'

if [ "${VLM_CONTRACT_REBUILD:-0}" != "1" ] && [ -x "$PY" ] && [ -f "$MARKER" ] \
   && [ "$(cat "$MARKER")" = "$ENV_ID" ]; then
  log "reusing complete contract venv at $VENV ($(du -sh "$VENV" | cut -f1))"
  echo "$PY"
  exit 0
fi

command -v "$BASE_PYTHON" >/dev/null 2>&1 || die "base interpreter '$BASE_PYTHON' not found (set VLM_CONTRACT_BASE_PYTHON)"
"$BASE_PYTHON" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 15) else 1)' \
  || die "vllm ${VLLM_VERSION} needs Python >=3.11,<3.15; '$BASE_PYTHON' is $("$BASE_PYTHON" -V 2>&1)"

START=$(date +%s)
if [ -e "$VENV" ]; then
  # Only ever delete something that is clearly a venv we made (or an empty dir).
  if [ -f "$VENV/pyvenv.cfg" ] || [ -z "$(ls -A "$VENV" 2>/dev/null)" ]; then
    log "removing incomplete or outdated venv at $VENV"
    rm -rf "$VENV"
  else
    die "$VENV exists and is not a virtualenv; refusing to delete it (set VLM_CONTRACT_VENV)"
  fi
fi
mkdir -p "$(dirname "$VENV")"
log "creating venv at $VENV with $("$BASE_PYTHON" -V 2>&1)"
"$BASE_PYTHON" -m venv "$VENV" || die "python -m venv failed"

export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_() { "$PY" -m pip "$@"; }

log "step 1/4: vllm==${VLLM_VERSION} without dependencies (PyPI wheel, ~330 MB)"
pip_ install --quiet --no-deps "vllm==${VLLM_VERSION}" || die "could not install vllm==${VLLM_VERSION}"

# vllm's own version pins, minus the packages we keep out and minus extras.
CONSTRAINTS="$VENV/vllm-constraints.txt"
"$PY" - "$CONSTRAINTS" "${EXCLUDED[@]}" <<'EOF' || die "could not read vllm's requirements"
import re, sys
from importlib.metadata import requires
out, excluded = sys.argv[1], set(sys.argv[2:])
lines = []
for req in requires("vllm") or []:
    if "extra ==" in req:
        continue
    name = re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0]
    if name.lower() in excluded:
        continue
    lines.append(re.sub(r"\[[^\]]*\]", "", req))
open(out, "w").write("\n".join(lines) + "\n")
EOF

if [ -n "${VLM_CONTRACT_TORCH_INDEX:-}" ]; then
  log "step 2/4: torch==${TORCH_VERSION} from $VLM_CONTRACT_TORCH_INDEX"
  pip_ install --quiet --index-url "$VLM_CONTRACT_TORCH_INDEX" "torch==${TORCH_VERSION}" \
    || die "could not install torch==${TORCH_VERSION} from $VLM_CONTRACT_TORCH_INDEX"
else
  log "step 2/4: (torch comes with the packages below; set VLM_CONTRACT_TORCH_INDEX for a CPU-only wheel)"
fi

log "step 3/4: the packages the imports need: ${PACKAGES[*]}"
# pip warns that vllm's other requirements are missing: that is the point of --no-deps.
if ! pip_ install --quiet -c "$CONSTRAINTS" "${PACKAGES[@]}" 2>"$VENV/pip-install.log"; then
  cat "$VENV/pip-install.log" >&2
  die "pip install of the contract packages failed"
fi
grep -v -e "requires .*, which is not installed" -e "dependency resolver does not currently" \
     -e "^WARNING: Location .* is ignored" "$VENV/pip-install.log" >&2 || true

for pkg in "${EXCLUDED[@]}"; do
  if pip_ show "$pkg" >/dev/null 2>&1; then
    log "removing $pkg (breaks the vllm import on a CPU torch)"
    pip_ uninstall --quiet -y "$pkg"
  fi
done

log "step 4/4: import check"
IMPORT_MSG=$("$PY" -c "$IMPORT_CHECK" 2>"$VENV/import-check.log") || {
  tail -n 30 "$VENV/import-check.log" >&2
  die "the contract venv cannot import vLLM's request/media code (see above)"
}

echo "$ENV_ID" > "$MARKER"
ELAPSED=$(( $(date +%s) - START ))
SIZE=$(du -sh "$VENV" | cut -f1)
echo "contract venv ready: $VENV"
echo "install size: $SIZE"
echo "install time: ${ELAPSED}s"
echo "$IMPORT_MSG"
echo "$PY"
