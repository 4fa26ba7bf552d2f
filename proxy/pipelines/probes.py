"""Invariance probes (quality.probes): a sampled share of scored episodes is scored again in the
background with its frames reversed, its frames shuffled (seeded), or another task's instruction of
the same run. A reward model that ignores time order or the instruction shows margins near 0 and
inversions here before a policy exploits it. Lower priority than real work: a probe starts after its
episode's answer, only while nobody waits for the backend and `reserve_slots` slots stay free, at
most `max_in_flight` at once; otherwise it is dropped and counted. Never an episode: its audit
line is of kind `probe`, and it never enters the agreement window."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import random
from typing import TYPE_CHECKING, Any

from proxy.audit import AuditLog
from proxy.config import ProbesConfig
from proxy.errors import ProxyError
from proxy.media.encode import EncodedFrames
from proxy.metrics import Metrics
from proxy.protocol.score import ScoreRequest
from proxy.quality.monitor import QualityMonitor, quality_key
from proxy.upstream.backends import Backend

if TYPE_CHECKING:
    from proxy.pipelines.scoring import Scorer

__all__ = ["InvarianceProbes"]

log = logging.getLogger(__name__)
MAX_RUNS, MAX_TASKS_PER_RUN = 64, 64  # instructions remembered for the `instruction` probe


def reversed_frames(frames: EncodedFrames) -> EncodedFrames:
    """The episode played backwards: frames and the first/last stills swapped end for end (a second
    camera's video too)."""
    return dataclasses.replace(frames, jpegs=frames.jpegs[::-1], indices=frames.indices[::-1],
                               stills=frames.stills[::-1], extra=frames.extra and reversed_frames(frames.extra))


def shuffled_frames(frames: EncodedFrames, seed: str) -> tuple[EncodedFrames, list[int]]:
    """The frames in a seeded random order (never the original order when there are 2 or more);
    the stills stay the episode's first and last frame."""
    order = list(range(len(frames.jpegs)))
    rng = random.Random(seed)
    while len(order) > 1 and order == sorted(order):
        rng.shuffle(order)
    extra = frames.extra and dataclasses.replace(frames.extra, jpegs=[frames.extra.jpegs[i] for i in order],
                                                 indices=[frames.extra.indices[i] for i in order])
    return dataclasses.replace(frames, jpegs=[frames.jpegs[i] for i in order],
                               indices=[frames.indices[i] for i in order], extra=extra), order


class InvarianceProbes:
    def __init__(self, scorer: Scorer, config: ProbesConfig, monitor: QualityMonitor, metrics: Metrics,
                 audit: AuditLog) -> None:
        self.scorer, self.config, self.monitor, self.metrics, self.audit = scorer, config, monitor, metrics, audit
        self.sample = random.Random(config.seed)  # which episodes are probed: reproducible per seed
        self.instructions: dict[str | None, dict[str, str]] = {}  # run -> task -> its instruction
        self.in_flight = 0
        self.tasks: set[asyncio.Task] = set()

    def after(self, request: ScoreRequest, backend: Backend, metadata: dict[str, Any] | None, score: float,
              frames: EncodedFrames) -> None:
        """Called with each scored episode (its answer is ready): maybe start its probes."""
        key = quality_key(backend.name, request.task_text, metadata)
        self._remember(key, request.task_text)
        if (self.config.fraction == 0 or (metadata or {}).get("env_success") is None
                or key not in self.monitor.windows or self.sample.random() >= self.config.fraction):
            return
        for kind in self.config.kinds:
            if self.in_flight >= self.config.max_in_flight:
                self.metrics.quality_probes.labels(backend.name, kind, "dropped_cap").inc()
            elif not self._has_room(backend):
                self.metrics.quality_probes.labels(backend.name, kind, "dropped_busy").inc()
            else:
                self.in_flight += 1
                task = asyncio.get_running_loop().create_task(
                    self._probe(kind, key, request, backend, metadata, score, frames))
                self.tasks.add(task)
                task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self.in_flight -= 1

    def _has_room(self, backend: Backend) -> bool:
        pool = backend.pool
        if pool.waiting:
            return False
        cap = pool.admission.max_in_flight_per_endpoint
        free = sum(max(0, cap - e.in_flight) for e in pool.endpoints if e.rotation() == "ready")
        return free > self.config.reserve_slots

    def _remember(self, key: tuple, task_text: str) -> None:
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

    async def _probe(self, kind: str, key: tuple, request: ScoreRequest, backend: Backend,
                     metadata: dict[str, Any] | None, original: float, frames: EncodedFrames) -> None:
        run, name, task = key
        described: dict[str, Any] = {"probe": kind, "run": run, "task_id": task,
                                     "episode_id": (metadata or {}).get("episode_id"), "original_score": original}
        variant, probe_request = frames, request
        if kind == "reversed":
            variant = reversed_frames(frames)
        elif kind == "shuffled":
            seed = f"{self.config.seed}:{hashlib.sha256(b''.join(frames.jpegs)).hexdigest()[:16]}"
            variant, order = shuffled_frames(frames, seed)
            described.update(seed=seed, order=order)
        else:
            other = next((text for other_task, text in sorted(self.instructions.get(run, {}).items())
                          if other_task != task and text != request.task_text), None)
            if other is None:
                self.metrics.quality_probes.labels(name, kind, "no_other_task").inc()
                return
            probe_request = request.model_copy(update={"task_text": other})
            described["other_task"] = other
        try:
            # one attempt's time: a probe is not worth the retry policy's deadline
            answer = await self.scorer.score(probe_request, admit=False, encoded=variant, probe=described,
                                             budget_s=backend.config.retry.timeout_s)
        except ProxyError as err:
            self.metrics.quality_probes.labels(name, kind, err.code).inc()
            return
        except Exception:  # a probe must never take the proxy down: logged, counted
            log.exception("invariance probe %s of %s failed", kind, key)
            self.metrics.quality_probes.labels(name, kind, "internal_error").inc()
            return
        self.metrics.quality_probes.labels(name, kind, "scored").inc()
        self.monitor.observe_probe(key, kind, original, answer.score)

    async def close(self) -> None:
        """At shutdown: probes in flight are cancelled (they are never anyone's answer)."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
