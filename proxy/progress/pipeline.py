"""POST /progress/batch: episodes → embeddings → SRPO progress per task (docs/progress.md).

Every item is checked before anything is embedded, then every episode is embedded concurrently.
Per task, the successes (and the task's stored references) are the reference set; the failures'
progress comes from proxy/progress/math.py. What can never become a number: a task whose failures
have no reference (outcome no_reference, progress null), and a task one of whose episodes failed
to embed (every item of it fails: the reference set or the normalisation would silently differ).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import defaultdict
from dataclasses import asdict
from typing import Any

import numpy as np

from proxy.errors import InvalidRequest, ProgressGroupFailed, ProxyError, UpstreamProtocolError
from proxy.media.decode import FrameLimits
from proxy.pipelines.envelope import PROGRESS, REFERENCES, Envelope
from proxy.pipelines.services import Services
from proxy.progress.embedding import Embedded, Embedder
from proxy.progress.math import METHOD, srpo_progress
from proxy.progress.reference_store import ReferenceStore, StoreKey
from proxy.protocol.progress import (
    ProgressBatchRequest,
    ProgressReference,
    ProgressResult,
    ReferencesRequest,
    ReferencesResponse,
)
from proxy.protocol.score import ScoreRequest
from proxy.upstream.backends import Backend
from vlm_protocol.progress import task_key

__all__ = ["ProgressScorer"]

log = logging.getLogger(__name__)
Outcome = ProgressResult | ProxyError


class ProgressScorer:
    def __init__(self, services: Services, store: ReferenceStore | None) -> None:
        self.services = services
        self.embedder = Embedder(services)
        self.store = store

    def _backend(self, label: str | None, items: list[ScoreRequest]) -> tuple[Backend, list[str]]:
        """The embedding backend and each item's embedding space, every item checked against it
        (nothing is embedded before)."""
        registry = self.services.registry
        backend = registry.resolve(label, kind="embedding")
        spaces = []
        for index, item in enumerate(items):
            if item.backend is not None and registry.resolve(item.backend, field=f"items[{index}].backend",
                                                             kind=None) is not backend:
                raise InvalidRequest(f"items[{index}].backend names another backend than the request's "
                                     f"({backend.name}): one request, one embedding space",
                                     field=f"items[{index}].backend")
            limits, _ = self.embedder.check(item, backend, where=f"items[{index}]")
            spaces.append(self._space(backend, item, limits))
        return backend, spaces

    def _space(self, backend: Backend, item: ScoreRequest, limits: FrameLimits) -> str:
        """What decides a vector besides the episode: vectors of two spaces are never compared,
        stored together or normalised together. Not the frame count: a short episode has fewer
        frames than nframes (and a client that samples sends nframes = the frames it picked)."""
        cfg = backend.config
        fps = cfg.frames.presentation_fps
        sizing = {k: v for k, v in asdict(limits).items() if k not in ("nframes", "max_inline_frames",
                                                                         "max_source_pixels")}
        what = {"layout": cfg.layout, "request_mm_kwargs": cfg.request_mm_kwargs, "sizing": sizing,
                "prompt": self.services.prompts.get(cfg.prompt).sha256 if cfg.prompt else None,
                "fps": (item.video_fps or cfg.frames.default_video_fps) if fps == "seed" else fps,
                # a second camera makes other vectors (absent on one camera: stored spaces keep their keys)
                **({"extra_view": cfg.frames.extra_view} if cfg.frames.extra_view else {})}
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]

    @staticmethod
    def _one_space_per_task(tasks: dict[str, list[int]], spaces: list[str]) -> None:
        for task, indices in tasks.items():
            other = next((i for i in indices if spaces[i] != spaces[indices[0]]), None)
            if other is not None:
                raise InvalidRequest(f"items[{indices[0]}] and items[{other}] of task {task!r} would be embedded "
                                     "differently (max_pixels or video_fps): one task, one embedding space",
                                     field=f"items[{other}]")

    async def _embed_all(self, backend: Backend, items: list[ScoreRequest],
                         budget_s: float | None) -> list[Embedded | ProxyError]:
        async def one(index: int, item: ScoreRequest) -> Embedded | ProxyError:
            try:
                return await self.embedder.embed(item, backend, budget_s=budget_s)
            except ProxyError as err:
                return err
            except Exception as err:  # noqa: BLE001 - one broken item is that item's (and its task's) error
                log.exception("progress item %d failed unexpectedly", index)
                return ProxyError(f"internal error: {type(err).__name__}")

        return list(await asyncio.gather(*(one(i, item) for i, item in enumerate(items))))

    async def progress_batch(self, body: ProgressBatchRequest, *, budget_s: float | None) -> dict[str, Any]:
        items = body.items
        for index, item in enumerate(items):
            for key in ("task_id", "env_success"):
                if item.metadata is None or getattr(item.metadata, key) is None:
                    raise InvalidRequest(f"items[{index}].metadata.{key} is required: progress is measured per "
                                         "task against the task's successes", field=f"items[{index}].metadata.{key}")
        backend, spaces = self._backend(body.backend, items)
        tasks: dict[str, list[int]] = defaultdict(list)
        for index, item in enumerate(items):
            tasks[task_key(item.metadata.task_id)].append(index)
        self._one_space_per_task(tasks, spaces)
        keys = {task: StoreKey(backend.config.model, spaces[indices[0]], body.reference_namespace or "", task)
                for task, indices in tasks.items()}
        used = self.store is not None and body.use_reference_store
        at_start = {task: self.store.count(key) if used else 0 for task, key in keys.items()}
        with Envelope(self.services, PROGRESS, backend.name, kind="embedding") as envelope:  # admitted as a whole
            answer = await self._measure(envelope, body, keys, tasks, budget_s)
        return {**answer, "references": {"namespace": body.reference_namespace or "", "store": used,
                                         "at_start": at_start, "total_at_start": sum(at_start.values())}}

    async def _measure(self, envelope: Envelope, body: ProgressBatchRequest, keys: dict[str, StoreKey],
                       tasks: dict[str, list[int]], budget_s: float | None) -> dict[str, Any]:
        backend, items = envelope.backend, body.items
        embedded = await self._embed_all(backend, items, budget_s)
        outcomes: dict[int, Outcome] = {}

        def measure() -> None:  # clustering 256 x 3584 takes ~0.1 s of CPU: off the event loop
            for task, indices in tasks.items():
                try:
                    outcomes.update(self._task_outcomes(backend, keys[task], indices, items, embedded,
                                                         body.use_reference_store))
                except Exception as err:  # noqa: BLE001 - a bug fails its task, not every task of the request
                    log.exception("progress of task %r failed unexpectedly", task)
                    failure = ProxyError(f"internal error: {type(err).__name__}")
                    outcomes.update({i: failure for i in indices})

        await asyncio.to_thread(measure)
        results = [self._answer(envelope, i, items[i], embedded[i], outcomes[i], body.include_embeddings)
                   for i in range(len(items))]
        not_remembered = []
        if self.store is not None and body.remember_successes:
            not_remembered = await self._remember(keys, tasks, embedded, outcomes)
        counts = {kind: sum(1 for o in outcomes.values() if isinstance(o, ProgressResult) and o.outcome == kind)
                  for kind in ("success", "progress", "no_reference")}
        ok = sum(r["ok"] for r in results)
        return {"results": results, "summary": {"ok": ok, "failed": len(results) - ok, **counts, "tasks": len(tasks)},
                "method": METHOD, "not_remembered": not_remembered}

    def _task_outcomes(self, backend: Backend, key: StoreKey, indices: list[int], items: list[ScoreRequest],
                       embedded: list[Embedded | ProxyError], use_store: bool) -> dict[int, Outcome]:
        task = key.task
        broken = [i for i in indices if isinstance(embedded[i], ProxyError)]
        if broken:
            group = ProgressGroupFailed.of(embedded[broken[0]], task, broken[0])
            return {i: embedded[i] if i in broken else group for i in indices}
        vectors = {i: embedded[i].vector for i in indices}
        dims = {len(v) for v in vectors.values()}
        if len(dims) > 1:  # replicas serving different checkpoints under one name
            err = UpstreamProtocolError(f"the embeddings of task {task!r} have different sizes {sorted(dims)}: "
                                        f"the replicas of {backend.name!r} serve different models")
            return {i: err for i in indices}
        successes = [i for i in indices if items[i].metadata.env_success]
        failures = [i for i in indices if not items[i].metadata.env_success]
        stored = np.empty((0, dims.pop()))
        if failures and use_store and self.store is not None:
            try:
                stored = self.store.references(key, stored.shape[1])
            except ProxyError as err:
                return {i: err for i in indices}
        outcomes: dict[int, Outcome] = {i: self._result(items[i], embedded[i], "success", 1.0) for i in successes}
        references = np.vstack([*(vectors[i][None] for i in successes), stored])
        if failures and not len(references):
            outcomes.update({i: self._result(items[i], embedded[i], "no_reference", None) for i in failures})
        elif failures:
            measured = srpo_progress(references, np.stack([vectors[i] for i in failures]))
            reference = ProgressReference(batch_successes=len(successes), stored=len(stored),
                                          centres=measured.centres, clustered=measured.clustered,
                                          failures=len(failures))
            for k, i in enumerate(failures):
                outcomes[i] = self._result(items[i], embedded[i], "progress", float(measured.progress[k]),
                                           distance=float(measured.distance[k]),
                                           normalised_distance=float(measured.normalised[k]), reference=reference)
        return outcomes

    @staticmethod
    def _result(item: ScoreRequest, embedded: Embedded, outcome: str, progress: float | None,
                **measured: Any) -> ProgressResult:
        return ProgressResult(task_id=item.metadata.task_id, env_success=bool(item.metadata.env_success),
                              outcome=outcome, progress=progress, embedding=embedded.info, **measured)

    def _answer(self, envelope: Envelope, index: int, item: ScoreRequest, embedded: Embedded | ProxyError,
                outcome: Outcome, include_vector: bool) -> dict[str, Any]:
        """The item's answer; its audit line and metrics on the way."""
        backend = envelope.backend
        record: dict[str, Any] = {
            "kind": "progress", "backend": backend.name, "task_text": item.task_text,
            "metadata": item.metadata.model_dump(exclude_none=True)}
        if isinstance(embedded, Embedded):
            info = embedded.info
            record.update(frames=info.frames.model_dump(include={"count", "requested", "indices", "size", "fps",
                                                                 "sampled_fps", "vision_tokens", "sha256"}),
                          frame_store=embedded.frame_store, endpoint=info.endpoint, usage=info.usage,
                          attempts=info.attempts, timings_ms=info.timings_ms)
        if isinstance(outcome, ProxyError):
            envelope.failed(outcome, record)
            return {"index": index, "ok": False, "status": outcome.status_code, "error": outcome.to_dict()}
        if outcome.outcome == "progress":
            self.services.metrics.progress.labels(backend.name).observe(outcome.progress)
        result = outcome.model_dump(mode="json")
        envelope.done({**record, **{k: result[k] for k in ("outcome", "progress", "distance", "normalised_distance",
                                                            "reference")}}, outcome.outcome)
        if include_vector:
            result["embedding"]["vector"] = embedded.vector.tolist()
        return {"index": index, "ok": True, "status": 200, "result": result}

    async def _remember(self, keys: dict[str, StoreKey], tasks: dict[str, list[int]],
                        embedded: list[Embedded | ProxyError], outcomes: dict[int, Outcome]) -> list[dict[str, Any]]:
        """The batch's successes join their task's references (after this batch was answered with them).
        A task whose successes the store cannot keep (full of keys, a disk error) keeps its answers, which
        are right for this batch, and is named in the answer's `not_remembered`, the log and a metric."""
        not_remembered = []
        for task, indices in tasks.items():
            kept = [i for i in indices if isinstance(outcomes[i], ProgressResult) and outcomes[i].outcome == "success"]
            if not kept:
                continue
            try:
                await asyncio.to_thread(self.store.add_successes, keys[task], [embedded[i].vector for i in kept])
            except (ProxyError, OSError) as err:
                code = err.code if isinstance(err, ProxyError) else "os_error"
                log.warning("reference store: successes of task %r not kept: %s", task, err)
                self.services.metrics.reference_refusals.labels(code, "/progress/batch").inc(len(kept))
                not_remembered.append({"task_id": outcomes[kept[0]].task_id, "successes": len(kept), "code": code,
                                       "message": str(err)})
        return not_remembered

    async def add_references(self, body: ReferencesRequest, *, budget_s: float | None) -> ReferencesResponse:
        if self.store is None:
            raise InvalidRequest("no reference store is configured (proxy.reference_store)")
        backend, spaces = self._backend(body.backend, body.items)
        task = task_key(body.task_id)
        self._one_space_per_task({task: list(range(len(spaces)))}, spaces)
        with Envelope(self.services, REFERENCES, backend.name, kind="embedding"):  # admitted as a whole
            embedded = await self._embed_all(backend, body.items, budget_s)
        for err in embedded:
            if isinstance(err, ProxyError):
                raise err  # all or nothing: a demonstration set is added whole
        key = StoreKey(backend.config.model, spaces[0], body.reference_namespace or "", task)
        try:
            added, total = await asyncio.to_thread(self.store.add_demonstrations, key, [e.vector for e in embedded])
        except ProxyError as err:
            self.services.metrics.reference_refusals.labels(err.code, "/progress/references").inc(len(embedded))
            raise
        return ReferencesResponse(backend=backend.name, model=backend.config.model, task_id=body.task_id,
                                  added=added, demonstrations=total)
