"""The transport core shared by both client flavours: request bodies, the one retry loop, and
the one place where httpx exceptions and HTTP answers become this package's errors."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import os
import random
import time
from dataclasses import dataclass, field, replace
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
from rlinf_client._frames import (
    EpisodeFrameBuffer,
    encode_npy,
    encode_npy_b64,
    encode_ready,
    frames_at_steps,
    prepare_frames,
    write_temp_mp4,
)
from rlinf_client._types import ClientStats, Episode
from vlm_protocol.frame_rules import FrameRules
from vlm_protocol.multipart import PART_PREFIX, encode_form
from vlm_protocol.wire import BUDGET_HEADER, REQUEST_ID_HEADER, parse_retry_after

BINARY_PART = "frames"  # transport: binary; the part an episode's frames_npy names
EXTRA_VIEW_PART = "extra_view"  # and the part its second camera's frames_npy names
# the fields whose values may name a part ("part:<name>")
FRAME_FIELDS = ("frames_npy", "frames", "stills", "extra_view")
Part = tuple[str, bytes]  # (Content-Type, bytes)


@dataclass
class ScoreRequestBody:
    """One episode's /score body, built once and reused across retries."""

    payload: dict[str, Any]
    temp_video: str | None = None  # transport: path; deleted by `discard` unless kept
    parts: dict[str, Part] = field(default_factory=dict)  # transport: binary; the raw parts the payload names
    steps: list[int] | None = None  # dense_points: the episode step of each frame sent (curve → steps)
    frame_rules: str | None = None  # the proxy's rules id its frames were encoded for (None: raw frames)
    # Fewer frames picked than nframes and the episode allow, because the buffer kept only every
    # k-th step (frame_stride, widened by buffer_frames): {wanted, sent, source_count, stride}.
    frames_short: dict[str, Any] | None = None

    @property
    def size(self) -> int:
        """About how many bytes the body takes (the frames dominate)."""
        if self.parts:
            return sum(len(data) for _, data in self.parts.values()) + 1024
        inline = [self.payload.get("frames_npy") or "", *(self.payload.get("frames") or ()),
                  *(self.payload.get("stills") or ()), (self.payload.get("extra_view") or {}).get("frames_npy") or ""]
        return sum(map(len, inline)) + 1024

    def encoded(self, binary: bool = True) -> tuple[str, bytes]:
        """(Content-Type, body) for POST /score (or /score/dense); `binary=False` sends a binary
        body's frames inline instead (for a proxy that takes no binary body)."""
        if not self.parts or not binary:
            return "application/json", self.inline().to_bytes()
        return parts_form(self.payload, self.parts)

    def named(self, prefix: str) -> tuple[dict[str, Any], dict[str, Part]]:
        """(payload, parts) with every part renamed `prefix` + name: items of one batch body."""
        def rename(value: Any) -> Any:
            if isinstance(value, list):
                return [rename(v) for v in value]
            if isinstance(value, dict):  # extra_view: a source of its own
                return {k: rename(v) for k, v in value.items()}
            if isinstance(value, str) and value.startswith(PART_PREFIX):
                return PART_PREFIX + prefix + value[len(PART_PREFIX):]
            return value  # inline base64 stays as it is
        payload = {k: rename(v) if k in FRAME_FIELDS else v for k, v in self.payload.items()}
        return payload, {prefix + name: part for name, part in self.parts.items()}

    def inline(self) -> ScoreRequestBody:
        """This body with its frames as base64 in the JSON (itself when they are already)."""
        if not self.parts:
            return self

        def b64(value: Any) -> Any:
            if isinstance(value, list):
                return [b64(v) for v in value]
            if isinstance(value, dict):
                return {k: b64(v) for k, v in value.items()}
            if isinstance(value, str) and value.startswith(PART_PREFIX):
                return base64.b64encode(self.parts[value[len(PART_PREFIX):]][1]).decode()
            return value
        return replace(self, payload={k: b64(v) if k in FRAME_FIELDS else v for k, v in self.payload.items()},
                       parts={})

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


def parts_form(request: dict[str, Any], parts: dict[str, Part]) -> tuple[str, bytes]:
    """(Content-Type, body) of a binary body: the JSON request and its raw parts by name."""
    return encode_form(json.dumps(request, separators=(",", ":")).encode(), parts)


def build_request_body(episode: Episode, cfg: RewardModelConfig, rules: FrameRules | None = None,
                       nframes: int | None = None) -> ScoreRequestBody:
    """Pick and encode the frames (blocking CPU work: run it in a thread).

    With the proxy's frame `rules` for the backend (GET /frame-rules; None: send raw frames), the
    picked frames go as JPEGs already at the sizes the proxy sends (and PRIMO-R1's two stills), which
    it forwards untouched. Whatever the transport, the proxy gets the same two rates: `video_fps` (the
    seed's rate, what the proxy presents by default) and the real rate of the frames sent,
    `episode_fps` x frames sent / episode steps — as `fps` with inline frames, and as the temp MP4's own rate.
    """
    # A curve's prefixes each sample nframes of their own: send every held frame, the proxy picks.
    client_sampling = cfg.client_sampling and not cfg.dense_points
    # Two cameras go raw: the proxy places the second view (side by side, it composes each frame).
    ready = rules is not None and client_sampling and cfg.transport != "path" and episode.extra_view is None
    # `nframes`: a body built again raw after a 409 picks the frames the refused one picked.
    nframes = nframes or (rules.nframes_for(cfg.nframes) if ready else cfg.nframes)  # type: ignore[union-attr]
    prepared = prepare_frames(episode.frames, nframes, client_sampling)
    sent = prepared.count
    short = frames_short(episode.frames, nframes, sent, prepared.source_count) if client_sampling else None
    if short is None and ready and nframes < cfg.nframes and sent < min(cfg.nframes, prepared.source_count):
        # The backend's clamp, applied here because the client picks the frames: the proxy's answer
        # then sees only the lowered count asked, so the result says what was asked.
        short = {"wanted": min(cfg.nframes, prepared.source_count), "sent": sent,
                 "source_count": prepared.source_count, "why": "clamp"}
    used = sent if client_sampling else min(cfg.nframes, sent)
    real_fps = cfg.episode_fps * sent / max(prepared.source_count, 1)
    payload: dict[str, Any] = {"task_text": episode.task_text, "nframes": used,
                               "max_pixels": cfg.max_pixels, "video_fps": cfg.video_fps}
    temp_video, parts = None, {}
    encoded = encode_ready(prepared.frames, rules, cfg.max_pixels) if ready else None  # type: ignore[arg-type]
    if encoded is not None:
        jpegs, stills = encoded
        named = {"frames": [(f"f{i}", j) for i, j in enumerate(jpegs)],
                 "stills": [(f"s{i}", j) for i, j in enumerate(stills)]}
        for key, items in named.items():
            if not items:
                continue
            if cfg.transport == "binary":
                payload[key] = [PART_PREFIX + name for name, _ in items]
                parts.update({name: ("image/jpeg", jpeg) for name, jpeg in items})
            else:
                payload[key] = [base64.b64encode(jpeg).decode() for _, jpeg in items]
        payload["frame_rules"] = rules.rules_id  # type: ignore[union-attr]
        payload["fps"] = round(real_fps, 6)
    elif cfg.transport == "path":
        temp_video = write_temp_mp4(prepared.frames, real_fps, cfg.temp_video_dir)
        payload["video_path"] = os.path.abspath(temp_video)
    elif cfg.transport == "binary":
        parts[BINARY_PART] = ("application/x-npy", encode_npy(prepared.frames))
        payload["frames_npy"] = PART_PREFIX + BINARY_PART
        payload["fps"] = round(real_fps, 6)
    else:
        payload["frames_npy"] = encode_npy_b64(prepared.frames)
        payload["fps"] = round(real_fps, 6)
    if episode.extra_view is not None:  # the same steps of the second camera, as npy (a part, or base64)
        wrist = encode_npy(frames_at_steps(episode.extra_view, prepared))
        if cfg.transport == "binary":
            parts[EXTRA_VIEW_PART] = ("application/x-npy", wrist)
            payload["extra_view"] = {"frames_npy": PART_PREFIX + EXTRA_VIEW_PART}
        else:
            payload["extra_view"] = {"frames_npy": base64.b64encode(wrist).decode("ascii")}
    if cfg.backend:
        payload["backend"] = cfg.backend
    if cfg.backend_kwargs:
        payload["backend_kwargs"] = dict(cfg.backend_kwargs)
    if episode.metadata:
        payload["metadata"] = dict(episode.metadata)
    frame_rules = rules.rules_id if encoded is not None else None  # type: ignore[union-attr]
    if cfg.dense_points:
        payload["points"] = points = max(2, min(cfg.dense_points, sent - 1))  # a short episode: fewer, or a 422
        fewer = ({"wanted": cfg.dense_points, "sent": points, "source_count": prepared.source_count, "why": "points"}
                 if points < cfg.dense_points else None)
        return ScoreRequestBody(payload, temp_video, parts, steps=list(prepared.source_indices), frames_short=fewer)
    return ScoreRequestBody(payload, temp_video, parts, frame_rules=frame_rules, frames_short=short)


def frames_short(source: object, nframes: int, sent: int, source_count: int) -> dict[str, int] | None:
    """What the frame buffer's stride left out, when it did: the episode had room for more frames
    than were sent (the proxy's answer cannot say so: it sees only what was sent)."""
    wanted = min(nframes, source_count)
    if sent >= wanted or not isinstance(source, EpisodeFrameBuffer):
        return None
    return {"wanted": wanted, "sent": sent, "source_count": source_count, "stride": source.stride, "why": "stride"}


async def build_request_body_async(episode: Episode, cfg: RewardModelConfig, rules: FrameRules | None = None,
                                   nframes: int | None = None) -> ScoreRequestBody:
    """`build_request_body` in a worker thread. The thread cannot be stopped, so a cancel while
    it runs lets it finish and then deletes the temp MP4 it wrote (unless `keep_temp_video`)."""
    future = asyncio.ensure_future(asyncio.to_thread(build_request_body, episode, cfg, rules, nframes))
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


def parse_curve_body(body: Any, attempts: int, steps: list[int]) -> tuple[float, tuple[tuple[int, float], ...]]:
    """A /score/dense answer: (the last point's score, the curve as (episode step, score)), or
    APIResponseValidationError — a curve with a bad point is refused whole, never patched."""
    curve = body.get("curve") if isinstance(body, dict) else None
    if not isinstance(curve, list) or len(curve) < 2 or body.get("source_count") != len(steps):
        raise APIResponseValidationError(f"the proxy answered 200 without a curve over the {len(steps)} frames "
                                         "sent", attempts=attempts)
    points: list[tuple[int, float]] = []
    for point in curve:
        index = point.get("frame_index") if isinstance(point, dict) else None
        if isinstance(index, bool) or not isinstance(index, int) or not 1 <= index < len(steps) \
                or (points and steps[index] <= points[-1][0]):
            raise APIResponseValidationError(f"the curve's frame_index {index!r} is not a later frame sent",
                                             attempts=attempts)
        points.append((steps[index], parse_score_body(point, attempts)))
    if curve[-1]["frame_index"] != len(steps) - 1:  # the reward is the last point: the whole episode's
        raise APIResponseValidationError("the curve does not end at the episode's last frame", attempts=attempts)
    return points[-1][1], tuple(points)


def response_json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text[:2000]


def retry_delay(attempt: int, retry_after: float | None) -> float:
    """The server's Retry-After when it gave one, else jittered exponential backoff."""
    if retry_after is not None:
        return retry_after
    backoff = min(C.INITIAL_RETRY_DELAY * 2 ** (attempt - 1), C.MAX_RETRY_DELAY)
    return backoff * (1 - 0.25 * random.random())


def timeout_error(cfg: RewardModelConfig, attempts: int, detail: str = "") -> APITimeoutError:
    return APITimeoutError(f"no score within timeout={cfg.timeout:g}s{detail}", attempts=attempts)


class TransportCore:
    """One httpx.AsyncClient (one connection pool) and the one retry loop."""

    def __init__(self, cfg: RewardModelConfig, http: httpx.AsyncClient | None,
                 transport: httpx.AsyncBaseTransport | None, stats: ClientStats) -> None:
        self.cfg = cfg
        self.stats = stats
        self._owns_http = http is None
        headers = {"user-agent": C.USER_AGENT}
        api_key = cfg.resolved_api_key()
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self.http = http or httpx.AsyncClient(
            transport=transport,
            limits=httpx.Limits(max_connections=cfg.max_concurrency,
                                max_keepalive_connections=cfg.max_concurrency),
            timeout=httpx.Timeout(cfg.timeout, connect=cfg.connect_timeout),
            headers=headers,
            trust_env=False,  # the proxy is addressed directly; env proxies would reroute it
        )

    async def aclose(self) -> None:
        if self._owns_http:
            await self.http.aclose()

    async def post_json(self, url: str, content: bytes, deadline: float,
                        content_type: str = "application/json") -> tuple[Any, int]:
        """POST until a 2xx (its JSON and the attempts made) or a final typed error.

        Each try tells the proxy the time left (BUDGET_HEADER), so the proxy's own retries end
        first. Sent again only what cannot have reached vLLM: a connection that never opened,
        and answers the proxy marks retryable (429 overloaded, no replica in rotation) — at
        most `max_retries` times, at least Retry-After apart, never past `deadline`.
        """
        cfg = self.cfg
        attempt = 0
        while True:
            attempt += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise timeout_error(cfg, attempt - 1)
            self.stats.requests += 1
            retry_after = None
            try:
                # httpx's timeout bounds each socket operation; wait_for bounds the whole request
                # (a reply that drips in slowly).
                response = await asyncio.wait_for(self.http.post(
                    url, content=content,
                    headers={"content-type": content_type, BUDGET_HEADER: str(int(remaining * 1e3))},
                    timeout=httpx.Timeout(remaining, connect=min(cfg.connect_timeout, remaining))),
                    remaining)
            except asyncio.TimeoutError as err:  # noqa: UP041 (not TimeoutError before 3.11)
                raise timeout_error(cfg, attempt) from err
            except httpx.ConnectError as err:
                error: RewardAPIError = APIConnectionError(f"cannot reach the proxy at {url}: "
                                                           f"{type(err).__name__}: {err}", attempts=attempt)
                cause: BaseException | None = err
            except httpx.ConnectTimeout as err:
                if time.monotonic() >= deadline:
                    raise timeout_error(cfg, attempt, " (connect timeout)") from err
                error, cause = APIConnectionError(f"cannot reach the proxy at {url}: connect timeout",
                                                  attempts=attempt), err
            except httpx.TimeoutException as err:
                raise timeout_error(cfg, attempt, f" ({type(err).__name__})") from err
            except httpx.TransportError as err:  # the request may have reached the proxy: not resent
                raise APIConnectionError(f"the connection to the proxy at {url} broke: "
                                         f"{type(err).__name__}: {err}", attempts=attempt) from err
            else:
                if response.is_success:
                    try:
                        return response.json(), attempt
                    except ValueError as err:
                        raise APIResponseValidationError(
                            "the proxy answered 200 with a body that is not JSON", attempts=attempt) from err
                retry_after = parse_retry_after(response.headers.get("retry-after"),
                                                response.headers.get("retry-after-ms"))
                error = make_status_error(response.status_code, response_json(response), attempts=attempt,
                                          retry_after=retry_after,
                                          request_id=response.headers.get(REQUEST_ID_HEADER))
                cause = None
                if not error.retryable:
                    raise error
            delay = retry_delay(attempt, retry_after)
            if attempt > cfg.max_retries or time.monotonic() + delay >= deadline:
                raise error from cause
            self.stats.retries += 1
            await asyncio.sleep(delay)
