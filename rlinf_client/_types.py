"""What goes into the client (`Episode`) and what comes back (`EpisodeScore`, `ClientStats`)."""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any

from rlinf_client._exceptions import RewardClientError

__all__ = ["OUTCOMES", "ClientStats", "Episode", "EpisodeProgress", "EpisodeScore"]


@dataclass(frozen=True)
class Episode:
    """One finished episode to score.

    `frames`: an `EpisodeFrameBuffer` or array-like T×H×W×3 / T×3×H×W (uint8 or float).
    `fallback`: the simulator's success flag (0.0 / 1.0), the reward of a failed request only
    under `fallback: env_success`; None = unknown (then env_success gives None, never a guess).
    `metadata`: sent with the request and recorded in the proxy's audit log, never to the model
    (e.g. env_success, task_id, episode_id, step, run).
    `extra_view`: a second camera's frames of the same steps (the wrist view), like `frames`; sent
    as the request's extra_view at the steps picked from `frames`.
    """

    frames: Any
    task_text: str
    fallback: float | None = None
    metadata: dict[str, Any] | None = None
    extra_view: Any = None


@dataclass(frozen=True)
class EpisodeScore:
    """The outcome for one episode. Never a bare number: `ok` says whether the VLM scored it."""

    ok: bool
    value: float | None  # the score to use: the proxy's when ok, else the fallback's (may be None)
    score: float | None = None  # the proxy's score in [0, 1] (None when the request failed)
    reason: str | None = None  # when not ok: the error code (e.g. upstream_unavailable, timeout)
    error: RewardClientError | None = None
    attempts: int = 0  # HTTP requests made for this episode, retries included
    latency_ms: float = 0.0  # prepare + send + retries
    response: dict[str, Any] | None = None  # the proxy's full ScoreResponse (DenseResponse with dense_points)
    curve: tuple[tuple[int, float], ...] | None = None  # dense_points: (episode step, score), `score` the last
    # Set when fewer frames were sent than nframes and the episode allowed, because the frame buffer
    # kept only every `stride`-th step (frame_stride, widened by buffer_frames):
    # {"wanted", "sent", "source_count", "stride"}. The proxy's answer sees only what was sent.
    frames_short: dict[str, Any] | None = None

    @property
    def fallback(self) -> bool:
        return not self.ok


from vlm_protocol.progress import OUTCOMES  # noqa: E402 - re-exported beside the result type


@dataclass(frozen=True)
class EpisodeProgress:
    """One episode's result from POST /progress/batch (reward_source: progress).

    When ok, `outcome` is the proxy's: `success` (progress 1.0), `progress` (a failure's progress in
    [0, 1]) or `no_reference` (a failure with nothing to compare with: `progress` is None, never a
    number). When not ok, `value` is the failure policy's value, as `EpisodeScore.value` is."""

    ok: bool
    value: float | None  # the progress when ok (None for no_reference), else the fallback's
    outcome: str | None = None
    progress: float | None = None
    reason: str | None = None  # when not ok: the error code
    error: RewardClientError | None = None
    attempts: int = 0
    latency_ms: float = 0.0
    response: dict[str, Any] | None = None  # the item's `result` (distance, reference, embedding, ...)
    # fewer frames embedded than asked and the episode allowed, and why (as EpisodeScore.frames_short)
    frames_short: dict[str, Any] | None = None

    @property
    def fallback(self) -> bool:
        return not self.ok


@dataclass
class ClientStats:
    """Running counts for one client; `failures` is what RLinf logs as the fallback count."""

    episodes: int = 0
    scored: int = 0
    failures: int = 0
    requests: int = 0  # HTTP requests, retries and batch probes included
    retries: int = 0
    failure_reasons: collections.Counter = field(default_factory=collections.Counter)
    latency_ms_total: float = 0.0
    frames_short: int = 0  # episodes sent with fewer frames than nframes and the episode allowed

    def record(self, result: EpisodeScore | EpisodeProgress) -> None:
        self.episodes += 1
        self.latency_ms_total += result.latency_ms
        self.frames_short += getattr(result, "frames_short", None) is not None
        if result.ok:
            self.scored += 1
        else:
            self.failures += 1
            self.failure_reasons[result.reason or "unknown"] += 1

    @property
    def mean_latency_ms(self) -> float:
        return self.latency_ms_total / self.episodes if self.episodes else math.nan

    def as_dict(self) -> dict[str, Any]:
        return {"episodes": self.episodes, "scored": self.scored, "failures": self.failures,
                "requests": self.requests, "retries": self.retries,
                "failure_reasons": dict(self.failure_reasons), "frames_short": self.frames_short}
