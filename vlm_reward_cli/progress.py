"""One status line for a long command (replay, eval): rewritten in place on a terminal, every
10 % otherwise (a log file gets ten lines, not thousands)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressLine"]


class ProgressLine:
    def __init__(self, name: str, total: int | None = None, stream: TextIO | None = None) -> None:
        self.name, self.total = name, total
        self.stream = stream or sys.stderr
        self.tty, self.started, self.last_tenth = self.stream.isatty(), time.monotonic(), -1

    def __call__(self, done: int, detail: str = "", total: int | None = None) -> None:
        total = total if total is not None else self.total
        rate = done / max(time.monotonic() - self.started, 1e-9)
        text = f"{self.name}: {done}{f'/{total}' if total else ''} done ({rate:.1f}/s)"
        text += f", {detail}" if detail else ""
        if self.tty:
            self.stream.write("\r" + text)
        elif total and (tenth := 10 * done // total) != self.last_tenth:
            self.last_tenth = tenth
            self.stream.write(text + "\n")
        self.stream.flush()
