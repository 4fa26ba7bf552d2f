"""The transport core shared by both client flavours: request bodies, the one retry loop, and
the one place where httpx exceptions and HTTP answers become this package's errors."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from rlinf_client import _constants as C
from rlinf_client._config import RewardModelConfig
from rlinf_client._exceptions import (
    APIConnectionError,
    APIResponseValidationError,
    APITimeoutError,
    RewardAPIError,
    make_status_error,
)
from rlinf_client._frames import encode_npy_b64, prepare_frames, write_temp_mp4
from rlinf_client._types import ClientStats, Episode


@dataclass
class ScoreRequestBody:
    """One episode's /score body, built once and reused across retries."""

    payload: dict[str, Any]
    temp_video: str | None = None  # transport: path; deleted by `discard` unless kept

    @property
    def size(self) -> int:
        """About how many bytes the body takes in JSON (the frames dominate)."""
        return len(self.payload.get("frames_npy") or "") + 1024

    def to_bytes(self) -> bytes:
        frames = self.payload.get("frames_npy")
        if frames is None:
            return json.dumps(self.payload, separators=(",", ":")).encode()
        # Splice the base64 in: it needs no JSON escaping, and json.dumps would scan all of it.
        rest = json.dumps({k: v for k, v in self.payload.items() if k != "frames_npy"},
                          separators=(",", ":")).encode()
        separator = b"," if rest != b"{}" else b""
        return rest[:-1] + separator + b'"frames_npy":"' + frames.encode("ascii") + b'"}'

    def discard(self, keep: bool) -> None:
        if self.temp_video is not None and not keep:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.temp_video)
            self.temp_video = None


def build_request_body(episode: Episode, cfg: RewardModelConfig) -> ScoreRequestBody:
    """Pick and encode the frames (blocking CPU work: run it in a thread).

    The sent clip is always presented at `video_fps` whatever is sent: with client sampling
    (the seed's way) K frames go out at `video_fps`; without it, all B held frames go out at
    `video_fps * B / K` so the proxy's K-frame pick lands on `video_fps` again.
    """
    prepared = prepare_frames(episode.frames, cfg.nframes, cfg.client_sampling)
    sent = prepared.count
    used = sent if cfg.client_sampling else min(cfg.nframes, sent)
    source_fps = cfg.video_fps * sent / used
    payload: dict[str, Any] = {"task_text": episode.task_text, "nframes": used,
                               "max_pixels": cfg.max_pixels}
    temp_video = None
    if cfg.transport == "path":
        temp_video = write_temp_mp4(prepared.frames, source_fps, cfg.temp_video_dir)
        payload["video_path"] = os.path.abspath(temp_video)
    else:
        payload["frames_npy"] = encode_npy_b64(prepared.frames)
        payload["fps"] = round(source_fps, 6)
    if cfg.backend:
        payload["backend"] = cfg.backend
    if cfg.backend_kwargs:
        payload["backend_kwargs"] = dict(cfg.backend_kwargs)
    return ScoreRequestBody(payload, temp_video)


async def build_request_body_async(episode: Episode, cfg: RewardModelConfig) -> ScoreRequestBody:
    """`build_request_body` in a worker thread. The thread cannot be stopped, so a cancel while
    it runs lets it finish and then deletes the temp MP4 it wrote (unless `keep_temp_video`)."""
    future = asyncio.ensure_future(asyncio.to_thread(build_request_body, episode, cfg))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        def discard(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                done.result().discard(cfg.keep_temp_video)
        future.add_done_callback(discard)
        raise


def parse_score_body(body: Any, attempts: int) -> float:
    """The score of a 200 answer, or APIResponseValidationError: never a silent default."""
    score = body.get("score") if isinstance(body, dict) else None
    if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score) \
            or not 0.0 <= score <= 1.0:
        raise APIResponseValidationError(
            f"the proxy answered 200 without a score in [0, 1] (score={score!r})", attempts=attempts)
    return float(score)


def response_json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text[:2000]


def parse_retry_after(headers: httpx.Headers) -> float | None:
    """Seconds from `retry-after-ms`, or `retry-after` (seconds or an HTTP date)."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms:
        try:
            return max(0.0, float(raw_ms) / 1000)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def should_retry(response: httpx.Response) -> bool:
    explicit = response.headers.get("x-should-retry")
    if explicit in ("true", "false"):
        return explicit == "true"
    return response.status_code in C.RETRY_STATUS_CODES


def retry_delay(attempt: int, retry_after: float | None) -> float:
    """The server's Retry-After when it gives a sane one, else jittered exponential backoff."""
    if retry_after is not None and 0 <= retry_after <= C.MAX_RETRY_AFTER:
        return retry_after
    backoff = min(C.INITIAL_RETRY_DELAY * 2 ** (attempt - 1), C.MAX_RETRY_DELAY)
    return backoff * (1 - 0.25 * random.random())


class TransportCore:
    """One httpx.AsyncClient (one connection pool) and the one retry loop."""

    def __init__(self, cfg: RewardModelConfig, http: httpx.AsyncClient | None,
                 transport: httpx.AsyncBaseTransport | None, stats: ClientStats) -> None:
        self.cfg = cfg
        self.stats = stats
        self._owns_http = http is None
        self.http = http or httpx.AsyncClient(
            transport=transport,
            limits=httpx.Limits(max_connections=cfg.max_concurrency,
                                max_keepalive_connections=cfg.max_concurrency),
            timeout=httpx.Timeout(cfg.timeout, connect=cfg.connect_timeout),
            headers={"user-agent": C.USER_AGENT},
            trust_env=False,  # the proxy is addressed directly; env proxies would reroute it
        )

    async def aclose(self) -> None:
        if self._owns_http:
            await self.http.aclose()

    async def post_json(self, url: str, content: bytes, deadline: float) -> tuple[Any, int]:
        """POST until a 2xx (its JSON and the attempts made) or a final typed error.

        Retried: connection failures, 429 and 503 (at least Retry-After apart), at most
        `max_retries` times and never past `deadline` (time.monotonic()).
        """
        cfg = self.cfg
        attempt = 0
        while True:
            attempt += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise APITimeoutError(f"no score within timeout={cfg.timeout:g}s",
                                      attempts=attempt - 1)
            self.stats.requests += 1
            retry_after = None
            try:
                # httpx's timeout bounds each socket operation; wait_for bounds the whole request
                # (a reply that drips in slowly).
                response = await asyncio.wait_for(self.http.post(
                    url, content=content, headers={"content-type": "application/json"},
                    timeout=httpx.Timeout(remaining, connect=min(cfg.connect_timeout, remaining))),
                    remaining)
            except asyncio.TimeoutError as err:  # noqa: UP041 (not TimeoutError before 3.11)
                raise APITimeoutError(f"no score within timeout={cfg.timeout:g}s",
                                      attempts=attempt) from err
            except httpx.TimeoutException as err:
                if not isinstance(err, httpx.ConnectTimeout) or time.monotonic() >= deadline:
                    raise APITimeoutError(f"no score within timeout={cfg.timeout:g}s "
                                          f"({type(err).__name__})", attempts=attempt) from err
                error: RewardAPIError = APIConnectionError(
                    f"cannot reach the proxy at {url}: connect timeout", attempts=attempt)
                cause: BaseException = err
            except httpx.TransportError as err:
                error = APIConnectionError(f"cannot reach the proxy at {url}: "
                                           f"{type(err).__name__}: {err}", attempts=attempt)
                cause = err
            else:
                if response.is_success:
                    try:
                        return response.json(), attempt
                    except ValueError as err:
                        raise APIResponseValidationError(
                            "the proxy answered 200 with a body that is not JSON",
                            attempts=attempt) from err
                retry_after = parse_retry_after(response.headers)
                error = make_status_error(response.status_code, response_json(response),
                                          attempts=attempt, retry_after=retry_after,
                                          request_id=response.headers.get("x-request-id"))
                cause = None
                if not should_retry(response):
                    raise error
            delay = retry_delay(attempt, retry_after)
            if attempt > cfg.max_retries or time.monotonic() + delay >= deadline:
                raise error from cause
            self.stats.retries += 1
            await asyncio.sleep(delay)
