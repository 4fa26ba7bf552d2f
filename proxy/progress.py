"""POST /progress/batch: episodes → embeddings → SRPO progress per task (docs/progress.md).

Every item is checked before anything is embedded, then every episode is embedded concurrently.
Per task, the successes (and the task's stored references) are the reference set; the failures'
progress comes from proxy/progress_math.py. What can never become a number: a task whose failures
have no reference (outcome no_reference, progress null), and a task one of whose episodes failed
to embed (every item of it fails: the reference set or the normalisation would silently differ).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any

import numpy as np

from proxy.backends import Backend
from proxy.embedding import Embedded, Embedder
from proxy.errors import InvalidRequest, ProgressGroupFailed, ProxyError, UpstreamProtocolError
from proxy.progress_math import METHOD, srpo_progress
from proxy.progress_schemas import (
    ProgressBatchRequest,
    ProgressReference,
    ProgressResult,
    ReferencesRequest,
    ReferencesResponse,
)
from proxy.reference_store import ReferenceStore
from proxy.schemas import ScoreRequest

__all__ = ["ProgressScorer"]

log = logging.getLogger(__name__)
Outcome = ProgressResult | ProxyError


def _task_key(task_id: Any) -> str:
    return str(task_id)  # 3 and "3" are one task (the store's file names are text too)


class ProgressScorer:
    def __init__(self, embedder: Embedder, store: ReferenceStore | None) -> None:
        self.embedder = embedder
        self.store = store

    @property
    def _scorer(self):
        return self.embedder.scorer

    def _backend(self, label: str | None, items: list[ScoreRequest]) -> Backend:
        """The embedding backend, every item checked against it (nothing is embedded before)."""
        registry = self._scorer.registry
        backend = registry.resolve(label, kind="embedding")
        for index, item in enumerate(items):
            if item.backend is not None and registry.resolve(item.backend, field=f"items[{index}].backend",
                                                             kind=None) is not backend:
                raise InvalidRequest(f"items[{index}].backend names another backend than the request's "
                                     f"({backend.name}): one request, one embedding space",
                                     field=f"items[{index}].backend")
            self.embedder.check(item, backend, where=f"items[{index}].")
        return backend

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

        backend.pool.check_admission()  # the batch is admitted as a whole
        self._scorer.metrics.in_flight.labels(backend.name).inc()
        try:
            return list(await asyncio.gather(*(one(i, item) for i, item in enumerate(items))))
        finally:
            self._scorer.metrics.in_flight.labels(backend.name).dec()

    async def progress_batch(self, body: ProgressBatchRequest, *, budget_s: float | None) -> dict[str, Any]:
        items = body.items
        for index, item in enumerate(items):
            for key in ("task_id", "env_success"):
                if item.metadata is None or getattr(item.metadata, key) is None:
                    raise InvalidRequest(f"items[{index}].metadata.{key} is required: progress is measured per "
                                         "task against the task's successes", field=f"items[{index}].metadata.{key}")
        backend = self._backend(body.backend, items)
        embedded = await self._embed_all(backend, items, budget_s)
        tasks: dict[str, list[int]] = defaultdict(list)
        for index, item in enumerate(items):
            tasks[_task_key(item.metadata.task_id)].append(index)
        outcomes: dict[int, Outcome] = {}

        def measure() -> None:  # clustering 256 x 3584 takes ~0.1 s of CPU: off the event loop
            for task, indices in tasks.items():
                outcomes.update(self._task_outcomes(backend, task, indices, items, embedded, body.use_reference_store))

        await asyncio.to_thread(measure)
        results = [self._answer(backend, i, items[i], embedded[i], outcomes[i], body.include_embeddings)
                   for i in range(len(items))]
        if self.store is not None and body.remember_successes:
            await self._remember(backend, tasks, items, embedded, outcomes)
        counts = {kind: sum(1 for o in outcomes.values() if isinstance(o, ProgressResult) and o.outcome == kind)
                  for kind in ("success", "progress", "no_reference")}
        ok = sum(r["ok"] for r in results)
        return {"results": results, "summary": {"ok": ok, "failed": len(results) - ok, **counts, "tasks": len(tasks)},
                "method": METHOD}

    def _task_outcomes(self, backend: Backend, task: str, indices: list[int], items: list[ScoreRequest],
                       embedded: list[Embedded | ProxyError], use_store: bool) -> dict[int, Outcome]:
        broken = [i for i in indices if isinstance(embedded[i], ProxyError)]
        if broken:
            first = embedded[broken[0]]
            group = ProgressGroupFailed(
                f"episode {broken[0]} of task {task!r} failed ({first.code}: {first.message[:200]}); a task's "
                "progress needs every one of its episodes", task_id=task, failed_index=broken[0])
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
                stored = self.store.references(backend.config.model, task, stored.shape[1])
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

    def _answer(self, backend: Backend, index: int, item: ScoreRequest, embedded: Embedded | ProxyError,
                outcome: Outcome, include_vector: bool) -> dict[str, Any]:
        """The item's answer; its audit line and metrics on the way."""
        scorer = self._scorer
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
            scorer.metrics.progress_episodes.labels(backend.name, outcome.code).inc()
            scorer.audit.write({**record, "error": {"code": outcome.code, "message": outcome.message}})
            return {"index": index, "ok": False, "status": outcome.status_code, "error": outcome.to_dict()}
        scorer.metrics.progress_episodes.labels(backend.name, outcome.outcome).inc()
        if outcome.outcome == "progress":
            scorer.metrics.progress.labels(backend.name).observe(outcome.progress)
        result = outcome.model_dump(mode="json")
        scorer.audit.write({**record, **{k: result[k] for k in ("outcome", "progress", "distance",
                                                                "normalised_distance", "reference")}})
        if include_vector:
            result["embedding"]["vector"] = embedded.vector.tolist()
        return {"index": index, "ok": True, "status": 200, "result": result}

    async def _remember(self, backend: Backend, tasks: dict[str, list[int]], items: list[ScoreRequest],
                        embedded: list[Embedded | ProxyError], outcomes: dict[int, Outcome]) -> None:
        """The batch's successes join their task's references (after this batch was answered with them)."""
        for task, indices in tasks.items():
            vectors = [embedded[i].vector for i in indices
                       if isinstance(outcomes[i], ProgressResult) and outcomes[i].outcome == "success"]
            if vectors:
                try:
                    await asyncio.to_thread(self.store.add_successes, backend.config.model, task, vectors)
                except (ProxyError, OSError) as err:  # the answer stands; the store says why it did not keep them
                    log.warning("reference store: successes of task %r not kept: %s", task, err)

    async def add_references(self, body: ReferencesRequest, *, budget_s: float | None) -> ReferencesResponse:
        if self.store is None:
            raise InvalidRequest("no reference store is configured (proxy.reference_store)", field="task_id")
        backend = self._backend(body.backend, body.items)
        embedded = await self._embed_all(backend, body.items, budget_s)
        for err in embedded:
            if isinstance(err, ProxyError):
                raise err  # all or nothing: a demonstration set is added whole
        total = await asyncio.to_thread(self.store.add_demonstrations, backend.config.model,
                                        _task_key(body.task_id), [e.vector for e in embedded])
        return ReferencesResponse(backend=backend.name, model=backend.config.model, task_id=body.task_id,
                                  added=len(embedded), demonstrations=total)
