"""What every `up` run shares around its Stack: stop signals caught, and how the run ends."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

from launchers.supervisor import Stack, StackFailure, StopRequested

__all__ = ["StopSignals", "run_until_stopped"]

Say = Callable[[str], None]


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP ask the stack to stop (a second one: without the grace)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.previous: dict[int, Any] = {}

    def catch(self) -> None:
        """Again after a library that installs its own handler (ray.init's calls sys.exit)."""
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                self.previous.setdefault(signum, signal.signal(signum, self.stack.on_signal))

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous.clear()


def run_until_stopped(body: Callable[[], None], *, say: Say, warn: Say) -> int:
    """Run `body` (start, wait, watch): 0 once a stop is asked for, 1 (said) when the stack fails."""
    try:
        body()
    except StopRequested:
        say("stop requested")
    except StackFailure as failure:
        warn(f"error: {failure}")
        return 1
    return 0
