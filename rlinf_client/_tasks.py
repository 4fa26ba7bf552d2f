"""`TaskSet`: what the scheduler needs of asyncio.TaskGroup, on Python 3.10 too.

The client's floor is RLinf's, Python 3.10, where TaskGroup, asyncio.timeout and `except*` do not
exist (the client used all three until stop 36, so it did not import there). The contract kept:
tasks started in the block belong to it; leaving the block waits for all of them; the first task
that fails cancels the others and the block itself, and its exception is raised, as itself (not
in an ExceptionGroup). A cancellation from outside cancels every task and is raised once they end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

__all__ = ["TaskSet"]


class TaskSet:
    def __init__(self) -> None:
        self._tasks: list[asyncio.Task[Any]] = []  # in creation order: the first failure is the first
        self._error: BaseException | None = None
        self._parent: asyncio.Task[Any] | None = None
        self._exiting = False  # in __aexit__: it waits for the tasks itself, the block is not cancelled
        self._cancelled_parent = False

    async def __aenter__(self) -> TaskSet:
        self._parent = asyncio.current_task()
        return self

    def create_task(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or task.exception() is None or self._error is not None:
            return
        self._error = task.exception()
        self._cancel_all()
        if self._parent is not None and not self._exiting and not self._parent.done():
            self._parent.cancel()  # the block stops where it waits; __aexit__ raises the error instead
            self._cancelled_parent = True

    def _cancel_all(self) -> None:
        for task in self._tasks:
            if not task.done():
                task.cancel()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        self._exiting = True
        cancelled_from_outside = exc_type is asyncio.CancelledError and self._error is None
        if exc is not None and self._error is None:  # the block failed, or was cancelled from outside
            self._cancel_all()
        while pending := [task for task in self._tasks if not task.done()]:
            try:
                await asyncio.wait(pending)
            except asyncio.CancelledError:  # ours (a task failed) or from outside: the tasks end first
                cancelled_from_outside = cancelled_from_outside or self._error is None
                self._cancel_all()
        if self._error is None:  # a task that failed as the block left: its callback has not run yet
            self._error = next((t.exception() for t in self._tasks if not t.cancelled() and t.exception()), None)
        if self._error is not None:
            if self._cancelled_parent and hasattr(self._parent, "uncancel"):
                self._parent.uncancel()  # (3.11+) the cancel was ours, not an enclosing timeout's
            raise self._error
        if cancelled_from_outside and exc is None:
            raise asyncio.CancelledError
        return False
