"""What the fault tests share: the episode, the one-backend config, and the outcome check."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import libero_settings_dict
from tests.fakes.episodes import episode_frames, npy_b64
from tests.fakes.proxy_server import ProxyServerThread
from tests.helpers import HANG_S

EPISODE = {"task_text": "put the bowl on the plate", "frames_npy": npy_b64(episode_frames(4, 64, 64))}
BACKEND = "qwen2_5_vl_vllm"
# Codes an upstream fault may legitimately end in (besides a 200 with a score).
UPSTREAM_CODES = {"upstream_unavailable", "upstream_timeout", "upstream_bad_response", "unparseable_score"}


def one_backend(endpoints: list[str], media_root: Path, retry: dict[str, Any] | None = None,
                **proxy: Any) -> dict:
    """configs/libero.yaml's qwen backend alone, on `endpoints`, with the given retry policy.
    The background readiness probe runs every 0.2 s so an open circuit closes soon after a restart."""
    proxy.setdefault("health_interval_s", 0.2)
    data = copy.deepcopy(libero_settings_dict(endpoints, ["http://127.0.0.1:9/v1"], media_root, **proxy))
    del data["backends"]["PRIMO-R1"]
    data["backends"][BACKEND]["retry"].update(retry or {})
    return data


def patient(proxy: ProxyServerThread, backend: str = BACKEND) -> None:
    """From the next request on, give `backend` of the in-process proxy a per-call timeout and a
    deadline of the hang bound. A test whose short timeout is the behaviour under test (a frozen
    or hung vLLM) calls this before asking for a success, so that success never depends on how
    fast a loaded machine answers. Config models are frozen, so the backend gets a new copy."""
    entry = proxy.app.state.services.registry.backends[backend]
    retry = entry.config.retry.model_copy(update={"timeout_s": HANG_S, "deadline_s": 2 * HANG_S})
    entry.config = entry.config.model_copy(update={"retry": retry})


STATUS_OF = {"upstream_unavailable": 503, "upstream_timeout": 504, "upstream_bad_response": 502,
             "unparseable_score": 502}


def outcome(response: httpx.Response, expected_score: float = 0.75) -> str:
    """'ok' for a 200 carrying the model's score, else the error code; anything else fails."""
    body = response.json()
    if response.status_code == 200:
        assert body["score"] == expected_score, body  # the model said 75: never a silent 0
        return "ok"
    assert "score" not in body, body
    error = body["error"]
    assert error["code"] in UPSTREAM_CODES, body
    assert response.status_code == STATUS_OF[error["code"]], body
    # attempts counts calls that reached vLLM: 0 only when none did (every replica out of rotation),
    # and then the client may safely ask again
    assert error["message"] and (error["attempts"] >= 1 or error["retryable"]), body
    return error["code"]
