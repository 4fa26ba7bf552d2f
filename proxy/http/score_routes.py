"""The scoring routes: POST /score, /score/batch, /score/dense, /compare and /compare/batch — thin
handlers over the pipelines (proxy/pipelines/) — and GET /frame-rules, what a client
needs to send frames the proxy forwards as they are."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from proxy.http.deps import ALWAYS, ServicesDep, budget_of
from proxy.http.error_answers import error_answers
from proxy.http.json_body import JSONBodyRoute
from proxy.http.run_access import check_writes, raw_run
from proxy.pipelines import scoring
from proxy.pipelines.batch import check_batch_size
from proxy.pipelines.cascade import decode_stage
from proxy.pipelines.compare import Comparer
from proxy.pipelines.dense import score_dense
from proxy.prompting.request import frame_rules_of
from proxy.protocol.common import EpisodeMetadata
from proxy.protocol.compare import BatchCompareRequest, BatchCompareResponse, CompareRequest, CompareResponse
from proxy.protocol.dense import DenseRequest, DenseResponse
from proxy.protocol.score import BatchScoreRequest, BatchScoreResponse, ScoreRequest, ScoreResponse
from vlm_protocol.wire import FRAME_RULES_PATH

__all__ = ["router"]

router = APIRouter(route_class=JSONBodyRoute)


@router.get(FRAME_RULES_PATH, responses=error_answers(*ALWAYS))
async def frame_rules(services: ServicesDep) -> JSONResponse:
    """Each chat backend's frame rules (vlm_protocol/frame_rules.py) under its name, with the labels
    a request's `backend` may use for it; `default` is the backend a request without one gets."""
    registry = services.registry
    chat = registry.of_kind("chat")
    listed = {b.name: {**frame_rules_of(b.name, b.config).to_dict(), "labels": b.labels} for b in chat}
    for name, cascade in registry.cascades.items():  # one decode serves every stage: the decoding stage's rules
        decoder = decode_stage([registry.resolve(stage.backend) for stage in cascade.stages])
        listed[name] = {**frame_rules_of(name, decoder.config).to_dict(), "labels": [name, *cascade.aliases]}
    return JSONResponse({"default": chat[0].name if chat else None, "backends": listed})


@router.post("/score", response_model=ScoreResponse,
             responses=error_answers(*ALWAYS, 403, 404, 409, 413, 422, 429, 502, 504))
async def score_route(body: ScoreRequest, request: Request, services: ServicesDep) -> ScoreResponse:
    check_writes(request, [("metadata.run", _run(body.metadata))])
    result = await scoring.score_episode(services, body, scoring.SCORE, budget_s=budget_of(request))
    request.state.backend = result.backend
    return result


@router.post("/score/batch", response_model=BatchScoreResponse, responses=error_answers(*ALWAYS, 403, 413, 422))
async def score_batch(body: BatchScoreRequest, request: Request, services: ServicesDep) -> JSONResponse:
    check_batch_size(len(body.items), services.settings.proxy.max_batch_items)
    check_writes(request, ((f"items[{i}].metadata.run", raw_run(item)) for i, item in enumerate(body.items)))
    return _batch_answer(request, await scoring.score_batch(services, body.items, budget_s=budget_of(request)))


@router.post("/score/dense", response_model=DenseResponse,
             responses=error_answers(*ALWAYS, 403, 404, 409, 413, 422, 429, 502, 504))
async def score_dense_route(body: DenseRequest, request: Request, services: ServicesDep) -> DenseResponse:
    """One episode's progress curve: `points` prefixes (or `prefix_ends`) scored concurrently, one call each."""
    check_writes(request, [("metadata.run", _run(body.metadata))])
    result = await score_dense(services, body, budget_s=budget_of(request))
    request.state.backend = result.backend
    return result


def _run(metadata: EpisodeMetadata | None) -> str | None:
    return metadata.run if metadata is not None else None


def _episodes(item: object) -> list[object]:
    """A /compare/batch item's episodes as sent; one that is not a list holds none (its item's 422 follows)."""
    episodes = item.get("episodes") if isinstance(item, dict) else None
    return episodes if isinstance(episodes, list) else []


def _batch_answer(request: Request, results: list[dict]) -> JSONResponse:
    backends = {r["result"]["backend"] for r in results if r["ok"]}
    request.state.backend = backends.pop() if len(backends) == 1 else ("mixed" if backends else "none")
    ok = sum(r["ok"] for r in results)
    return JSONResponse({"results": results, "summary": {"ok": ok, "failed": len(results) - ok}})


async def _comparer(request: Request) -> Comparer:
    return request.app.state.comparer


ComparerDep = Annotated[Comparer, Depends(_comparer)]


@router.post("/compare", response_model=CompareResponse,
             responses=error_answers(*ALWAYS, 403, 404, 413, 422, 429, 502, 504))
async def compare(body: CompareRequest, request: Request, comparer: ComparerDep) -> CompareResponse:
    """Two episodes of one task → RL-VLM-F's label: 0 the first is better, 1 the second, -1 no preference."""
    check_writes(request, ((f"episodes[{j}].metadata.run", _run(e.metadata)) for j, e in enumerate(body.episodes)))
    result = await comparer.compare(body, budget_s=budget_of(request))
    request.state.backend = result.backend
    return result


@router.post("/compare/batch", response_model=BatchCompareResponse, responses=error_answers(*ALWAYS, 403, 413, 422))
async def compare_batch(body: BatchCompareRequest, request: Request, comparer: ComparerDep) -> JSONResponse:
    check_batch_size(len(body.items), request.app.state.settings.proxy.max_batch_items)
    check_writes(request, ((f"items[{i}].episodes[{j}].metadata.run", raw_run(episode))
                           for i, item in enumerate(body.items)
                           for j, episode in enumerate(_episodes(item))))
    return _batch_answer(request, await comparer.compare_batch(body.items, budget_s=budget_of(request)))
