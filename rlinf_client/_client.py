"""`AsyncRewardClient` (asyncio) and `RewardClient` (blocking), one implementation.

The blocking client runs an `AsyncRewardClient` on a private event loop in a daemon thread, so
it works from any thread, including code that already runs inside an event loop: RLinf calls
`LiberoEnv.step` from inside the EnvWorker's `async def` loop, where `asyncio.run` would fail.
Either way a client holds one connection pool of `max_concurrency` connections.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

import httpx

from rlinf_client import _batch
from rlinf_client._base_client import TransportCore, build_request_body_async, parse_score_body
from rlinf_client._config import RewardModelConfig
from rlinf_client._exceptions import (
    APIConnectionError,
    APITimeoutError,
    FramesError,
    RewardAPIError,
    RewardClientError,
    make_status_error,
)
from rlinf_client._types import ClientStats, Episode, EpisodeScore

__all__ = ["AsyncRewardClient", "RewardClient"]

log = logging.getLogger("rlinf_client")
T = TypeVar("T")

EpisodeLike = Episode | tuple | dict


def _config(config: RewardModelConfig | Any, overrides: dict[str, Any]) -> RewardModelConfig:
    if isinstance(config, RewardModelConfig):
        return config.replace(**overrides) if overrides else config
    return RewardModelConfig.from_mapping(config, **overrides)


def _as_episode(item: EpisodeLike) -> Episode:
    if isinstance(item, Episode):
        return item
    if isinstance(item, dict):
        return Episode(**item)
    return Episode(*item)  # (frames, task_text[, fallback])


class AsyncRewardClient:
    """Scores finished episodes through the proxy's POST /score.

    `config`: a RewardModelConfig, a mapping (RLinf's `reward_model` block) or None; keyword
    overrides replace single fields. `http_client` / `http_transport` inject httpx pieces (tests).
    """

    def __init__(self, config: RewardModelConfig | Any = None, *,
                 http_client: httpx.AsyncClient | None = None,
                 http_transport: httpx.AsyncBaseTransport | None = None, **overrides: Any) -> None:
        self.config = _config(config, overrides)
        self.stats = ClientStats()
        self._core = TransportCore(self.config, http_client, http_transport, self.stats)
        self._slots = asyncio.Semaphore(self.config.max_concurrency)
        self._batch = _batch.BatchSupport(self.config.batch)

    async def __aenter__(self) -> AsyncRewardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._core.aclose()

    # -- public API ------------------------------------------------------------------------------
    async def score_episode(self, frames: Any, task_text: str, *,
                            fallback: float | None = None) -> EpisodeScore:
        """Score one episode. Raises on failure only with `fail_on_request_error`."""
        return await self._score_one(Episode(frames, task_text, fallback))

    async def score_episodes(self, episodes: Iterable[EpisodeLike]) -> list[EpisodeScore]:
        """Score many episodes at once (concurrent /score calls, or /score/batch when the proxy
        has it); results in input order. With `fail_on_request_error` the first failure
        cancels the rest and is raised."""
        items = [_as_episode(e) for e in episodes]
        if not items:
            return []
        if len(items) > 1 and await self._batch.available(self._core):
            return await _batch.score_in_batches(self, items)
        return await self._gather([self._score_one(e) for e in items])

    async def health(self) -> dict[str, Any]:
        """The proxy's GET /health body ({"status": "ok" | "degraded" | "unavailable", ...})."""
        try:
            response = await self._core.http.get(self.config.health_url,
                                                 timeout=self.config.connect_timeout)
        except httpx.TransportError as err:
            raise APIConnectionError(f"cannot reach the proxy at {self.config.health_url}: "
                                     f"{type(err).__name__}: {err}") from err
        try:
            return response.json()
        except ValueError:
            raise make_status_error(response.status_code, response.text[:2000]) from None

    # -- internals -------------------------------------------------------------------------------
    async def _gather(self, coros: list[Coroutine[Any, Any, T]]) -> list[T]:
        """Run concurrently; the first exception cancels the others and is raised as is."""
        tasks = [asyncio.ensure_future(c) for c in coros]
        if not tasks:
            return []
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            pending = [t for t in tasks if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
        return [t.result() for t in tasks]

    async def _score_one(self, episode: Episode, deadline: float | None = None) -> EpisodeScore:
        """`deadline` (time.monotonic()): an earlier attempt's, e.g. a batch's, so that one
        episode never takes more than `timeout` in all; by default one starts now."""
        async with self._slots:  # also bounds the encoded bodies held in memory at once
            # The episode's `timeout` starts with its request, not while it queues for a slot.
            started = time.perf_counter()
            if deadline is None:
                deadline = time.monotonic() + self.config.timeout
            try:
                if time.monotonic() >= deadline:
                    raise APITimeoutError(f"no score within timeout={self.config.timeout:g}s",
                                          attempts=0)
                body = await build_request_body_async(episode, self.config)
                try:
                    data, attempts = await self._core.post_json(self.config.score_url,
                                                                body.to_bytes(), deadline)
                finally:
                    body.discard(self.config.keep_temp_video)
                score = parse_score_body(data, attempts)
            except (RewardAPIError, FramesError) as err:
                return self._failed(episode, err, started)
        return self._succeeded(score, data, attempts, started)

    def _succeeded(self, score: float, data: dict, attempts: int, started: float) -> EpisodeScore:
        result = EpisodeScore(ok=True, value=score, score=score, attempts=attempts,
                              latency_ms=(time.perf_counter() - started) * 1e3, response=data)
        self.stats.record(result)
        return result

    def _failed(self, episode: Episode, err: RewardClientError, started: float) -> EpisodeScore:
        """The failure policy, in one place: raise, or a fallback that is marked and counted."""
        code = getattr(err, "code", "error")
        result = EpisodeScore(ok=False, value=episode.fallback, reason=code, error=err,
                              attempts=getattr(err, "attempts", 0),
                              latency_ms=(time.perf_counter() - started) * 1e3)
        self.stats.record(result)
        if self.config.fail_on_request_error:
            raise err
        log.info("reward model failed (%s: %s) for %r; using fallback %s", code, err,
                 episode.task_text[:80], episode.fallback)
        return result


class RewardClient:
    """The blocking flavour: same API and behaviour as `AsyncRewardClient`."""

    def __init__(self, config: RewardModelConfig | Any = None, *,
                 http_transport: httpx.AsyncBaseTransport | None = None, **overrides: Any) -> None:
        self.config = _config(config, overrides)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=_run_loop, args=(self._loop,),
                                        name="rlinf-reward-client", daemon=True)
        self._thread.start()

        async def make() -> AsyncRewardClient:  # created on the loop that will use it
            return AsyncRewardClient(self.config, http_transport=http_transport)

        self._client = self._run(make())
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, self._thread, self._client)

    @property
    def stats(self) -> ClientStats:
        return self._client.stats

    def score_episode(self, frames: Any, task_text: str, *,
                      fallback: float | None = None) -> EpisodeScore:
        return self._run(self._client.score_episode(frames, task_text, fallback=fallback))

    def score_episodes(self, episodes: Iterable[EpisodeLike]) -> list[EpisodeScore]:
        return self._run(self._client.score_episodes(list(episodes)))

    def health(self) -> dict[str, Any]:
        return self._run(self._client.health())

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> RewardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self._thread.is_alive():
            coro.close()
            raise RuntimeError("RewardClient is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


def _shutdown(loop: asyncio.AbstractEventLoop, thread: threading.Thread,
              client: AsyncRewardClient) -> None:
    """Close the pool, stop the loop, join the thread (also at interpreter exit)."""
    if not thread.is_alive():
        return
    try:
        asyncio.run_coroutine_threadsafe(client.aclose(), loop).result(timeout=10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
