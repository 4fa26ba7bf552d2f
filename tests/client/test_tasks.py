"""`TaskSet` (rlinf_client/_tasks.py): asyncio.TaskGroup's contract as the scheduler uses it, on the
client's Python 3.10 floor. Each test runs on the real event loop; the tasks wait on events, never
on time."""

from __future__ import annotations

import asyncio

import pytest

from rlinf_client._tasks import TaskSet


class Boom(Exception):
    pass


async def test_leaving_the_block_waits_for_every_task():
    release, done = asyncio.Event(), []

    async def job(n: int) -> None:
        await release.wait()
        done.append(n)

    async with TaskSet() as tasks:
        for n in range(3):
            tasks.create_task(job(n))
        release.set()
    assert sorted(done) == [0, 1, 2]


async def test_a_failing_task_cancels_the_others_and_the_block_and_is_raised_as_itself():
    never, cancelled, block_reached_end = asyncio.Event(), [], []

    async def waits() -> None:
        try:
            await never.wait()
        except asyncio.CancelledError:
            cancelled.append("task")
            raise

    async def fails() -> None:
        raise Boom("first")

    with pytest.raises(Boom, match="first"):
        async with TaskSet() as tasks:
            tasks.create_task(waits())
            tasks.create_task(fails())
            try:
                await never.wait()  # where the scheduler waits for ready bodies
            except asyncio.CancelledError:
                cancelled.append("block")
                raise
            block_reached_end.append(True)
    assert sorted(cancelled) == ["block", "task"] and not block_reached_end


async def test_a_failure_while_the_block_waits_for_its_tasks_is_raised_after_all_end():
    release, ended = asyncio.Event(), []

    async def fails_later() -> None:
        await release.wait()
        raise Boom("late")

    async def ends() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(True)

    with pytest.raises(Boom, match="late"):
        async with TaskSet() as tasks:
            tasks.create_task(ends())
            tasks.create_task(fails_later())
            release.set()  # the failure comes once the block is already leaving
    assert ended == [True]


async def test_a_task_failing_in_the_step_the_block_leaves_is_raised():
    # found by review: the task is done when the block leaves, but its done-callback (which
    # records the failure) has not run yet; the failure was lost and the schedule ended as if
    # every episode timed out
    go = asyncio.Event()

    async def fails() -> None:
        await go.wait()
        raise Boom("at the exit")

    with pytest.raises(Boom, match="at the exit"):
        async with TaskSet() as tasks:
            tasks.create_task(fails())
            go.set()
            await asyncio.sleep(0)  # the task runs and fails; the block leaves in the same step
    assert asyncio.current_task().cancelling() == 0  # nothing of the set's own cancel is left over


class _Forever:
    """A block that waits forever, with one task that does too: what ended and when it started."""

    def __init__(self) -> None:
        self.started, self.ended = asyncio.Event(), []

    async def _job(self) -> None:
        self.started.set()
        try:
            await asyncio.Event().wait()
        finally:
            self.ended.append(True)

    async def block(self) -> None:
        async with TaskSet() as tasks:
            tasks.create_task(self._job())
            await asyncio.Event().wait()


async def test_a_cancellation_from_outside_cancels_every_task_and_is_raised():
    forever = _Forever()
    outer = asyncio.get_running_loop().create_task(forever.block())
    await forever.started.wait()
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert forever.ended == [True]


async def test_a_timeout_around_the_block_ends_its_tasks():
    forever = _Forever()
    with pytest.raises(asyncio.TimeoutError):
        # The scheduler's call timeout, as in run(): the behaviour under test, not a speed limit. The
        # block never ends, so only the timeout can end it, however late it fires; and the job's first
        # step is queued before the timer's callback can run, so it has started by then.
        await asyncio.wait_for(forever.block(), 0.05)
    assert forever.started.is_set() and forever.ended == [True]
