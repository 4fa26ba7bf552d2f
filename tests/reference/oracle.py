"""The reference tier: the proxy's work checked by the reference implementations themselves —
vLLM 0.32's own request/media code (vllm_oracle.py) and qwen-vl-utils' frame rules
(qwen_vl_utils_oracle.py).

Imported by tests in the MAIN environment: no vllm or torch import here. The checks run in the
reference venv built by ``scripts/reference_env.sh`` (its last line is its `vllm`; python is beside it)::

    export VLM_REFERENCE_PYTHON="$(dirname "$(scripts/reference_env.sh | tail -n1)")/python"

Tests skip when ``VLM_REFERENCE_PYTHON`` is unset, and fail instead when ``VLM_REQUIRE_REFERENCE=1``
(`make test` and .ci/run set both). Each oracle start costs seconds (torch + vllm imports): batch
requests into one call (e.g. from a module-scoped fixture). The report formats are documented at
the top of each oracle script.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ORACLE_SCRIPT = Path(__file__).resolve().with_name("vllm_oracle.py")
QWEN_VL_UTILS_SCRIPT = Path(__file__).resolve().with_name("qwen_vl_utils_oracle.py")
ENV_PYTHON = "VLM_REFERENCE_PYTHON"
ENV_REQUIRE = "VLM_REQUIRE_REFERENCE"

# `server` blocks for the two deployments that matter.
# What our launchers start: trusted per-request kwargs, keep-all-frames safety net.
LAUNCHER_SERVER: dict[str, Any] = {
    "trust_request_mm_kwargs": True,
    "media_io_kwargs": {"video": {"num_frames": -1}},
    "limit_mm_per_prompt": {"image": 2, "video": 1},
}
# A stock `vllm serve MODEL` started by hand: per-request mm kwargs are refused (400).
STOCK_SERVER: dict[str, Any] = {"trust_request_mm_kwargs": False}


def launcher_server(limit_mm_per_prompt: dict[str, int] | None = None) -> dict[str, Any]:
    """LAUNCHER_SERVER with one launcher's ``--limit-mm-per-prompt`` (Qwen's is ``{"video": 1}``)."""
    server = json.loads(json.dumps(LAUNCHER_SERVER))
    if limit_mm_per_prompt is not None:
        server["limit_mm_per_prompt"] = dict(limit_mm_per_prompt)
    return server


def reference_python() -> str:
    """Path of the reference venv's python; skips (or fails under VLM_REQUIRE_REFERENCE=1) if unset."""
    path = os.environ.get(ENV_PYTHON, "").strip()
    required = os.environ.get(ENV_REQUIRE, "") == "1"
    if not path:
        msg = (f"{ENV_PYTHON} is not set: the reference checks need the reference venv; build it with "
               f'`export {ENV_PYTHON}="$(dirname "$(scripts/reference_env.sh | tail -n1)")/python"`')
        if required:
            pytest.fail(f"{ENV_REQUIRE}=1 but {msg}", pytrace=False)
        pytest.skip(msg)
    if not (Path(path).is_file() and os.access(path, os.X_OK)):
        # Set but broken is a misconfiguration, never a silent skip.
        pytest.fail(f"{ENV_PYTHON}={path!r} is not an executable file; rerun scripts/reference_env.sh",
                    pytrace=False)
    return path


def payload(request: dict[str, Any], server: dict[str, Any] | None = None) -> dict[str, Any]:
    """One oracle input: the exact JSON body sent, plus how the server was started."""
    return {"request": request, "server": dict(LAUNCHER_SERVER if server is None else server)}


def run_oracle(payloads: list[dict[str, Any]], *, timeout: float = 600.0) -> list[dict[str, Any]]:
    """Check a batch of ``{"request": ..., "server": ...}`` documents in ONE oracle process."""
    python = reference_python()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.setdefault("OMP_NUM_THREADS", "1")  # decoding is PIL/numpy; keep torch from grabbing all cores
    env["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    proc = subprocess.run(
        [python, str(ORACLE_SCRIPT)], input=json.dumps(list(payloads)), capture_output=True,
        text=True, timeout=timeout, env=env, cwd=ORACLE_SCRIPT.parent, check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"vllm_oracle.py exited {proc.returncode}; stderr tail:\n{proc.stderr[-4000:]}")
    try:
        reports = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise RuntimeError(f"vllm_oracle.py wrote no JSON ({exc}); stdout head: {proc.stdout[:500]!r}; "
                           f"stderr tail:\n{proc.stderr[-2000:]}") from exc
    if not isinstance(reports, list) or len(reports) != len(payloads):
        raise RuntimeError(f"vllm_oracle.py answered {type(reports).__name__} for {len(payloads)} payloads")
    broken = [r["oracle_error"] for r in reports if "oracle_error" in r]
    if broken:
        raise RuntimeError(f"vllm_oracle.py failed on {len(broken)} payload(s): {broken[:3]}; "
                           f"stderr tail:\n{proc.stderr[-3000:]}")
    return reports


def video_parts(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every video_url part of a report, in message order."""
    return [p for m in report["messages"] for p in m["parts"] if p["type"] == "video_url"]


def only_video(report: dict[str, Any]) -> dict[str, Any]:
    """The decoded video of a report that must hold exactly one video part, decoded without error."""
    parts = video_parts(report)
    assert len(parts) == 1, parts
    assert "error" not in parts[0], parts[0]
    return parts[0]["video"]


def image_parts(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for m in report["messages"] for p in m["parts"] if p["type"] == "image_url"]


def run_qwen_vl_utils(request: dict[str, Any], *, timeout: float = 600.0) -> dict[str, Any]:
    """qwen-vl-utils' answers for a batch of smart_resize and video cases (qwen_vl_utils_oracle.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([reference_python(), str(QWEN_VL_UTILS_SCRIPT)], input=json.dumps(request),
                          capture_output=True, text=True, timeout=timeout, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"qwen_vl_utils_oracle.py exited {proc.returncode}; stderr tail:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)
