"""POST /score/batch: whether the proxy offers it, and its wire shape (only this module knows it).

    request  {"items": [<a /score body>, ...]}
    answer   200 {"results": [{"index", "ok": true, "status": 200, "result": <ScoreResponse>}
                              | {"index", "ok": false, "status", "error": {"code", "retryable", ...}}, ...],
                  "summary": {...}}  (results in request order)

Support is probed once per client with an empty batch (a proxy that has the route answers 422):
404 without a proxy error code, or 405, means "not offered". A batch the proxy refuses as a
whole (400/404/405/413/422), or an answer of another shape, switches batching off for the
client; those episodes then go through /score.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx

from rlinf_client._base_client import ScoreRequestBody, TransportCore, parts_form, response_json

log = logging.getLogger("rlinf_client")

REFUSED_AS_A_WHOLE = frozenset({400, 404, 405, 413, 422})


class BatchSupport:
    """Whether this client uses /score/batch: decided once, switched off on the first misfit."""

    def __init__(self, mode: str) -> None:
        self.supported: bool | None = None if mode == "auto" else False
        self._lock = asyncio.Lock()

    async def available(self, core: TransportCore) -> bool:
        if self.supported is None:
            async with self._lock:
                if self.supported is None:
                    self.supported = await _probe(core)
        return bool(self.supported)

    def disable(self, why: str) -> None:
        if self.supported:
            log.warning("not using /score/batch (%s); scoring with concurrent /score calls", why)
        self.supported = False


async def _probe(core: TransportCore) -> bool | None:
    try:
        response = await core.http.post(core.cfg.batch_url, content=b'{"items":[]}',
                                        headers={"content-type": "application/json"},
                                        timeout=core.cfg.connect_timeout * 2)
    except httpx.TransportError:
        return None  # unknown: ask again next time; the /score calls report the outage
    core.stats.requests += 1
    if response.status_code == 405:
        return False
    if response.status_code == 404:
        body = response_json(response)
        return isinstance(body, dict) and isinstance(body.get("error"), dict)
    return True


def batch_body(bodies: list[ScoreRequestBody], fields: dict[str, Any] | None = None) -> tuple[str, bytes]:
    """(Content-Type, body) of POST /score/batch (or /progress/batch, whose request-wide `fields` go
    beside the items): JSON, or one binary body whose item i names its parts "i.<name>"."""
    if all(not body.parts for body in bodies):
        return "application/json", json.dumps({**(fields or {}), "items": [b.payload for b in bodies]},
                                              separators=(",", ":")).encode()
    items, parts = [], {}
    for index, body in enumerate(bodies):
        payload, named = body.named(f"{index}.")
        items.append(payload)
        parts.update(named)
    return parts_form({**(fields or {}), "items": items}, parts)


def batch_items(answer: Any, count: int) -> list[dict[str, Any]] | None:
    """The per-item results of a batch answer, or None when it is not the shape above: a list of
    `count`, each result at its item's place and saying so (`index`). A reward is never matched to
    an episode by position alone: results out of order would pay one env another's score."""
    items = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(items, list) or len(items) != count:
        return None
    if any(not isinstance(item, dict) or item.get("index") != n for n, item in enumerate(items)):
        return None
    return items
