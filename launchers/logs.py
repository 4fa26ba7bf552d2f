"""Reading children's logs: the last lines, and the last line that says what went wrong.

vLLM prefixes its lines with the process (`(EngineCore_0 pid=7) `) and a level, timestamp and
source (`ERROR 09-10 12:34:56 [core.py:700] `); a crash ends with a Python traceback whose last
line names the exception (`RuntimeError: Engine core initialization failed...`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["indent", "last_error_line", "tail_lines"]

_TAIL_BYTES = 64 * 1024
_ERROR_SCAN_LINES = 200
_QUOTE_CHARS = 240

_PROCESS_PREFIX = re.compile(r"^\s*(?:\([\w.-]+ pid=\d+\)\s*)?")
_LEVEL = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)\b:?\s*"
                    r"(?:\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+)?(?:\[?[\w./-]+:\d+\]\s?)?")
# The last line of a traceback: `RuntimeError: ...`, `torch.OutOfMemoryError: ...`, `KeyError`.
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)(?::\s.*)?$")
_ENGINE_FAILURE = re.compile(r"\bengine ?core\b.*\b(?:fail\w*|died|dead|crash\w*)\b", re.IGNORECASE)
_TRACEBACK_FURNITURE = re.compile(r"^(?:\s|Traceback \(most recent call last\)|File \"|[~^]+$|$)")


def tail_lines(path: Path, count: int) -> str:
    """The last `count` lines of a file (from its last 64 KiB); "" when it cannot be read."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - _TAIL_BYTES))
            data = log.read()
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-count:])


def _is_error_line(line: str) -> bool:
    text = line[_PROCESS_PREFIX.match(line).end():]
    level = _LEVEL.match(text)
    message = text[level.end():] if level else text
    if _EXCEPTION.match(message.rstrip()):
        return True
    if level and level.group("level") in ("ERROR", "CRITICAL", "FATAL"):
        return not _TRACEBACK_FURNITURE.match(message)  # a frame of a logged traceback says little
    return bool(_ENGINE_FAILURE.search(message)) and not _TRACEBACK_FURNITURE.match(message)


def last_error_line(text: str) -> str | None:
    """The last line of `text` (a log's tail) that reports an error, shortened; None if none.

    Error lines: a Python exception (`RuntimeError: ...`, the end of a traceback), a line logged
    at ERROR/CRITICAL level that is not a traceback frame, or an engine-core failure.
    """
    for line in reversed(text.splitlines()[-_ERROR_SCAN_LINES:]):
        if _is_error_line(line):
            line = line.strip()
            return line if len(line) <= _QUOTE_CHARS else line[:_QUOTE_CHARS - 3] + "..."
    return None


def indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines()) or "    (empty log)"
