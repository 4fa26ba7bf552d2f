"""`AsyncRewardClient` (asyncio) and `RewardClient` (blocking), one implementation.

The blocking client runs an `AsyncRewardClient` on a private event loop in a daemon thread, so
it works from any thread, including code that already runs inside an event loop: RLinf calls
`LiberoEnv.step` from inside the EnvWorker's `async def` loop, where `asyncio.run` would fail.
Either way a client holds one connection pool of `max_concurrency` connections.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import weakref
from collections.abc import Coroutine, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from rlinf_client import _constants as C
from rlinf_client._base_client import TransportCore
from rlinf_client._config import RewardModelConfig, RewardModelOptions
from rlinf_client._exceptions import APIConnectionError, APITimeoutError, make_status_error
from rlinf_client._progress import progress_episodes
from rlinf_client._scheduler import Scheduler
from rlinf_client._types import ClientStats, Episode, EpisodeProgress, EpisodeScore

if TYPE_CHECKING:  # for type checkers and IDEs only: the keyword arguments' names and types
    from typing_extensions import Unpack

__all__ = ["AsyncRewardClient", "RewardClient"]

log = logging.getLogger("rlinf_client")
T = TypeVar("T")

EpisodeLike = Episode | tuple | dict


def _config(config: RewardModelConfig | Mapping[str, Any] | None, overrides: RewardModelOptions) -> RewardModelConfig:
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
    """Scores finished episodes through the proxy's POST /score (or /score/batch).

    `config`: a RewardModelConfig, a mapping (RLinf's `reward_model` block) or None; keyword
    arguments (the same keys, typed in RewardModelOptions) replace single fields.
    `http_client` / `http_transport` inject httpx pieces (tests).
    """

    def __init__(self, config: RewardModelConfig | Mapping[str, Any] | None = None, *,
                 http_client: httpx.AsyncClient | None = None,
                 http_transport: httpx.AsyncBaseTransport | None = None,
                 **overrides: Unpack[RewardModelOptions]) -> None:
        self.config = _config(config, overrides)
        self.stats = ClientStats()
        self._core = TransportCore(self.config, http_client, http_transport, self.stats)
        self._scheduler = Scheduler(self._core, self.stats)

    async def __aenter__(self) -> AsyncRewardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._core.aclose()

    # -- public API ------------------------------------------------------------------------------
    async def score_episode(self, frames: Any, task_text: str, *, fallback: float | None = None,
                            extra_view: Any = None) -> EpisodeScore:
        """Score one episode within `timeout` (`extra_view`: a second camera's frames of the same
        steps). Raises on failure only with `fallback: raise`."""
        [result] = await self._scheduler.run([Episode(frames, task_text, fallback, extra_view=extra_view)])
        return result

    async def score_episodes(self, episodes: Iterable[EpisodeLike]) -> list[EpisodeScore]:
        """Score many episodes at once (concurrent /score calls, or /score/batch when the proxy
        has it); results in input order, all within one `timeout`. With `fallback: raise`
        the first failure cancels the rest and is raised."""
        return await self._scheduler.run([_as_episode(e) for e in episodes])

    async def progress_episodes(self, episodes: Iterable[EpisodeLike]) -> list[EpisodeProgress]:
        """SRPO-style progress (POST /progress/batch, docs/progress.md) of finished episodes, each
        with metadata.task_id and metadata.env_success; the episodes of a task go in one request.
        Results in input order within one `timeout`; the failure policy as in `score_episodes`."""
        return await progress_episodes(self._core, self.stats, [_as_episode(e) for e in episodes])

    @property
    def uses_batch(self) -> bool | None:
        """Whether POST /score/batch is used (None: not probed yet)."""
        return self._scheduler.batch.supported

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


class RewardClient:
    """The blocking flavour: same API and behaviour as `AsyncRewardClient`."""

    def __init__(self, config: RewardModelConfig | Mapping[str, Any] | None = None, *,
                 http_transport: httpx.AsyncBaseTransport | None = None,
                 **overrides: Unpack[RewardModelOptions]) -> None:
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

    def score_episode(self, frames: Any, task_text: str, *, fallback: float | None = None,
                      extra_view: Any = None) -> EpisodeScore:
        return self._run(self._client.score_episode(frames, task_text, fallback=fallback, extra_view=extra_view))

    def score_episodes(self, episodes: Iterable[EpisodeLike]) -> list[EpisodeScore]:
        return self._run(self._client.score_episodes(list(episodes)))

    def progress_episodes(self, episodes: Iterable[EpisodeLike]) -> list[EpisodeProgress]:
        return self._run(self._client.progress_episodes(list(episodes)))

    def health(self) -> dict[str, Any]:
        return self._run(self._client.health())

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> RewardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run on the client's loop; abandoned (cancelled) if it has not returned a little after
        `timeout` — the schedule ends at the timeout, this is the backstop."""
        if not self._thread.is_alive():
            coro.close()
            raise RuntimeError("RewardClient is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=self.config.timeout + C.RETURN_MARGIN_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise APITimeoutError(f"no answer within timeout={self.config.timeout:g}s "
                                  f"(+{C.RETURN_MARGIN_S:g}s margin)", attempts=0) from None


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
