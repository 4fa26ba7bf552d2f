"""An in-process /progress/batch (httpx.MockTransport) for the client's and the hook's progress tests.

Each item's answer comes from `rate(item, frames, tasks_with_a_reference)`: by default a success is
`success`, a failure of a task with a reference is `progress` with the failure's value from
`progress_of`, and a failure of a task without one is `no_reference` (docs/progress.md). A task
has a reference when it has a success in the request or, with `remember` (the proxy's reference
store), in an earlier one. `script` holds whole responses (or exceptions) to use first, one per
request."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from tests.client._support import decode_npy, frame_tag, read_body
from vlm_protocol.multipart import decode_form, is_form
from vlm_protocol.progress import task_key


def read_request(request: httpx.Request) -> dict:
    """The JSON request with its items' frames inline (read_body), its request-wide fields kept."""
    body = read_body(request)
    content_type = request.headers.get("content-type", "")
    if is_form(content_type):
        raw, _ = decode_form(request.content, content_type, max_parts=10_000)
        body = {**json.loads(raw), "items": body["items"]}
    return body


def result(item: dict, outcome: str, progress: float | None) -> dict[str, Any]:
    meta = item["metadata"]
    return {"index": None, "ok": True, "status": 200,
            "result": {"task_id": meta["task_id"], "env_success": meta["env_success"], "outcome": outcome,
                       "progress": progress, "distance": None, "normalised_distance": None,
                       "reference": {"batch_successes": 0, "stored": 0, "centres": 1, "failures": 0},
                       "embedding": {"model": "fake-embed", "dim": 3}}}


def item_error(status: int, code: str, message: str = "failed") -> dict[str, Any]:
    return {"index": None, "ok": False, "status": status, "error": {"code": code, "message": message}}


def by_env_progress(item: dict, frames: np.ndarray | None) -> float:
    """A failure's progress: its env index / 10 (frames are tagged with their env)."""
    return frame_tag(frames[-1])[0] / 10


@dataclass
class FakeProgressProxy:
    progress_of: Callable[[dict, np.ndarray | None], float] = by_env_progress
    rate: Callable[[dict, np.ndarray | None, set], dict] | None = None  # overrides the default answer
    script: list[Any] = field(default_factory=list)
    remember: bool = False
    remembered: set = field(default_factory=set)  # task ids with a success in an earlier request
    requests: list[tuple[str, dict]] = field(default_factory=list)
    content_types: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = read_request(request)
        with self.lock:
            self.requests.append((request.url.path, body))
            self.content_types.append(request.headers.get("content-type", ""))
            action = self.script.pop(0) if self.script else None
        if isinstance(action, Exception):
            raise action
        if isinstance(action, httpx.Response):
            return action
        if request.url.path != "/progress/batch":
            return httpx.Response(404, json={"error": {"code": "not_found", "message": request.url.path}})
        items = body["items"]
        with_success = {task_key(i["metadata"]["task_id"]) for i in items if i["metadata"]["env_success"]}
        with_success |= self.remembered
        results = []
        for index, item in enumerate(items):
            frames = decode_npy(item["frames_npy"]) if "frames_npy" in item else None
            answer = self.rate(item, frames, with_success) if self.rate else self._default(item, frames, with_success)
            results.append({**answer, "index": index})
            if self.remember and answer["ok"] and answer["result"]["outcome"] == "success":
                self.remembered.add(task_key(item["metadata"]["task_id"]))
        return httpx.Response(200, json={"results": results, "summary": {}, "method": {}})

    def _default(self, item: dict, frames: np.ndarray | None, with_success: set) -> dict:
        meta = item["metadata"]
        if meta["env_success"]:
            return result(item, "success", 1.0)
        if task_key(meta["task_id"]) not in with_success:  # grouped as the proxy groups them
            return result(item, "no_reference", None)
        return result(item, "progress", self.progress_of(item, frames))

    @property
    def batches(self) -> list[dict]:
        return [body for path, body in self.requests if path == "/progress/batch"]
