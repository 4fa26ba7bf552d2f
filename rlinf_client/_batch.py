"""POST /score/batch, used when the proxy offers it; concurrent POST /score is the baseline.

The wire shape (proxy/schemas.py BatchScoreRequest; only this module knows it):
    request  {"items": [<a /score body>, ...]}
    answer   200 {"results": [{"index", "ok": true, "status": 200, "result": <ScoreResponse>}
                              | {"index", "ok": false, "status", "error": {"code", ...}}, ...],
                  "summary": {...}}  (results in request order)
Support is probed once per client with an empty batch (a proxy that has the route answers 422):
404 without a proxy error code, or 405, means "not offered". A batch the proxy refuses as a
whole (400/404/405/413/422), or an answer of another shape, switches batching off for the
client and those episodes go through /score. Items that fail with 429/503 are retried alone.
Either way the retry keeps the batch's deadline: an episode never takes more than `timeout`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING

import httpx

from rlinf_client import _constants as C
from rlinf_client._base_client import (
    ScoreRequestBody,
    TransportCore,
    build_request_body_async,
    parse_score_body,
    response_json,
)
from rlinf_client._exceptions import APIStatusError, FramesError, RewardAPIError, make_status_error
from rlinf_client._types import Episode, EpisodeScore

if TYPE_CHECKING:
    from rlinf_client._client import AsyncRewardClient

log = logging.getLogger("rlinf_client")

_REFUSED_AS_A_WHOLE = frozenset({400, 404, 405, 413, 422})
_STATUS_OF_CODE = {"overloaded": 429, "upstream_unavailable": 503}  # retryable item errors


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


async def score_in_batches(client: AsyncRewardClient, episodes: list[Episode]) -> list[EpisodeScore]:
    """Pack episodes into batches (by count and bytes) as their bodies are built and send the
    batches concurrently. Each episode holds one of the client's `max_concurrency` slots from
    encoding until its batch is answered, as with /score, so memory stays bounded."""
    cfg = client.config
    results: list[EpisodeScore | None] = [None] * len(episodes)
    cap = min(C.DEFAULT_MAX_BATCH_EPISODES, cfg.max_concurrency)
    sending: list[asyncio.Task] = []
    packed: list[tuple[int, ScoreRequestBody, float]] = []
    packed_bytes = 0
    deadlines: dict[int, float] = {}  # each sent episode's batch deadline, kept by its retry

    def flush() -> None:
        nonlocal packed, packed_bytes
        if packed:
            sending.append(asyncio.ensure_future(
                _send_batch(client, episodes, packed, results, deadlines)))
        packed, packed_bytes = [], 0

    try:
        for index, episode in enumerate(episodes):
            await client._slots.acquire()
            started = time.perf_counter()
            try:
                body = await build_request_body_async(episode, cfg)
            except FramesError as err:
                client._slots.release()
                results[index] = client._failed(episode, err, started)
                continue
            if packed and (len(packed) >= cap or packed_bytes + body.size > C.DEFAULT_MAX_BATCH_BYTES):
                flush()
            packed.append((index, body, started))
            packed_bytes += body.size
        flush()
        await client._gather(list(sending))
    except BaseException:
        for task in sending:
            task.cancel()
        await asyncio.gather(*sending, return_exceptions=True)
        for _, body, _ in packed:
            body.discard(cfg.keep_temp_video)
            client._slots.release()
        raise
    retry = [i for i, r in enumerate(results) if r is None]  # refused batch or retryable item
    if retry:
        again = await client._gather([client._score_one(episodes[i], deadline=deadlines.get(i))
                                      for i in retry])
        for index, result in zip(retry, again, strict=True):
            results[index] = result
    return results  # type: ignore[return-value]


async def _send_batch(client: AsyncRewardClient, episodes: list[Episode],
                      packed: list[tuple[int, ScoreRequestBody, float]], results: list,
                      deadlines: dict[int, float]) -> None:
    """One POST /score/batch; fills `results` where the outcome is final, leaves None where
    the episode should go through /score (by `deadlines[index]`, this batch's deadline)."""
    try:
        content = json.dumps({"items": [body.payload for _, body, _ in packed]},
                             separators=(",", ":")).encode()
        deadline = time.monotonic() + client.config.timeout
        for index, _, _ in packed:
            deadlines[index] = deadline
        try:
            data, attempts = await client._core.post_json(client.config.batch_url, content, deadline)
        except APIStatusError as err:
            if err.status_code in _REFUSED_AS_A_WHOLE:
                client._batch.disable(f"the proxy refused a batch: {err}")
                return
            for index, _, started in packed:
                results[index] = client._failed(episodes[index], err, started)
            return
        except RewardAPIError as err:
            for index, _, started in packed:
                results[index] = client._failed(episodes[index], err, started)
            return
        items = data.get("results") if isinstance(data, dict) else None
        if not isinstance(items, list) or len(items) != len(packed):
            client._batch.disable("its answer has no 'results' list of the right length")
            return
        for (index, _, started), item in zip(packed, items, strict=True):
            results[index] = _item_result(client, episodes[index], item, attempts, started)
    finally:
        for _, body, _ in packed:
            body.discard(client.config.keep_temp_video)
            client._slots.release()


def _item_result(client: AsyncRewardClient, episode: Episode, item: object, attempts: int,
                 started: float) -> EpisodeScore | None:
    if not isinstance(item, dict):
        item = {}
    if item.get("ok") is False or isinstance(item.get("error"), dict):
        code = (item.get("error") or {}).get("code")
        status = item.get("status") or _STATUS_OF_CODE.get(code, 502)
        err = make_status_error(int(status), item, attempts=attempts)
        if err.status_code in C.RETRY_STATUS_CODES:
            return None  # retried on its own through /score
        return client._failed(episode, err, started)
    result = item.get("result")
    try:
        score = parse_score_body(result, attempts)
    except RewardAPIError as err:
        return client._failed(episode, err, started)
    return client._succeeded(score, result, attempts, started)  # type: ignore[arg-type]
