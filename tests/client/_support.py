"""Stand-ins for the RLinf tests: an in-process fake proxy (httpx.MockTransport) and frames
whose pixels say which env and step they come from."""

from __future__ import annotations

import base64
import io
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from vlm_protocol.multipart import PART_PREFIX, decode_form, is_form


def tagged_frames(env: int, steps: range, size: int = 32) -> np.ndarray:
    """uint8 T×H×W×3; pixel (0, 0) holds (env, step % 256, step // 256)."""
    frames = np.full((len(steps), size, size, 3), 90, dtype=np.uint8)
    for i, step in enumerate(steps):
        frames[i, 0, 0] = (env, step % 256, step // 256)
    return frames


def frame_tag(frame: np.ndarray) -> tuple[int, int]:
    """(env, step) of a tagged frame."""
    return int(frame[0, 0, 0]), int(frame[0, 0, 1]) + 256 * int(frame[0, 0, 2])


def decode_npy(data: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)


def score_body(score: float, **extra: Any) -> dict[str, Any]:
    return {"score": score, "raw_score": score * 100, "backend": "fake", "model": "fake",
            "output_text": f"<score>{score * 100:g}</score>", **extra}


def read_body(request: httpx.Request) -> dict:
    """The JSON request; from a binary body (transport: binary), with each "part:<name>" frames
    field given back as the base64 of its part, as the inline transport would have sent it."""
    if not request.content:
        return {}
    if not is_form(request.headers.get("content-type", "")):
        return json.loads(request.content)
    raw, parts = decode_form(request.content, request.headers["content-type"], max_parts=10_000)
    body = json.loads(raw)

    def inline(item: dict) -> dict:
        ref = item.get("frames_npy")
        if isinstance(ref, str) and ref.startswith(PART_PREFIX):
            item = {**item, "frames_npy": base64.b64encode(parts[ref[len(PART_PREFIX):]]).decode()}
        if isinstance(item.get("extra_view"), dict):  # a second camera: a frames source of its own
            item = {**item, "extra_view": inline(item["extra_view"])}
        return item

    return {"items": [inline(i) for i in body["items"]]} if "items" in body else inline(body)


@dataclass
class FakeProxy:
    """POST /score answered in process. `score_fn(request_json, frames)` gives the score;
    `script` holds responses (or exceptions) to use first, one per request."""

    score_fn: Callable[[dict, np.ndarray | None], float | httpx.Response] = lambda body, frames: 0.5
    script: list[Any] = field(default_factory=list)
    batch: bool = False  # offer POST /score/batch
    # GET /frame-rules' answer; None: 404, a proxy older than the route (its scripted answers are
    # for the scoring calls, never used up by it)
    frame_rules: dict | None = None
    frame_rules_asked: int = 0  # GET /frame-rules calls (not in `requests`, which are the scoring calls)
    requests: list[tuple[str, dict]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path == "/frame-rules":
            with self.lock:
                self.frame_rules_asked += 1
            return httpx.Response(200, json=self.frame_rules) if self.frame_rules is not None else \
                httpx.Response(404, json={"detail": "Not Found"})
        body = read_body(request)
        with self.lock:
            self.requests.append((request.url.path, body))
            action = self.script.pop(0) if self.script else None
        if isinstance(action, Exception):
            raise action
        if isinstance(action, httpx.Response):  # None: answer normally
            return action
        if request.url.path == "/score/batch":
            if not self.batch:
                return httpx.Response(404, json={"detail": "Not Found"})
            if not body.get("items"):
                return httpx.Response(422, json={"error": {"code": "invalid_request",
                                                           "message": "items: too short"}})
            results = [{"index": i, "ok": True, "status": 200, "result": self._score(item)}
                       for i, item in enumerate(body["items"])]
            return httpx.Response(200, json={"results": results})
        answer = self._score(body)
        return answer if isinstance(answer, httpx.Response) else httpx.Response(200, json=answer)

    def _score(self, body: dict) -> dict | httpx.Response:
        frames = decode_npy(body["frames_npy"]) if "frames_npy" in body else None
        answer = self.score_fn(body, frames)
        return answer if isinstance(answer, httpx.Response) else score_body(float(answer))

    @property
    def score_requests(self) -> list[dict]:
        return [body for path, body in self.requests if path == "/score"]


def error_response(status: int, code: str, message: str = "failed", retry_after: str | None = None,
                   **extra: Any) -> httpx.Response:
    headers = {"retry-after": retry_after} if retry_after is not None else {}
    return httpx.Response(status, headers=headers,
                          json={"error": {"code": code, "message": message, **extra}})
