"""The progress routes (docs/progress.md): POST /progress/batch, and the reference store's
POST and GET /progress/references. Adding demonstrations changes training rewards for good (they
are never evicted), so it takes only the admin key, as the admin routes do (proxy/http/admin_access.py)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from proxy.http.admin_access import ADMIN_403, AdminOnly
from proxy.http.deps import ALWAYS, budget_of
from proxy.http.error_answers import error_answers
from proxy.http.json_body import JSONBodyRoute
from proxy.http.run_access import check_writes, runs_of, visible_store
from proxy.pipelines.batch import check_batch_size
from proxy.progress.pipeline import ProgressScorer
from proxy.protocol.progress import ProgressBatchRequest, ProgressBatchResponse, ReferencesRequest, ReferencesResponse

__all__ = ["router"]

router = APIRouter(route_class=JSONBodyRoute)


async def _progress(request: Request) -> ProgressScorer:
    return request.app.state.progress


ProgressDep = Annotated[ProgressScorer, Depends(_progress)]


@router.post("/progress/batch", response_model=ProgressBatchResponse,
             responses=error_answers(*ALWAYS, 403, 404, 413, 422, 429, meanings={
                 422: "the whole request: its shape (any item, either camera: a field the schema refuses, a cap "
                      "on a request field, an extra_view the backend does not place or misses, two items of one "
                      "task embedded differently); `field` names it. What only reading an item's media finds, "
                      "in its main view or its extra_view alike (frames that do not decode, a file not there or "
                      "not allowed, too many frames, two views of different lengths), is that item's own status "
                      "inside the 200, and fails its task's other items (progress_group_failed)"}))
async def progress_batch(body: ProgressBatchRequest, request: Request, progress: ProgressDep) -> JSONResponse:
    """Per task, each failure's progress toward the task's successes (SRPO); successes are 1. One rule for
    both cameras: the request's shape is checked whole (a 422 for the request), each item's media when it is
    read (that item's status inside the 200, and its task's)."""
    check_batch_size(len(body.items), request.app.state.settings.proxy.max_batch_items)
    named = [(f"items[{i}].metadata.run", item.metadata.run if item.metadata else None)
             for i, item in enumerate(body.items)]
    if progress.store is not None and (body.use_reference_store or body.remember_successes):
        # The namespace whose references this request reads and adds to: the caller's own run's only.
        named.append(("reference_namespace", body.reference_namespace))
    check_writes(request, named)
    answer = await progress.progress_batch(body, budget_s=budget_of(request))
    request.state.backend = progress.services.registry.resolve(body.backend, kind="embedding").name
    return JSONResponse(answer)


@router.post("/progress/references", response_model=ReferencesResponse, dependencies=[AdminOnly],
             responses=error_answers(*ALWAYS, 403, 404, 409, 413, 422, 429, 502, 503, 504, meanings={
                 401: "missing or wrong bearer token (this route takes the admin key)", 403: ADMIN_403,
                 409: "reference_mismatch: the task's stored vectors have another size; reference_store_full: it "
                      "holds max_demonstrations already; reference_keys_full: a new task or namespace while the "
                      "store holds reference_store.max_keys"}))
async def add_references(body: ReferencesRequest, request: Request, progress: ProgressDep) -> ReferencesResponse:
    """Demonstrations of one task, kept as references (all of them, or none on an error)."""
    check_batch_size(len(body.items), request.app.state.settings.proxy.max_batch_items)
    answer = await progress.add_references(body, budget_s=budget_of(request))
    request.state.backend = answer.backend
    return answer


@router.get("/progress/references", responses=error_answers(*ALWAYS))
async def references(request: Request, progress: ProgressDep) -> dict[str, Any]:
    """What the reference store holds per task (null when none is configured); a key limited to some
    runs sees only their namespaces."""
    return {"store": visible_store(runs_of(request), progress.store.status() if progress.store is not None else None)}
