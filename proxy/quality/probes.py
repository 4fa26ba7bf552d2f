"""Invariance probes (quality.probes): a sampled share of scored episodes is scored again in the
background with its frames reversed, its frames shuffled (seeded), or another task's instruction of
the same run. A reward model that ignores time order or the instruction shows margins near 0 and
inversions here before a policy exploits it.

Probes are lower priority than real work: one starts after its episode's answer, only while the
episode's backend has room (`ProbedEpisode.has_room`), at most `max_in_flight` at once; otherwise it
is dropped and counted. The scoring itself is the pipeline's (`ProbedEpisode.rescore`), so this
module decides what to probe and keeps the numbers, and knows nothing of how an episode is scored.
A probe is never an episode: it never enters the agreement window.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.config import ProbesConfig
from proxy.errors import ProxyError
from proxy.metrics import Metrics
from proxy.quality.monitor import Key, QualityMonitor, quality_key

__all__ = ["InvarianceProbes", "Probe", "ProbedEpisode"]

log = logging.getLogger(__name__)
MAX_RUNS, MAX_TASKS_PER_RUN = 64, 64  # instructions remembered for the `instruction` probe


@dataclass
class Probe:
    """One variant of a scored episode to score again; `described` becomes its audit line's fields."""

    kind: str  # reversed, shuffled, instruction
    described: dict[str, Any]
    seed: str | None = None  # shuffled: quality.probes.seed; the pipeline adds the frames' hash to it
    task_text: str | None = None  # instruction: the other task's text


@dataclass(frozen=True)
class ProbedEpisode:
    """A scored episode as the probes see it; the pipeline that scored it says how to score a variant."""

    backend: str
    task_text: str
    metadata: dict[str, Any] | None
    score: float
    has_room: Callable[[int], bool]  # more than this many endpoint slots free and nobody queued
    rescore: Callable[[Probe], Awaitable[float]] = field(repr=False)


class InvarianceProbes:
    def __init__(self, config: ProbesConfig, monitor: QualityMonitor, metrics: Metrics) -> None:
        self.config, self.monitor, self.metrics = config, monitor, metrics
        self.sample = random.Random(config.seed)  # which episodes are probed: reproducible per seed
        self.instructions: dict[str | None, dict[str, str]] = {}  # run -> task -> its instruction
        self.in_flight = 0
        self.tasks: set[asyncio.Task] = set()

    def after(self, episode: ProbedEpisode) -> None:
        """Called with each scored episode (its answer is ready): maybe start its probes."""
        key = quality_key(episode.backend, episode.task_text, episode.metadata)
        self._remember(key, episode.task_text)
        if (self.config.fraction == 0 or (episode.metadata or {}).get("env_success") is None
                or key not in self.monitor.windows or self.sample.random() >= self.config.fraction):
            return
        for kind in self.config.kinds:
            if self.in_flight >= self.config.max_in_flight:
                self.metrics.quality_probes.labels(episode.backend, kind, "dropped_cap").inc()
            elif not episode.has_room(self.config.reserve_slots):
                self.metrics.quality_probes.labels(episode.backend, kind, "dropped_busy").inc()
            else:
                self.in_flight += 1
                task = asyncio.get_running_loop().create_task(self._probe(kind, key, episode))
                self.tasks.add(task)
                task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self.in_flight -= 1

    def _remember(self, key: Key, task_text: str) -> None:
        run, _, task = key
        tasks = self.instructions.pop(run, None)  # re-inserted last: the oldest run is forgotten first
        if tasks is None:
            if len(self.instructions) >= MAX_RUNS:
                del self.instructions[next(iter(self.instructions))]
            tasks = {}
        self.instructions[run] = tasks
        tasks.pop(task, None)
        if len(tasks) >= MAX_TASKS_PER_RUN:
            del tasks[next(iter(tasks))]
        tasks[task] = task_text

    def _variant(self, kind: str, key: Key, episode: ProbedEpisode) -> Probe | None:
        run, _, task = key
        described: dict[str, Any] = {"probe": kind, "run": run, "task_id": task,
                                     "episode_id": (episode.metadata or {}).get("episode_id"),
                                     "original_score": episode.score}
        if kind == "reversed":
            return Probe(kind, described)
        if kind == "shuffled":
            return Probe(kind, described, seed=str(self.config.seed))
        other = next((text for other_task, text in sorted(self.instructions.get(run, {}).items())
                      if other_task != task and text != episode.task_text), None)
        if other is None:
            return None
        described["other_task"] = other
        return Probe(kind, described, task_text=other)

    async def _probe(self, kind: str, key: Key, episode: ProbedEpisode) -> None:
        name = episode.backend
        probe = self._variant(kind, key, episode)
        if probe is None:
            self.metrics.quality_probes.labels(name, kind, "no_other_task").inc()
            return
        try:
            score = await episode.rescore(probe)
        except ProxyError as err:
            self.metrics.quality_probes.labels(name, kind, err.code).inc()
            return
        except Exception:  # a probe must never take the proxy down: logged, counted
            log.exception("invariance probe %s of %s failed", kind, key)
            self.metrics.quality_probes.labels(name, kind, "internal_error").inc()
            return
        self.metrics.quality_probes.labels(name, kind, "scored").inc()
        self.monitor.observe_probe(key, kind, episode.score, score)

    async def close(self) -> None:
        """At shutdown: probes in flight are cancelled (they are never anyone's answer)."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
