"""Run vLLM's own request/media code on requests the proxy built (the "contract tier").

Imported by tests in the MAIN environment: no vllm import here. The checks run in a separate
interpreter, the contract venv built by ``scripts/contract_env.sh``::

    export VLM_CONTRACT_PYTHON="$(scripts/contract_env.sh | tail -n1)"

Tests skip when ``VLM_CONTRACT_PYTHON`` is unset, and fail instead when ``VLM_REQUIRE_CONTRACT=1``.
Each oracle start costs several seconds (torch + vllm imports): batch requests into one
``run_oracle`` call (e.g. from a module-scoped fixture). The report format is documented at the
top of ``vllm_oracle.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ORACLE_SCRIPT = Path(__file__).resolve().with_name("vllm_oracle.py")
ENV_PYTHON = "VLM_CONTRACT_PYTHON"
ENV_REQUIRE = "VLM_REQUIRE_CONTRACT"

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


def contract_python() -> str:
    """Path of the contract venv's python; skips (or fails under VLM_REQUIRE_CONTRACT=1) if unset."""
    path = os.environ.get(ENV_PYTHON, "").strip()
    required = os.environ.get(ENV_REQUIRE, "") == "1"
    if not path:
        msg = (f"{ENV_PYTHON} is not set: the vLLM contract checks need the contract venv; build it "
               f'with `export {ENV_PYTHON}="$(scripts/contract_env.sh | tail -n1)"`')
        if required:
            pytest.fail(f"{ENV_REQUIRE}=1 but {msg}", pytrace=False)
        pytest.skip(msg)
    if not (Path(path).is_file() and os.access(path, os.X_OK)):
        # Set but broken is a misconfiguration, never a silent skip.
        pytest.fail(f"{ENV_PYTHON}={path!r} is not an executable file; rerun scripts/contract_env.sh",
                    pytrace=False)
    return path


def payload(request: dict[str, Any], server: dict[str, Any] | None = None) -> dict[str, Any]:
    """One oracle input: the exact JSON body sent, plus how the server was started."""
    return {"request": request, "server": dict(LAUNCHER_SERVER if server is None else server)}


def run_oracle(payloads: list[dict[str, Any]], *, timeout: float = 600.0) -> list[dict[str, Any]]:
    """Check a batch of ``{"request": ..., "server": ...}`` documents in ONE oracle process."""
    python = contract_python()
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
