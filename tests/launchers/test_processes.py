"""Process groups and start times through psutil, and `down`'s refusal to signal a reused pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from launchers.pidfile import read_pid_file, stop_from_pid_file, up_is_running, write_pid_file
from launchers.processes import (
    group_members,
    live_groups,
    pid_alive,
    process_start_time,
    same_process,
    signal_group,
)
from tests.launchers.conftest import HANG_S, wait_until

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def own_group(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def test_start_time_identifies_a_process():
    pid = os.getpid()
    started = process_start_time(pid)
    assert started == psutil.Process(pid).create_time()
    assert same_process(pid, started) and same_process(pid, None)
    assert not same_process(pid, started - 3600)  # a pid reused by another process
    # Pid files of earlier launchers recorded clock ticks since boot.
    ticks = round((started - psutil.boot_time()) * os.sysconf("SC_CLK_TCK"))
    assert same_process(pid, ticks) and not same_process(pid, ticks - 3600 * 100)


def test_a_zombie_is_gone_and_its_group_is_empty():
    child = own_group([sys.executable, "-c", "pass"])
    try:
        wait_until(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, HANG_S,
                   "the child to exit (unreaped)")
        assert process_start_time(child.pid) is not None  # still in the process table
        assert not pid_alive(child.pid)
        assert group_members(child.pid) == [] and child.pid not in live_groups()
    finally:
        child.wait()
    assert not pid_alive(child.pid) and process_start_time(child.pid) is None


def test_group_members_include_workers_after_the_leader_died():
    code = ("import subprocess, sys, time\n"
            f"subprocess.Popen({SLEEPER!r})\n"
            "print('worker started', flush=True)\n")
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert leader.stdout.readline().strip() == "worker started"
        leader.wait(10)  # the leader exits; its worker keeps the group alive
        workers = wait_until(lambda: group_members(leader.pid), HANG_S, "the orphaned worker")
        assert len(workers) == 1 and workers[0] != leader.pid
        assert os.getpgid(workers[0]) == leader.pid
        signal_group(leader.pid, signal.SIGKILL)
        wait_until(lambda: group_members(leader.pid) == [], HANG_S, "the group to be empty")
    finally:
        signal_group(leader.pid, signal.SIGKILL)
        leader.stdout.close()


def test_down_never_signals_a_pid_that_was_reused(tmp_path: Path):
    unrelated = own_group(SLEEPER)
    try:
        pid_file = tmp_path / "stack.json"
        write_pid_file(pid_file, {
            "up_pid": unrelated.pid, "up_start": process_start_time(unrelated.pid) - 1000,
            "state": "running", "config": "c.yaml", "run_dir": str(tmp_path),
            "processes": [{"name": "PRIMO-R1-r0", "pid": unrelated.pid,
                           "start": process_start_time(unrelated.pid) - 1000, "url": "u",
                           "log": "l"}]})
        assert not up_is_running(read_pid_file(pid_file))
        lines: list[str] = []
        assert stop_from_pid_file(pid_file, grace_s=1, say=lines.append) == 0
        assert lines == ["stack stopped"]
        assert unrelated.poll() is None and pid_alive(unrelated.pid)
        assert not pid_file.exists()
    finally:
        unrelated.kill()
        unrelated.wait()


def test_down_stops_a_recorded_group_whose_start_time_matches(tmp_path: Path):
    server = own_group(SLEEPER)
    try:
        pid_file = tmp_path / "stack.json"
        write_pid_file(pid_file, {
            "up_pid": 999999999, "up_start": None, "state": "running", "config": "c.yaml",
            "run_dir": str(tmp_path),
            "processes": [{"name": "PRIMO-R1-r0", "pid": server.pid,
                           "start": process_start_time(server.pid), "url": "u", "log": "l"}]})
        lines: list[str] = []
        assert stop_from_pid_file(pid_file, grace_s=5, say=lines.append) == 0
        assert lines == [f"PRIMO-R1-r0 (pid {server.pid}): stopped", "stack stopped"]
        assert server.wait(10) == -signal.SIGTERM
    finally:
        server.kill()
        server.wait()
