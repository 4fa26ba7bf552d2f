"""Built request bodies between the builder and the senders (rlinf_client._scheduler)."""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

from rlinf_client import _constants as C
from rlinf_client._base_client import ScoreRequestBody

__all__ = ["PendingEpisode", "ReadyBodies"]


@dataclass
class PendingEpisode:
    """An episode whose body is built and whose result is not final yet."""

    index: int
    body: ScoreRequestBody
    started: float  # perf_counter when its body was ready
    attempts: int = 0  # HTTP requests that carried it
    released: bool = False


class ReadyBodies:
    """Built bodies waiting to be sent, and when to stop packing them into a batch: the batch
    is full, the builder is done, or the builder waits for memory (only sending frees it)."""

    def __init__(self) -> None:
        self._items: collections.deque[PendingEpisode] = collections.deque()
        self._changed = asyncio.Condition()
        self._closed = self._starved = False

    async def put(self, pending: PendingEpisode) -> None:
        async with self._changed:
            self._items.append(pending)
            self._changed.notify_all()

    async def set_starved(self, starved: bool) -> None:
        async with self._changed:
            self._starved = starved
            self._changed.notify_all()

    async def close(self) -> None:
        async with self._changed:
            self._closed = True
            self._changed.notify_all()

    async def take(self, cap: int) -> list[PendingEpisode] | None:
        """The next group of up to `cap` bodies (and DEFAULT_MAX_BATCH_BYTES); None at the end."""
        async with self._changed:
            group: list[PendingEpisode] = []
            size = 0
            while True:
                while self._items and len(group) < cap and (
                        not group or size + self._items[0].body.size <= C.DEFAULT_MAX_BATCH_BYTES):
                    size += self._items[0].body.size
                    group.append(self._items.popleft())
                full = len(group) >= cap or bool(self._items)  # count or bytes
                if group and (full or self._closed or self._starved):
                    return group
                if not group and self._closed:
                    return None
                await self._changed.wait()
