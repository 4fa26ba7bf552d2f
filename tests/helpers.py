"""What every tier shares: the repository's paths, the served model names, the replies in each
backend's declared answer format, free loopback ports, polling for a condition, and reading an
HTTP head off a raw socket."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PROMPTS_DIR = REPO / "prompts"
QWEN_MODEL = "Qwen2.5-VL-7B-Instruct"
PRIMO_MODEL = "PRIMO-R1-7B"
# Replies in the answer format each backend's template declares (0.75 and 0.6).
QWEN_REPLY = "<score>75</score>"
PRIMO_REPLY = ("<think><planning>1. grasp 2. place</planning><observation>bowl moved 3 cm</observation>"
               "<reasoning>step 1 of 2 done</reasoning></think><answer>60</answer>")


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (all bound at once, so none is handed out twice)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def free_port() -> int:
    return free_ports(1)[0]


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.05) -> Any:
    """Poll until `predicate()` is truthy (its value is returned); fail naming `what` after
    `timeout_s`. A condition, never a fixed sleep: the timeout only bounds a hang."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def read_http_head(sock: socket.socket) -> bytes:
    """What `sock` sends up to and including the blank line that ends an HTTP head (plus whatever
    came with it: the start of the body), or all it sent before closing, if it closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data
