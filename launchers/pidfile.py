"""The pid file `up` writes (default runs/stack.json) and `down`, which stops what it records.

Format (JSON): {"up_pid", "up_start", "state": starting|running|stopping, "config", "run_dir",
"processes": [{"name", "pid", "start", "url", "log"}]}. Each child's pid is also its process
group id; "start"/"up_start" are start times (psutil create_time, seconds since the epoch) so
that `down` never signals a pid the system has since given to an unrelated process.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launchers.processes import (
    group_members,
    pid_alive,
    process_start_time,
    same_process,
    signal_group,
    start_matches,
)

__all__ = ["how_to_stop", "read_pid_file", "stop_from_pid_file", "up_is_running", "write_pid_file"]

Say = Callable[[str], None]


def how_to_stop(pid_file: Path, *, detached: bool) -> str:
    """What stops a running `up`: Ctrl-C reaches only one in the foreground."""
    down = f"`vlm-reward-proxy down --pid-file {pid_file}`"
    return f"Stop with {down}" if detached else f"Stop with Ctrl-C or {down}"


def write_json_atomically(path: Path, data: Any) -> None:
    """Whoever reads it (`down`, a second `up`, a test) never reads half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def write_pid_file(path: Path, data: dict[str, Any]) -> None:
    write_json_atomically(path, data)


def read_pid_file(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def up_is_running(data: dict) -> bool:
    """The `up` process of a pid file is alive (and is the same process, not a reused pid)."""
    pid = data.get("up_pid")
    return isinstance(pid, int) and same_process(pid, data.get("up_start"))


def _group_left(proc: dict) -> bool:
    """The recorded process group still has live members, and its leader is not a reused pid."""
    pgid = proc["pid"]
    if not group_members(pgid):
        return False
    leader_start = process_start_time(pgid)
    # A leader that is gone leaves its group id reserved: the live members are its workers.
    return leader_start is None or start_matches(leader_start, proc.get("start"))


def stop_from_pid_file(pid_file: Path, *, grace_s: float, say: Say) -> int:
    """`down`: ask `up` to stop its stack; then stop any process group it left behind."""
    data = read_pid_file(pid_file)
    if data is None:
        say(f"no running stack: no readable pid file at {pid_file}")
        return 1
    if up_is_running(data):
        pid = data["up_pid"]
        say(f"stopping the stack of `up` (pid {pid}, run dir {data.get('run_dir')})")
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s + 20
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if pid_alive(pid):
            say(f"`up` (pid {pid}) did not stop; stopping its children directly")
    # Whatever is left (`up` killed with SIGKILL, or stuck): signal the recorded groups.
    left = [proc for proc in data.get("processes", []) if _group_left(proc)]
    for proc in left:
        signal_group(proc["pid"], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(group_members(p["pid"]) for p in left) and time.monotonic() < deadline:
        time.sleep(0.1)
    failed = 0
    for proc in left:
        if group_members(proc["pid"]):
            signal_group(proc["pid"], signal.SIGKILL)
            time.sleep(0.2)
        still = group_members(proc["pid"])
        failed += bool(still)
        say(f"{proc['name']} (pid {proc['pid']}): "
            + (f"still alive: {still}" if still else "stopped"))
    if not up_is_running(data):
        pid_file.unlink(missing_ok=True)
    say("stack stopped" if not failed else f"{failed} process group(s) could not be stopped")
    return 1 if failed else 0
