"""The one envelope around a request that reaches a backend: the backend it names, admission, the
in-flight gauge, the outcome counter, the latency and score histograms, the live monitor and the
audit line.

Every route opens one `Envelope` with its own `Effects`, so each keeps what it counts today (the
pass-through writes no audit line, a dense curve's points are not episodes, progress counts per
item) while the code that applies them is written once. The layout test holds that these effects
are applied here and nowhere else. The monitor never fails an answer: its own errors are logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from proxy.errors import ProxyError, ScoreParseError
from proxy.pipelines.services import Services
from proxy.protocol.score import QualityStatus
from proxy.upstream.backends import Backend

__all__ = ["BATCH_ITEM", "COMPARE", "COMPARE_ITEM", "DENSE_CURVE", "DENSE_POINT", "PASSTHROUGH", "PROBE", "PROGRESS",
           "REFERENCES", "SCORE", "Effects", "Envelope"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Effects:
    """What one kind of request leaves behind besides its answer."""

    kind: str | None  # its audit lines' kind; None writes none
    counter: str | None = None  # the Metrics counter of its outcomes by backend and outcome
    latency: str | None = None  # the Metrics histogram of its seconds
    admit: bool = True  # False: its batch or curve was admitted as a whole by its owner
    in_flight: bool = True  # counted in vlm_proxy_in_flight while it runs
    watched: bool = False  # an episode the live monitor sees (its window, its alarm)
    per_item: bool = False  # its lines are its items' (progress): a failure of the whole writes none


SCORE = Effects("score", counter="episodes", latency="latency", watched=True)
BATCH_ITEM = Effects("score", counter="episodes", latency="latency", watched=True, admit=False)
DENSE_CURVE = Effects(None, in_flight=False)  # its points are in flight; the curve is admitted once
DENSE_POINT = Effects("dense_point", admit=False)  # the route counts the curve; a point is no episode
PROBE = Effects("probe", admit=False)  # never an episode: no counter, no window
COMPARE = Effects("compare", counter="comparisons", latency="compare_latency")
COMPARE_ITEM = Effects("compare", counter="comparisons", latency="compare_latency", admit=False)
PROGRESS = Effects("progress", counter="progress_episodes", per_item=True)
REFERENCES = Effects(None)  # demonstrations: admitted and in flight, no lines
PASSTHROUGH = Effects(None, in_flight=False)


class Envelope:
    """`with Envelope(services, EFFECTS, label) as envelope:` resolves the backend, admits the
    request and counts it in flight; `done` records an outcome; leaving with a ProxyError records
    the failure (its counter, its audit line built from `describe()`) and re-raises it."""

    def __init__(self, services: Services, effects: Effects, label: str | None, *, kind: str | None = "chat",
                 field: str = "backend", describe: Callable[[], dict[str, Any]] = dict,
                 watch: tuple[str, dict[str, Any] | None] | None = None, resolved: Backend | None = None) -> None:
        self.services, self.effects, self.describe = services, effects, describe
        self._label, self._kind, self._field = label, kind, field
        self.watch = watch  # (task_text, metadata) of a watched episode
        self.backend: Backend
        if resolved is not None:  # named by its owner (a cascade: its name over its first stage's pool)
            self.backend = resolved

    def __enter__(self) -> Envelope:
        try:
            if not hasattr(self, "backend"):
                self.backend = self.services.registry.resolve(self._label, self._field, self._kind)
        except ProxyError as err:
            self._count("none", err.code)
            raise
        if self.effects.in_flight:
            self.services.metrics.in_flight.labels(self.backend.name).inc()
        try:
            if self.effects.admit:
                self.backend.pool.check_admission()
        except ProxyError as err:
            self.__exit__(type(err), err, None)
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self.effects.in_flight:
            self.services.metrics.in_flight.labels(self.backend.name).dec()
        if isinstance(err, ProxyError):
            err.backend = self.backend.name  # the true label for the HTTP request counter
            if not self.effects.per_item:
                self.failed(err, self.describe())
            if isinstance(err, ScoreParseError) and self.effects.watched and self.watch is not None:
                self._observe(None)  # a reply, but no score: the window counts it as no answer

    def failed(self, err: ProxyError, line: dict[str, Any]) -> None:
        """One failed outcome: counted by its code, its audit line with the error."""
        self._count(self.backend.name, err.code)
        self._write({**line, "error": {"code": err.code, "message": err.message},
                     **({} if self.effects.per_item else {"attempts": err.attempts})})

    def done(self, line: dict[str, Any], outcome: str = "ok", *, score: float | None = None,
             seconds: float | None = None) -> QualityStatus | None:
        """One outcome the request answered: counted, timed, its audit line; for a watched episode,
        what the live monitor says of its key (None when it says nothing)."""
        metrics, name = self.services.metrics, self.backend.name
        self._count(name, outcome)
        if score is not None and self.effects.watched:
            metrics.scores.labels(name).observe(score)
        if seconds is not None and self.effects.latency is not None:
            getattr(metrics, self.effects.latency).labels(name).observe(seconds)
        self._write(line)
        # The episode's line first, then any alarm line it causes, as on every path (a parse failure,
        # a dense curve): a restart's rebuild reads an alarm line's episode count after its episode.
        return self._observe(score) if score is not None and self.effects.watched and self.watch else None

    def watch_episode(self, score: float) -> QualityStatus | None:
        """The monitor's view of an episode scored inside another request (a dense curve's whole episode)."""
        return self._observe(score) if self.watch else None

    def observe_as(self, label: str, score: float) -> QualityStatus | None:
        """The monitor's view of one part of the episode under a key of its own (a cascade's stage)."""
        return self._observe(score, label) if self.watch else None

    def observe_cascade(self, stages: list[Any], threshold: float, stopped: str | None) -> None:
        """The monitor's view of a cascade episode's stages: its escalation and audit rates."""
        if not self.watch:
            return
        task_text, metadata = self.watch
        try:
            self.services.quality.observe_cascade(self.backend.name, task_text, metadata, stages, threshold, stopped)
        except Exception:  # noqa: BLE001 - a bug in the monitor must not turn a score into a 500
            log.exception("cascade window failed; the episode's answer is unaffected")

    def _observe(self, score: float | None, label: str | None = None) -> QualityStatus | None:
        assert self.watch is not None
        task_text, metadata = self.watch
        try:
            said = self.services.quality.observe(label or self.backend.name, task_text, metadata, score)
        except Exception:  # noqa: BLE001 - a bug in the monitor must not turn a score into a 500
            log.exception("reward-quality window failed; the episode's answer is unaffected")
            return None
        return QualityStatus.model_validate(said) if said is not None else None

    def _count(self, backend: str, outcome: str) -> None:
        if self.effects.counter is not None:
            getattr(self.services.metrics, self.effects.counter).labels(backend, outcome).inc()

    def _write(self, line: dict[str, Any]) -> None:
        if self.effects.kind is not None:
            self.services.audit.write(line)
