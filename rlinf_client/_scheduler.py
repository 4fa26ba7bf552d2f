"""The client's scheduling, owned by one object: request slots, body building and packing.

    episodes ──build (a thread; at most MAX_BODIES_IN_MEMORY bodies alive)──► ready bodies
    ready bodies ──packed into a batch (or one /score)──► request, holding a slot ──► results

- A request slot (`max_concurrency` of them, shared by every call on the client) is held only
  while an HTTP request is in flight. Building never waits for a slot. Packing fills a batch
  until it is full, the episodes are all built, or building waits for memory — then it is
  sent, once a slot is free. In-flight requests wait on nothing, so they always finish and free
  slots and bodies: no number of episodes, big or small, can deadlock it.
- One deadline per call: `timeout` from the call's start. Every episode comes back scored or
  explicitly failed by then (plus a small margin for the last answers to land), whatever the
  number of episodes; episodes still waiting when it passes fail with `timeout`.
- Retried (by the transport, or here for batch items): only what the proxy marks retryable and
  what never reached it, and never past the deadline.
- Any error or cancellation releases every slot and body it took and deletes temp MP4s.
- The failure policy (`fallback`: raise | zero | env_success) applies in one place: an
  `EpisodeScore` for every episode, or, with raise, the first failure raised (the rest cancelled).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rlinf_client import _constants as C
from rlinf_client._base_client import (
    TransportCore,
    build_request_body_async,
    parse_curve_body,
    parse_score_body,
    retry_delay,
    timeout_error,
)
from rlinf_client._batch import REFUSED_AS_A_WHOLE, BatchSupport, batch_body, batch_items
from rlinf_client._exceptions import (
    APIStatusError,
    FramesError,
    RewardAPIError,
    RewardClientError,
    make_status_error,
)
from rlinf_client._frame_rules import FrameRulesCache
from rlinf_client._ready import PendingEpisode, ReadyBodies
from rlinf_client._tasks import TaskSet
from rlinf_client._types import ClientStats, Episode, EpisodeScore

# Why an episode went with fewer frames (or curve points) than asked, in the warning's words.
_WHY_SHORT = {
    "stride": "the frame buffer kept every {stride}-th of its {source_count} steps (frame_stride, widened by "
              "buffer_frames)",
    "clamp": "the backend's frames.clamp_nframes_to lowered nframes (the client picks the frames itself)",
    "points": "its {source_count} frames allow at most {sent} points after the first frame (dense_points)",
}

log = logging.getLogger("rlinf_client")

__all__ = ["Scheduler"]


# (score, the proxy's answer[, the curve as (step, score)]) or the error
Outcome = tuple[float, dict] | tuple[float, dict, tuple] | RewardClientError


class _Stop(Exception):
    """fallback: raise: the first failure ends the call."""

    def __init__(self, error: RewardClientError) -> None:
        self.error = error


class Scheduler:
    def __init__(self, core: TransportCore, stats: ClientStats) -> None:
        self.core = core
        self.cfg = core.cfg
        self.stats = stats
        self.batch = BatchSupport(self.cfg.batch)
        self.binary = True  # transport: binary, until a proxy refuses the body (then inline, said once)
        self.frame_rules = FrameRulesCache(core)  # frame_encoding: auto
        self._slots = asyncio.Semaphore(self.cfg.max_concurrency)
        self._bodies = asyncio.Semaphore(C.MAX_BODIES_IN_MEMORY)

    # -- the one entry point ---------------------------------------------------------------------
    async def run(self, episodes: list[Episode]) -> list[EpisodeScore]:
        if not episodes:
            return []
        call_started = time.perf_counter()
        deadline = time.monotonic() + self.cfg.timeout
        results: list[EpisodeScore | None] = [None] * len(episodes)
        try:
            await asyncio.wait_for(self._probe_and_schedule(episodes, results, deadline),
                                   self.cfg.timeout + C.RETURN_MARGIN_S / 2)
        except asyncio.TimeoutError:  # noqa: UP041 - not TimeoutError before 3.11, and the client runs on 3.10
            pass  # whatever is not final below fails with `timeout`
        except _Stop as stop:
            raise stop.error from None
        for index, result in enumerate(results):
            if result is None:
                self._settle(episodes, results, index, timeout_error(self.cfg, 0), call_started,
                             raise_policy=False)
        if self.cfg.failure_policy == "raise":
            failed = next((r for r in results if r is not None and not r.ok), None)
            if failed is not None:
                raise failed.error  # type: ignore[misc]
        return results  # type: ignore[return-value]

    # -- building and sending --------------------------------------------------------------------
    async def _probe_and_schedule(self, episodes: list[Episode], results: list, deadline: float) -> None:
        # /score/batch holds single scores: a curve (dense_points) goes alone to /score/dense.
        use_batch = len(episodes) > 1 and not self.cfg.dense_points and await self.batch.available(self.core)
        await self._schedule(episodes, results, deadline, use_batch)

    async def _schedule(self, episodes: list[Episode], results: list, deadline: float, use_batch: bool) -> None:
        ready = ReadyBodies()
        taken: list[PendingEpisode] = []  # every body built, released in the end whatever happened
        cap = C.DEFAULT_MAX_BATCH_EPISODES if use_batch else 1
        try:
            async with TaskSet() as tasks:  # a _Stop (fallback: raise) in any task ends them all
                tasks.create_task(self._build(episodes, results, ready, taken))
                while (group := await ready.take(cap if self.batch.supported else 1)) is not None:
                    # Send once a request could go out; the slot itself is taken by the send.
                    await self._slots.acquire()
                    self._slots.release()
                    tasks.create_task(self._send_until_final(episodes, results, group, deadline))
        finally:
            for pending in taken:
                self._release(pending)

    async def _build(self, episodes: list[Episode], results: list, ready: ReadyBodies,
                     taken: list[PendingEpisode]) -> None:
        """Bodies in episode order, at most MAX_BODIES_IN_MEMORY alive at once."""
        try:
            for index, episode in enumerate(episodes):
                if self._bodies.locked():
                    await ready.set_starved(True)  # packing must not wait for more: send what is ready
                await self._bodies.acquire()
                await ready.set_starved(False)
                started = time.perf_counter()
                try:
                    body = await build_request_body_async(episode, self.cfg, await self.frame_rules.get())
                except BaseException as err:
                    self._bodies.release()
                    if not isinstance(err, FramesError):
                        raise
                    self._settle(episodes, results, index, err, started)
                    continue
                pending = PendingEpisode(index, body, started)
                taken.append(pending)
                await ready.put(pending)
        finally:
            await ready.close()

    async def _send_until_final(self, episodes: list[Episode], results: list, group: list[PendingEpisode],
                                deadline: float) -> None:
        """Send a group (one batch, or one /score each) and send its retryable items again,
        until every item is final or the deadline is too near."""
        tries = 0
        while group:
            tries += 1
            outcomes = await self._send(group, deadline)
            outcomes = await self._raw_again_if_rules_changed(episodes, group, outcomes, deadline)
            retry = [(p, o) for p, o in zip(group, outcomes, strict=True) if _retry_item(o)]
            for pending, outcome in zip(group, outcomes, strict=True):
                if not _retry_item(outcome):
                    self._finish(episodes, results, pending, outcome)
            if not retry:
                return
            waits = [o.error.retry_after for _, o in retry if o.error.retry_after is not None]
            delay = retry_delay(tries, max(waits) if waits else None)
            if tries > self.cfg.max_retries or time.monotonic() + delay >= deadline:
                for pending, outcome in retry:
                    self._finish(episodes, results, pending, outcome)
                return
            self.stats.retries += 1
            await asyncio.sleep(delay)
            group = [pending for pending, _ in retry]

    async def _raw_again_if_rules_changed(self, episodes: list[Episode], group: list[PendingEpisode],
                                          outcomes: list, deadline: float) -> list:
        """Episodes refused for frames encoded under frame rules the proxy no longer has (409
        frame_rules_changed) are built again as raw frames and sent once more, at once: the proxy
        answered without scoring them, and raw frames cannot be refused so."""
        again = [i for i, o in enumerate(outcomes) if _rules_changed(o) and group[i].body.frame_rules is not None]
        if not again:
            return outcomes
        outcomes, resend = list(outcomes), []
        for i in again:
            pending = group[i]
            self.frame_rules.changed(pending.body.frame_rules)
            try:
                body = await build_request_body_async(episodes[pending.index], self.cfg, None,
                                                      pending.body.payload["nframes"])
            except FramesError as err:
                outcomes[i] = err
                continue
            pending.body.discard(self.cfg.keep_temp_video)
            pending.body = body
            resend.append(i)
        if resend:
            for i, outcome in zip(resend, await self._send([group[i] for i in resend], deadline), strict=True):
                outcomes[i] = outcome
        return outcomes

    async def _send(self, group: list[PendingEpisode], deadline: float) -> list[Outcome]:
        """One request for the group (each request holds a slot only while in flight). Per item:
        (score, answer), or the error it got. A whole request is retried by the transport; an item
        of a batch answered retryable (`_ItemError`) is sent again by `_send_until_final`."""
        if len(group) == 1 or not self.batch.supported:
            return list(await asyncio.gather(*(self._send_one(p, deadline) for p in group)))
        try:
            async with self._slots:
                content_type, content = batch_body([p.body if self.binary else p.body.inline() for p in group])
                answer, attempts = await self.core.post_json(self.cfg.batch_url, content, deadline, content_type)
        except APIStatusError as err:
            if self._binary_refused(err, content_type):
                return await self._send(group, deadline)
            if err.status_code in REFUSED_AS_A_WHOLE:
                self.batch.disable(f"the proxy refused a batch: {err}")
                return await self._send(group, deadline)
            return self._same_for_all(group, err)
        except RewardAPIError as err:
            return self._same_for_all(group, err)
        items = batch_items(answer, len(group))
        if items is None:
            self.batch.disable("its answer has no 'results' list of one result per item, each at its index")
            return await self._send(group, deadline)
        for pending in group:
            pending.attempts += attempts
        return [_item_outcome(item, p.attempts) for p, item in zip(group, items, strict=True)]

    async def _send_one(self, pending: PendingEpisode, deadline: float) -> Outcome:
        try:
            async with self._slots:
                content_type, content = pending.body.encoded(self.binary)
                answer, attempts = await self.core.post_json(self.cfg.score_url, content, deadline, content_type)
        except RewardAPIError as err:
            pending.attempts += err.attempts
            if isinstance(err, APIStatusError) and self._binary_refused(err, content_type):
                return await self._send_one(pending, deadline)
            return err
        pending.attempts += attempts
        try:
            if pending.body.steps is not None:  # dense_points: a curve
                score, curve = parse_curve_body(answer, pending.attempts, pending.body.steps)
                return score, answer, curve
            return parse_score_body(answer, pending.attempts), answer
        except RewardAPIError as err:
            return err

    def _binary_refused(self, err: APIStatusError, content_type: str) -> bool:
        """A proxy that takes no binary body (older than it) answers 422 on `body`: send inline from now on."""
        if not (content_type.startswith("multipart/") and err.status_code == 422 and err.field == "body"):
            return False
        if self.binary:  # said once; requests already in flight as binary are sent again inline too
            self.binary = False
            log.warning("the proxy at %s refused a binary body (%s); sending frames inline (base64) from now on",
                        self.cfg.base_url, err)
        return True

    @staticmethod
    def _same_for_all(group: list[PendingEpisode], err: RewardAPIError) -> list[Outcome]:
        for pending in group:
            pending.attempts += err.attempts
        return [err] * len(group)

    # -- results and the failure policy ----------------------------------------------------------
    def _finish(self, episodes: list[Episode], results: list, pending: PendingEpisode,
                outcome: Outcome | _ItemError) -> None:
        if isinstance(outcome, _ItemError):
            outcome = outcome.error
        self._release(pending)
        self._settle(episodes, results, pending.index, outcome, pending.started, attempts=pending.attempts,
                     frames_short=pending.body.frames_short)

    def _settle(self, episodes: list[Episode], results: list, index: int, outcome: Outcome, started: float, *,
                attempts: int = 0, raise_policy: bool = True, frames_short: dict[str, Any] | None = None) -> None:
        """Record an episode's final outcome; the failure policy applies here and nowhere else."""
        if results[index] is not None:
            return
        latency_ms = (time.perf_counter() - started) * 1e3
        if isinstance(outcome, tuple):
            score, answer, *curve = outcome
            result = EpisodeScore(ok=True, value=score, score=score, attempts=attempts, latency_ms=latency_ms,
                                  response=answer, curve=curve[0] if curve else None, frames_short=frames_short)
            if frames_short is not None:
                log.warning("episode %r was scored on %d %s where %d were asked: %s", episodes[index].task_text[:80],
                            frames_short["sent"], "curve points" if frames_short["why"] == "points" else "frames",
                            frames_short["wanted"], _WHY_SHORT[frames_short["why"]].format(**frames_short))
        else:
            episode, policy = episodes[index], self.cfg.failure_policy
            code = getattr(outcome, "code", "error")
            value = {"zero": 0.0, "env_success": episode.fallback, "raise": None}[policy]
            result = EpisodeScore(ok=False, value=value, reason=code, error=outcome,
                                  attempts=attempts, latency_ms=latency_ms)
            if policy != "raise":
                log.info("reward model failed (%s: %s) for %r; fallback %s gives %s", code, outcome,
                         episode.task_text[:80], policy, value)
        results[index] = result
        self.stats.record(result)
        if not result.ok and self.cfg.failure_policy == "raise" and raise_policy:
            raise _Stop(outcome)  # type: ignore[arg-type]

    def _release(self, pending: PendingEpisode) -> None:
        if not pending.released:
            pending.released = True
            pending.body.discard(self.cfg.keep_temp_video)
            self._bodies.release()


class _ItemError(Exception):
    """A batch item's own error: the rest of the batch was answered."""

    def __init__(self, error: APIStatusError) -> None:
        self.error = error


def _rules_changed(outcome: object) -> bool:
    error = outcome.error if isinstance(outcome, _ItemError) else outcome
    return isinstance(error, APIStatusError) and error.code == "frame_rules_changed"


def _retry_item(outcome: object) -> bool:
    return isinstance(outcome, _ItemError) and outcome.error.retryable


def _item_outcome(item: dict, attempts: int) -> Outcome | _ItemError:
    if item.get("ok") is False or isinstance(item.get("error"), dict):
        status = item.get("status") if isinstance(item.get("status"), int) else 502
        return _ItemError(make_status_error(status, item, attempts=attempts))
    result = item.get("result")
    try:
        return parse_score_body(result, attempts), result
    except RewardAPIError as err:
        return err

