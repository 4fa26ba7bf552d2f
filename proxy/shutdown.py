"""Bounded shutdown: on SIGTERM/SIGINT the proxy stops taking requests, gives the ones in flight
`proxy.shutdown_grace_s`, then answers what is left with 503 `shutting_down` and exits.

uvicorn alone waits for in-flight requests as long as they take (one slow upstream call held a
process 58 s after SIGTERM) or, with its own timeout, drops them without an answer. `Edge`
registers each request with the gate; `serve` begins the drain from uvicorn's signal handler.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("vlm_reward_proxy")


class ShutdownGate:
    def __init__(self) -> None:
        self.draining = False  # new requests are refused
        self.expired = False  # the grace period is over: requests still running are cut
        self._tasks: set[asyncio.Task] = set()

    def track(self, task: asyncio.Task) -> None:
        self._tasks.add(task)

    def untrack(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)

    def begin(self, grace_s: float) -> None:
        """Start draining (on the event loop's thread)."""
        if self.draining:
            return
        self.draining = True
        log.info("shutting down: %d request(s) in flight get %.1fs to finish", len(self._tasks), grace_s)
        asyncio.get_running_loop().call_later(grace_s, self._expire)

    def _expire(self) -> None:
        self.expired = True
        if self._tasks:
            log.warning("grace period over: answering %d unfinished request(s) with 503 shutting_down",
                        len(self._tasks))
        for task in list(self._tasks):
            task.cancel()

    def owns_cancellation(self, task: asyncio.Task) -> bool:
        """Was `task` cancelled by the gate (rather than by its client or the server)?"""
        return self.expired and task in self._tasks
