"""`up --detach`: run `up` in its own session and return once the stack is ready or has failed."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from launchers.logs import tail_lines
from launchers.pidfile import read_pid_file
from launchers.processes import describe_exit

__all__ = ["run_detached"]


def run_detached(argv: list[str], *, run_dir: Path, pid_file: Path, poll_interval_s: float,
                 say: Callable[[str], None], warn: Callable[[str], None]) -> int:
    """Start `argv` (an `up` command line) in a new session with output to RUN_DIR/up.log, echo
    that output, and return 0 once the pid file says running, or non-zero when it stopped."""
    up_log = run_dir / "up.log"
    with open(up_log, "ab") as log:
        # No Popen object: the background `up` outlives this process, which must not reap it.
        pid = os.posix_spawn(argv[0], argv, dict(os.environ), setsid=True, file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, log.fileno(), 1), (os.POSIX_SPAWN_DUP2, log.fileno(), 2)])
    say(f"`up` runs in the background (pid {pid}); its output: {up_log}")
    offset = 0
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            offset = _echo_new(up_log, offset)
            if done:
                code = os.waitstatus_to_exitcode(status)
                warn(f"error: the background `up` (pid {pid}) {describe_exit(code)} before the "
                     f"stack was ready; see {up_log}:\n" + tail_lines(up_log, 5))
                return code if code > 0 else 1
            data = read_pid_file(pid_file) or {}
            if data.get("up_pid") == pid and data.get("state") == "running":
                _echo_new(up_log, offset)  # the lines `up` wrote before the file said running
                say(f"stack is up; stop it with: vlm-reward-proxy down --pid-file {pid_file}")
                return 0
            time.sleep(poll_interval_s)
    except KeyboardInterrupt:
        warn(f"still starting in the background (pid {pid}); stop it with "
             f"`vlm-reward-proxy down --pid-file {pid_file}`")
        return 130


def _echo_new(path: Path, offset: int) -> int:
    try:
        with open(path, "rb") as log:
            log.seek(offset)
            data = log.read()
    except OSError:
        return offset
    end = data.rfind(b"\n") + 1
    if end:
        sys.stdout.write(data[:end].decode(errors="replace"))
        sys.stdout.flush()
    return offset + end
