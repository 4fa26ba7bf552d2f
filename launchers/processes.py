"""Processes and process groups, through psutil (no /proc parsing: works wherever psutil does).

A zombie (exited, not reaped yet) counts as gone everywhere here. A process is identified by its
pid *and* its start time (`psutil.Process.create_time()`), so a pid reused by an unrelated
process is never mistaken for one we started.
"""

from __future__ import annotations

import contextlib
import os
import signal

import psutil

__all__ = ["describe_exit", "group_members", "live_groups", "pid_alive", "process_start_time",
           "same_process", "signal_group", "start_matches"]

_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
# The start time as earlier launchers recorded it: clock ticks since boot (an int).
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_start_time(pid: int) -> float | None:
    """Seconds since the epoch when `pid` started, or None when there is no such process."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def same_process(pid: int, recorded_start: float | None) -> bool:
    """`pid` is alive and is the process whose start time was recorded (None: not recorded)."""
    return pid_alive(pid) and (recorded_start is None
                               or start_matches(process_start_time(pid), recorded_start))


def start_matches(started: float | None, recorded_start: float | None) -> bool:
    """A process's start time (process_start_time) is the one recorded (None: not recorded)."""
    if recorded_start is None:
        return True
    if started is None:
        return False
    if isinstance(recorded_start, int) and not isinstance(recorded_start, bool):
        # A pid file from a launcher that recorded clock ticks since boot.
        ticks = (started - psutil.boot_time()) * _CLOCK_TICKS
        return abs(ticks - recorded_start) <= _CLOCK_TICKS
    # create_time() is derived from the boot time, which some kernels report a second apart.
    return abs(started - recorded_start) <= 2.0


def pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() not in _GONE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # someone else's process, but it exists


def live_groups() -> dict[int, list[int]]:
    """Live processes by process group, from one scan of the process table."""
    groups: dict[int, list[int]] = {}
    for process in psutil.process_iter(["status"]):
        if process.info.get("status") in _GONE:
            continue
        try:
            pgid = os.getpgid(process.pid)
        except (ProcessLookupError, PermissionError):
            continue
        groups.setdefault(pgid, []).append(process.pid)
    return groups


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group (a pid that is still some group's id is never reused)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []  # nothing in the group, not even a zombie: skip the scan
    except PermissionError:
        pass
    return live_groups().get(pgid, [])


def signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def describe_exit(code: int | None, *, asked_to_stop: bool = False) -> str:
    """How a process ended, from its Popen returncode (negative: the signal that killed it).

    Code 0 from a process nobody asked to stop is a server that quit by itself: never reported
    as a plain "exited with code 0", which reads like success.
    """
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == 0 and not asked_to_stop:
        return "exited on its own (code 0)"
    return f"exited with code {code}"
