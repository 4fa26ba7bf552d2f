"""What every tier shares: the repository's paths, the served model names, the replies in each
backend's declared answer format, free loopback ports, polling for a condition, reading an
HTTP head off a raw socket, and the lines a tier prints at the end of the run."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
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


# A tier's end-of-run lines (what it measured). Tiers register a function here instead of their
# own `pytest_terminal_summary`: under pytest-xdist a tier runs in a worker process, whose
# terminal is not shown, so tests/conftest.py sends every worker's lines to the main process.
SUMMARIES: list[Callable[[], list[str]]] = []


def summary_lines() -> list[str]:
    return [line for summary in SUMMARIES for line in summary()]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports, below the kernel's ephemeral range (all bound at once, so
    none is handed out twice). A port from bind(0) is an ephemeral one, and the kernel may hand
    it to any outgoing connection or bind(0) before the server binds it: a real vLLM loading
    for a minute opens many (one took the proxy's port in a CI run). These it never hands out."""
    rng = random.SystemRandom()
    low = min(_ephemeral_low(), 65536)
    # Under pytest-xdist each worker draws from its own slice: between our check and the server's
    # bind, another worker cannot pick the same port.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    span = (low - 10000) // workers
    start = 10000 + span * (int(worker[2:]) if worker[2:].isdigit() else 0) % max(1, low - 10000)
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(1000 * count):
            if len(ports) == count:
                return ports
            port = rng.randrange(start, start + span)
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use (or ours already)
                continue
            ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"no {count} free loopback ports between 10000 and {low}")


def free_port() -> int:
    return free_ports(1)[0]


# The timeout of a wait for a condition: it only bounds a hang. Under CI's load (four workers and
# real vLLM starts on two cores) a process has taken over 20 s to import, so no wait is shorter.
HANG_S = 60.0


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


@contextlib.contextmanager
def release_when(predicate: Callable[[], Any], release: threading.Event, timeout_s: float,
                 what: str) -> Iterator[dict[str, bool]]:
    """Overlap, not time: a watcher thread sets `release` (the event a fake holds its replies on)
    once `predicate()` holds; the yielded dict's "met" says whether it did, within `timeout_s` (a
    hang bound) and before the block ended. Leaving the block stops the watcher at once and releases."""
    seen = {"met": False}
    done = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        try:
            while not done.is_set() and time.monotonic() < deadline:
                if predicate():
                    seen["met"] = True
                    return
                done.wait(0.05)
        finally:
            release.set()

    watcher = threading.Thread(target=watch, name=f"release when {what}")
    watcher.start()
    try:
        yield seen
    finally:
        done.set()
        release.set()
        watcher.join()


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


def assert_unopened(fifo: Path) -> None:
    """Opening a FIFO write-only without blocking fails with ENXIO exactly when no reader has it open:
    the proof that nothing opened a file it must not read."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as err:
        assert err.errno == errno.ENXIO, err
        return
    os.close(fd)  # which also releases a reader blocked on it
    raise AssertionError(f"something has {fifo} open for reading")
