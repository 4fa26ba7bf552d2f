"""Process management for `vlm-reward-proxy up` and `down`.

Each `vllm serve` (and the proxy) runs in its own session, so its process group holds the tensor-
parallel workers it spawns: stopping a child means signalling its whole group, SIGTERM then
SIGKILL after a grace period, until no live process of the group is left (no orphan keeps GPU
memory). Output goes to `<run_dir>/<name>.log`. A JSON pid file lets `down` stop a stack started
in the background, even when the `up` process itself was killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from proxy.health import probe
from proxy.launch.commands import ReplicaCommand, shell_line

Say = Callable[[str], None]


# -- processes as /proc shows them (a zombie, exited but not reaped, counts as gone) ----------
def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, process group, start time in clock ticks), or None when there is no such pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # fields 3.. of proc(5); comm may hold spaces
    return fields[0], int(fields[2]), int(fields[19])


def process_start_time(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return stat[2] if stat else None


def pid_alive(pid: int) -> bool:
    stat = _proc_stat(pid)
    if stat is not None:
        return stat[0] not in ("Z", "X")
    if os.path.isdir("/proc/self"):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_groups() -> dict[int, list[int]]:
    """Live processes by process group, from one scan of /proc."""
    groups: dict[int, list[int]] = {}
    with os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit():
                stat = _proc_stat(int(entry.name))
                if stat and stat[0] not in ("Z", "X"):
                    groups.setdefault(stat[1], []).append(int(entry.name))
    return groups


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group (Linux never reuses a pid that is still a pgid)."""
    if os.path.isdir("/proc/self"):
        return live_groups().get(pgid, [])
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []
    except PermissionError:
        pass
    return [pgid]


def signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def tail_lines(path: Path, count: int) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 64 * 1024))
            data = log.read()
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-count:])


class StackFailure(Exception):
    """Start-up (or proxy) failure: `up` stops everything and exits non-zero with this text."""


class StopRequested(Exception):
    """SIGINT / SIGTERM / SIGHUP arrived."""


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log_path: Path
    url: str  # server root probed for readiness, e.g. http://127.0.0.1:8001
    model: str | None  # served-model-name to find in /v1/models; None for the proxy
    started: float
    start_ticks: int | None
    api_key: str | None = None
    ready_after: float | None = None
    reason: str = "not probed yet"
    exit_reported: bool = False
    killed: bool = False
    log_offset: int = 0

    @property
    def pid(self) -> int:
        return self.popen.pid


class Stack:
    def __init__(self, run_dir: Path, *, say: Say, pid_file: Path | None = None,
                 config_path: Path | None = None, poll_interval_s: float = 1.0,
                 progress_interval_s: float = 15.0, grace_s: float = 20.0,
                 echo: str = "proxy") -> None:
        self.run_dir, self.pid_file, self.config_path = run_dir, pid_file, config_path
        self.say, self.echo = say, echo
        self.poll_interval_s, self.progress_interval_s, self.grace_s = (
            poll_interval_s, progress_interval_s, grace_s)
        self.children: list[Child] = []
        self.stop_requested = threading.Event()
        self.force = threading.Event()  # a second signal: skip the grace period
        self.state = "starting"
        self._loop = asyncio.new_event_loop()
        self._http = httpx.AsyncClient(trust_env=False, timeout=2.0)

    # -- signals -----------------------------------------------------------------------------
    def on_signal(self, signum: int, _frame: object = None) -> None:
        if self.stop_requested.is_set():
            self.force.set()
        self.stop_requested.set()

    def _sleep(self) -> None:
        if self.stop_requested.wait(self.poll_interval_s):
            raise StopRequested

    # -- starting ----------------------------------------------------------------------------
    def start(self, name: str, argv: list[str], env: dict[str, str], url: str,
              model: str | None, *, display: str | None = None,
              api_key: str | None = None) -> Child:
        log_path = self.run_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            log.write(f"# {display or shell_line(argv, env)}\n".encode())
            log.flush()
            try:
                popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env={**os.environ, **env},
                                         start_new_session=True)
            except OSError as err:
                raise StackFailure(f"cannot start {name}: {argv[0]}: {err.strerror}") from err
        child = Child(name=name, popen=popen, log_path=log_path, url=url, model=model,
                      started=time.monotonic(), start_ticks=process_start_time(popen.pid),
                      api_key=api_key)
        self.children.append(child)
        self.write_pid_file()
        return child

    def start_replica(self, command: ReplicaCommand) -> Child:
        gpus = ("GPUs " if len(command.gpus) > 1 else "GPU ") + ",".join(map(str, command.gpus))
        self.say(f"starting {command.name} ({gpus}, port {command.port}, log "
                 f"{self.run_dir / (command.name + '.log')}):\n  {command.shell_line()}")
        child = self.start(command.name, command.argv, command.full_env(), command.base_url,
                           command.model, display=command.shell_line(), api_key=command.api_key)
        self.say(f"  pid {child.pid}")
        return child

    def probe(self, child: Child) -> bool:
        """The proxy's own readiness probe (proxy/health.py), run on this stack's private loop."""
        base_url = child.url if child.model is None else child.url + "/v1"
        readiness = self._loop.run_until_complete(
            probe(self._http, base_url, child.model, timeout_s=2.0, api_key=child.api_key))
        child.reason = readiness.reason or ""
        return readiness.ready

    def wait_ready(self, children: list[Child], timeout_s: float) -> None:
        """Until every child answers; a child that exits or the timeout is a StackFailure."""
        begin = time.monotonic()
        last_progress = begin
        loading = list(children)
        while True:
            for child in list(loading):
                code = child.popen.poll()
                if code is not None:
                    child.exit_reported = True
                    raise StackFailure(
                        f"{child.name} (pid {child.pid}) {describe_exit(code)} while loading, after "
                        f"{time.monotonic() - child.started:.1f}s; last lines of {child.log_path}:\n"
                        + _indent(tail_lines(child.log_path, 30)))
                if self.probe(child):
                    child.ready_after = time.monotonic() - child.started
                    loading.remove(child)
                    self.say(f"ready: {child.name} at {child.url} after {child.ready_after:.1f}s")
            self.echo_logs()
            if not loading:
                return
            now = time.monotonic()
            if now - begin > timeout_s:
                raise StackFailure(f"timed out after {timeout_s:.0f}s waiting for " + "; ".join(
                    f"{c.name} ({c.reason}); last lines of {c.log_path}:\n"
                    + _indent(tail_lines(c.log_path, 10)) for c in loading))
            if now - last_progress >= self.progress_interval_s:
                last_progress = now
                self.say(self.progress_line(loading, now))
            self._sleep()

    def progress_line(self, loading: list[Child], now: float) -> str:
        parts = []
        for child in loading:
            last = tail_lines(child.log_path, 1).strip()
            last = last if len(last) <= 100 else last[:97] + "..."
            parts.append(f"  {child.name}: loading for {now - child.started:.0f}s ({child.reason})"
                         + (f"; log: {last}" if last and not last.startswith("# ") else ""))
        done = [f"{c.name} ({c.ready_after:.0f}s)" for c in self.children
                if c.ready_after is not None and c.model is not None]
        return "\n".join([f"waiting for {len(loading)} server(s)"
                          + (f"; ready: {', '.join(done)}" if done else ""), *parts])

    # -- running -----------------------------------------------------------------------------
    def monitor(self) -> None:
        """Until a stop is requested; a vLLM server that dies is reported, the proxy dying fails."""
        while True:
            self.echo_logs()
            for child in self.children:
                code = child.popen.poll()
                if code is None or child.exit_reported:
                    continue
                child.exit_reported = True
                if child.model is None:
                    raise StackFailure(f"the proxy (pid {child.pid}) {describe_exit(code)}; last "
                                       f"lines of {child.log_path}:\n"
                                       + _indent(tail_lines(child.log_path, 30)))
                # Its tensor-parallel workers are useless now and may hold GPU memory.
                signal_group(child.pid, signal.SIGKILL)
                self.say(f"error: {child.name} (pid {child.pid}) {describe_exit(code)} after "
                         f"{time.monotonic() - child.started:.0f}s; the proxy now reports "
                         f"{child.url}/v1 as not ready in /health; last lines of {child.log_path}:\n"
                         + _indent(tail_lines(child.log_path, 30)))
            self._sleep()

    def echo_logs(self) -> None:
        """Copy new complete log lines to the console, prefixed with the child's name."""
        for child in self.children:
            if self.echo == "none" or (self.echo == "proxy" and child.model is not None):
                continue
            try:
                with open(child.log_path, "rb") as log:
                    log.seek(child.log_offset)
                    data = log.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            child.log_offset += end
            for line in data[:end].decode(errors="replace").splitlines():
                self.say(f"[{child.name}] {line}")

    # -- stopping ----------------------------------------------------------------------------
    def shutdown(self) -> list[str]:
        """SIGTERM every child's group (proxy first), SIGKILL what is left after the grace period.

        Returns one report line per child with its exit status.
        """
        if self.children:
            self.state = "stopping"
            self.write_pid_file()
        for child in sorted(self.children, key=lambda c: c.model is not None):
            if child.popen.poll() is None or group_members(child.pid):
                signal_group(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while self._still_running() and time.monotonic() < deadline and not self.force.is_set():
            self.force.wait(0.1)
        for child in self.children:
            if child.popen.poll() is None or group_members(child.pid):
                child.killed = True
                signal_group(child.pid, signal.SIGKILL)
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(10)
        deadline = time.monotonic() + 10
        while self._still_running() and time.monotonic() < deadline:
            time.sleep(0.05)
        report = []
        for child in sorted(self.children, key=lambda c: c.model is not None):
            line = f"{child.name} (pid {child.pid}): {describe_exit(child.popen.returncode)}"
            if child.killed:
                line += f" (still running {self.grace_s:g}s after SIGTERM)"
            if group_members(child.pid):
                line += "; WARNING: processes of its group are still alive"
            report.append(line)
        return report

    def _still_running(self) -> bool:
        if any(c.popen.poll() is None for c in self.children):
            return True
        groups = live_groups() if os.path.isdir("/proc/self") else None
        return any(groups.get(c.pid) if groups is not None else group_members(c.pid)
                   for c in self.children)

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._http.aclose())
            self._loop.close()
        if self.pid_file is not None and (read_pid_file(self.pid_file) or {}).get("up_pid") == os.getpid():
            self.pid_file.unlink(missing_ok=True)

    # -- pid file ----------------------------------------------------------------------------
    def write_pid_file(self, state: str | None = None) -> None:
        if state is not None:
            self.state = state
        if self.pid_file is None:
            return
        data = {
            "up_pid": os.getpid(), "up_start": process_start_time(os.getpid()),
            "state": self.state, "config": str(self.config_path), "run_dir": str(self.run_dir),
            "processes": [{"name": c.name, "pid": c.pid, "start": c.start_ticks, "url": c.url,
                           "log": str(c.log_path)} for c in self.children],
        }
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.pid_file.with_name(self.pid_file.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.pid_file)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines()) or "    (empty log)"


def read_pid_file(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def up_is_running(data: dict) -> bool:
    """The `up` process of a pid file is alive (and is the same process, not a reused pid)."""
    pid = data.get("up_pid")
    return isinstance(pid, int) and pid_alive(pid) and (
        data.get("up_start") is None or process_start_time(pid) == data.get("up_start"))


def ports_in_use(endpoints: list[tuple[str, int, str]]) -> list[str]:
    """Errors for (host, port, who) that cannot be bound now: an old server still listening."""
    errors = []
    for host, port, who in endpoints:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as err:
                errors.append(f"port {port} on {host} ({who}) is not free: {err.strerror} "
                              "(a server from an earlier run? `vlm-reward-proxy down` stops one)")
    return errors


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
    left = []
    for proc in data.get("processes", []):
        pgid = proc["pid"]
        if not group_members(pgid):
            continue
        leader_start = process_start_time(pgid)
        if leader_start is not None and proc.get("start") not in (None, leader_start):
            continue  # the pid was reused by an unrelated process
        left.append(proc)
        signal_group(pgid, signal.SIGTERM)
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
