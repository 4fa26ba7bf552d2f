"""POST /progress/batch (reward_source: progress, docs/progress.md): its wire shape and the one call.

    request  {"backend"?, "items": [{task_text, frames_npy | video_path, fps, nframes, max_pixels,
                                     metadata: {task_id, env_success, ...}}, ...]}
    answer   200 {"results": [{"index", "ok": true, "status", "result": {"task_id", "env_success",
                               "outcome", "progress", ...}} | {"index", "ok": false, "status", "error"}],
                  "summary", "method"}

A task's progress depends on every episode of that task in the request (its successes are the
reference, its failures are normalised against each other), so a task is never split: whole
tasks are packed into requests of at most DEFAULT_MAX_BATCH_BYTES. The HTTP call is the transport
core's (retries, deadline, error typing). An item's error is final: sending part of a task again
would change the other episodes' numbers. An answer that is not this shape fails every item of its
request, and an item that is not a valid result fails alone — never a made-up progress. The
failure policy (`fallback`) applies as in the scheduler, once per episode.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import replace
from typing import Any

from rlinf_client import _constants as C
from rlinf_client._base_client import ScoreRequestBody, TransportCore, build_request_body_async, retry_delay
from rlinf_client._batch import batch_body
from rlinf_client._config import RewardModelConfig
from rlinf_client._exceptions import (
    APIResponseValidationError,
    EpisodeMetadataError,
    FramesError,
    RewardAPIError,
    RewardClientError,
    make_status_error,
)
from rlinf_client._types import OUTCOMES, ClientStats, Episode, EpisodeProgress
from vlm_protocol.progress import task_key

__all__ = ["progress_episodes"]

log = logging.getLogger("rlinf_client")

# A /progress/batch item is a /score body without what an embedding backend refuses (backend_kwargs)
# or takes request-wide here (backend: one request, one embedding space). A second camera
# (extra_view) goes along: the backend's frames.extra_view places it, or the proxy refuses it.
ITEM_FIELDS = frozenset({"task_text", "frames", "frames_npy", "video_path", "fps", "video_fps", "nframes",
                         "max_pixels", "metadata", "extra_view"})

Outcome = dict[str, Any] | RewardClientError  # an item's validated result, or its error


async def progress_episodes(core: TransportCore, stats: ClientStats, episodes: list[Episode]) -> list[EpisodeProgress]:
    """Every episode's progress, in input order, within one `timeout`; with fallback: raise, the
    first failure (in input order) is raised once every request has been answered."""
    if not episodes:
        return []
    cfg = core.cfg
    task_keys = [_task_key(index, episode) for index, episode in enumerate(episodes)]
    started = time.perf_counter()
    deadline = time.monotonic() + cfg.timeout
    outcomes: list[Outcome | None] = [None] * len(episodes)
    attempts = [0] * len(episodes)
    short: list[dict[str, Any] | None] = [None] * len(episodes)  # what the frame buffer's stride left out
    for wave in _waves(task_keys):  # at most MAX_BODIES_IN_MEMORY bodies alive (a bigger task alone)
        bodies: list = [None] * len(episodes)
        for index, body in zip(wave, await _build_all([episodes[i] for i in wave], cfg), strict=True):
            bodies[index] = body
            short[index] = getattr(body, "frames_short", None)
        try:
            _fail_tasks_without_all_bodies(bodies, task_keys, outcomes)
            requests = _pack([i for i in wave if outcomes[i] is None], task_keys, bodies)
            await asyncio.gather(*(_send(core, episodes, bodies, indices, task_keys, deadline, outcomes, attempts)
                                   for indices in requests))
        finally:
            for body in bodies:
                if isinstance(body, ScoreRequestBody):
                    body.discard(cfg.keep_temp_video)
    latency_ms = (time.perf_counter() - started) * 1e3
    results = [_settle(cfg, episode, outcome, n, latency_ms, fewer)  # type: ignore[arg-type]
               for episode, outcome, n, fewer in zip(episodes, outcomes, attempts, short, strict=True)]
    for result in results:
        stats.record(result)
    if cfg.failure_policy == "raise":
        failed = next((r for r in results if not r.ok), None)
        if failed is not None:
            raise failed.error  # type: ignore[misc]
    return results


def _task_key(index: int, episode: Episode) -> str:
    """The proxy groups items by metadata.task_id as text (3 and "3" are one task); both fields are required."""
    metadata = episode.metadata or {}
    task_id, success = metadata.get("task_id"), metadata.get("env_success")
    if isinstance(task_id, bool) or not isinstance(task_id, int | str) or task_id == "":
        raise EpisodeMetadataError(f"episode {index}: /progress/batch needs metadata.task_id (an int or a "
                                   f"non-empty string), got {task_id!r}")
    if not isinstance(success, bool):
        raise EpisodeMetadataError(f"episode {index}: /progress/batch needs metadata.env_success (a bool), "
                                   f"got {success!r}")
    return task_key(task_id)


async def _build_all(episodes: list[Episode], cfg: RewardModelConfig) -> list[ScoreRequestBody | FramesError]:
    built = await asyncio.gather(*(build_request_body_async(e, cfg) for e in episodes), return_exceptions=True)
    unexpected = next((b for b in built if isinstance(b, BaseException) and not isinstance(b, FramesError)), None)
    if unexpected is not None:
        for body in built:
            if isinstance(body, ScoreRequestBody):
                body.discard(cfg.keep_temp_video)
        raise unexpected
    return built  # type: ignore[return-value]


def _waves(task_keys: list[str]) -> list[list[int]]:
    """Whole tasks, in order, in waves of at most MAX_BODIES_IN_MEMORY episodes: the bodies of one
    wave are built, sent and freed before the next is built (256 episodes of 16 frames would
    otherwise hold ~0.6 GB in the env worker at once)."""
    tasks: dict[str, list[int]] = {}
    for index, key in enumerate(task_keys):
        tasks.setdefault(key, []).append(index)
    waves: list[list[int]] = [[]]
    for members in tasks.values():
        if waves[-1] and len(waves[-1]) + len(members) > C.MAX_BODIES_IN_MEMORY:
            waves.append([])
        waves[-1].extend(members)
    return waves


def _fail_tasks_without_all_bodies(bodies: list, task_keys: list[str], outcomes: list) -> None:
    """Frames that cannot be sent fail their episode, and the rest of its task with it: without
    that episode the reference or the normalisation of the others would silently differ."""
    for index, body in enumerate(bodies):
        if isinstance(body, FramesError):
            outcomes[index] = body
            for other, key in enumerate(task_keys):
                if key == task_keys[index] and not isinstance(bodies[other], FramesError):
                    outcomes[other] = FramesError(f"episode {index} of the same task could not be sent ({body}); "
                                                  "its task's progress would not be the same without it")


def _pack(indices: list[int], task_keys: list[str], bodies: list) -> list[list[int]]:
    """Whole tasks per request, each request under the byte and item caps (a bigger task goes alone)."""
    tasks: dict[str, list[int]] = {}
    for index in indices:
        tasks.setdefault(task_keys[index], []).append(index)
    requests: list[list[int]] = []
    current: list[int] = []
    size = 0
    for members in tasks.values():
        task_size = sum(bodies[i].size for i in members)
        if current and (size + task_size > C.DEFAULT_MAX_BATCH_BYTES
                        or len(current) + len(members) > C.DEFAULT_MAX_PROGRESS_ITEMS):
            requests.append(current)
            current, size = [], 0
        current.extend(members)
        size += task_size
    if current:
        requests.append(current)
    return requests


async def _send(core: TransportCore, episodes: list[Episode], bodies: list, indices: list[int],
                task_keys: list[str], deadline: float, outcomes: list, attempts: list[int]) -> None:
    """One request for whole tasks; then the tasks whose every failed item may be retried (a
    moment of overload: `overloaded`, and `progress_group_failed` carrying its cause's word) are
    sent again, whole, at most max_retries times within the deadline. Never part of a task."""
    cfg = core.cfg
    fields = {"backend": cfg.backend} if cfg.backend else {}
    if cfg.identity:  # the proxy's reference store keeps this run's successes apart from other runs'
        fields["reference_namespace"] = cfg.identity
    pending, resends = indices, 0
    while True:
        items = [replace(bodies[i], payload={k: v for k, v in bodies[i].payload.items() if k in ITEM_FIELDS})
                 for i in pending]
        content_type, content = batch_body(items, fields or None)
        try:
            answer, tries = await core.post_json(cfg.progress_url, content, deadline, content_type)
        except RewardAPIError as err:  # the whole request failed: every episode in it, with that error
            for index in pending:
                outcomes[index], attempts[index] = err, attempts[index] + err.attempts
            return
        sent = [episodes[i].metadata or {} for i in pending]
        for index, outcome in zip(pending, parse_answer(answer, sent, tries), strict=True):
            outcomes[index], attempts[index] = outcome, attempts[index] + tries
        pending = _retryable_tasks(pending, task_keys, outcomes)
        delay = retry_delay(resends + 1, None)
        if not pending or resends >= cfg.max_retries or time.monotonic() + delay >= deadline:
            return
        resends += 1
        core.stats.retries += 1
        await asyncio.sleep(delay)


def _retryable_tasks(indices: list[int], task_keys: list[str], outcomes: list) -> list[int]:
    """The episodes of the tasks that failed only in ways worth asking again."""
    tasks: dict[str, list[int]] = {}
    for index in indices:
        tasks.setdefault(task_keys[index], []).append(index)
    again = []
    for members in tasks.values():
        errors = [outcomes[i] for i in members if isinstance(outcomes[i], RewardClientError)]
        if errors and all(getattr(err, "retryable", False) for err in errors):
            again.extend(members)
    return again


def parse_answer(answer: Any, sent: list[dict[str, Any]], attempts: int) -> list[Outcome]:
    """Per item: its validated `result`, or its error (its own, or why the answer does not hold it)."""
    results = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(results, list) or len(results) != len(sent):
        error = APIResponseValidationError(f"the proxy's /progress/batch answer has no 'results' list of "
                                           f"{len(sent)} items", attempts=attempts)
        return [error] * len(sent)
    return [_item_outcome(item, index, metadata, attempts)
            for index, (item, metadata) in enumerate(zip(results, sent, strict=True))]


def _item_outcome(item: Any, index: int, metadata: dict[str, Any], attempts: int) -> Outcome:
    if not isinstance(item, dict) or item.get("index") != index:
        return APIResponseValidationError(f"results[{index}] is not the result of item {index}", attempts=attempts)
    if item.get("ok") is False or isinstance(item.get("error"), dict):
        status = item.get("status") if isinstance(item.get("status"), int) else 502
        return make_status_error(status, item, attempts=attempts)
    result = item.get("result")
    why = _invalid(result, metadata)
    if why:
        return APIResponseValidationError(f"results[{index}]: {why}", attempts=attempts)
    return result  # type: ignore[return-value]


def _invalid(result: Any, metadata: dict[str, Any]) -> str | None:
    """Why a result is not one this client can pay, or None."""
    if not isinstance(result, dict):
        return "no result object"
    outcome, progress, success = result.get("outcome"), result.get("progress"), result.get("env_success")
    if outcome not in OUTCOMES:
        return f"outcome {outcome!r} is none of {', '.join(OUTCOMES)}"
    if success is not metadata.get("env_success") or str(result.get("task_id")) != str(metadata.get("task_id")):
        return (f"answers for task {result.get('task_id')!r} env_success {success!r}, but the episode sent was "
                f"task {metadata.get('task_id')!r} env_success {metadata.get('env_success')!r}")
    if (outcome == "success") != success:
        return f"outcome {outcome!r} for an episode whose env_success is {success!r}"
    if outcome == "no_reference":
        return None if progress is None else f"outcome no_reference with a progress ({progress!r})"
    if isinstance(progress, bool) or not isinstance(progress, int | float) or not math.isfinite(progress) \
            or not 0.0 <= progress <= 1.0 or (outcome == "success" and progress != 1):
        return f"outcome {outcome} without a progress {'of 1' if success else 'in [0, 1]'} (progress={progress!r})"
    return None


def _settle(cfg: RewardModelConfig, episode: Episode, outcome: Outcome, attempts: int,
            latency_ms: float, frames_short: dict[str, Any] | None = None) -> EpisodeProgress:
    if isinstance(outcome, dict):
        progress = None if outcome["outcome"] == "no_reference" else float(outcome["progress"])
        if frames_short is not None:
            log.warning("episode %r was embedded on %d frames where %d were asked (why: %s)", episode.task_text[:80],
                        frames_short["sent"], frames_short["wanted"], frames_short["why"])
        return EpisodeProgress(ok=True, value=progress, outcome=outcome["outcome"], progress=progress,
                               attempts=attempts, latency_ms=latency_ms, response=outcome, frames_short=frames_short)
    policy = cfg.failure_policy
    # env_success: the simulator's flag, which this request carries anyway
    value = {"zero": 0.0, "env_success": float((episode.metadata or {})["env_success"]), "raise": None}[policy]
    code = getattr(outcome, "code", "error")
    if policy != "raise":
        log.info("progress failed (%s: %s) for %r; fallback %s gives %s", code, outcome, episode.task_text[:80],
                 policy, value)
    return EpisodeProgress(ok=False, value=value, reason=code, error=outcome, attempts=attempts,
                           latency_ms=latency_ms)
