"""Running the stack: start each child in its own session, wait until ready, watch, stop.

Each `vllm serve` (and the proxy) runs in its own session, so its process group holds the tensor-
parallel workers it spawns: stopping a child means signalling its whole group, SIGTERM then
SIGKILL after a grace period, until no live process of the group is left (no orphan keeps GPU
memory). Output goes to `<run_dir>/<name>.log`. Readiness is proxy/upstream/health.py's `probe`, the same
one the proxy uses, run on a private event loop (this module is synchronous).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from launchers.commands import ReplicaCommand, shell_line
from launchers.logs import indent, last_error_line, tail_lines
from launchers.pidfile import read_pid_file, write_pid_file
from launchers.processes import describe_exit, group_members, live_groups, process_start_time, signal_group
from proxy.upstream.health import Readiness, probe

__all__ = ["Child", "Stack", "StackFailure", "StopRequested"]

Say = Callable[[str], None]
_FAILURE_TAIL_LINES = 30


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
    started: float  # time.monotonic()
    start_time: float | None  # psutil create_time, recorded in the pid file
    api_key: str | None = None
    ready_after: float | None = None
    reason: str = "not probed yet"
    exit_reported: bool = False
    stop_sent: bool = False  # `up` sent its group SIGTERM/SIGKILL (an exit after it was asked)
    killed: bool = False
    log_offset: int = 0

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exit_summary(self, code: int, phase: str) -> str:
        """One line: who, how it ended, when, and the last error line of its log if any."""
        line = (f"{self.name} (pid {self.pid}) {describe_exit(code, asked_to_stop=self.stop_sent)} "
                f"while {phase}, after {time.monotonic() - self.started:.1f}s")
        error = last_error_line(tail_lines(self.log_path, 200))
        return line + (f"; last error in its log: {error}" if error else "")

    def log_tail(self, count: int = _FAILURE_TAIL_LINES) -> str:
        return f"last lines of {self.log_path}:\n" + indent(tail_lines(self.log_path, count))


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

    def pause(self) -> None:
        """One poll interval; StopRequested as soon as a stop signal arrives."""
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
                      started=time.monotonic(), start_time=process_start_time(popen.pid),
                      api_key=api_key)
        self.children.append(child)
        self.write_pid_file()
        return child

    def start_replica(self, command: ReplicaCommand) -> Child:
        gpus = ("CPU" if command.cpu
                else ("GPUs " if len(command.gpus) > 1 else "GPU ") + ",".join(map(str, command.gpus)))
        self.say(f"starting {command.name} ({gpus}, port {command.port}, log "
                 f"{self.run_dir / (command.name + '.log')}):\n  {command.shell_line()}")
        child = self.start(command.name, command.argv, command.full_env(), command.base_url,
                           command.model, display=command.shell_line(), api_key=command.api_key)
        self.say(f"  pid {child.pid}")
        return child

    def probe_all(self, targets: list[tuple[str, str | None, str | None]]) -> list[Readiness]:
        """The proxy's own readiness probe (proxy/upstream/health.py) of each (base URL, model, key), all at
        once, on this stack's private loop and client."""
        async def all_of() -> list[Readiness]:
            return await asyncio.gather(*(probe(self._http, url, model, timeout_s=2.0,
                                                headers={"authorization": f"Bearer {key}"} if key else None)
                                          for url, model, key in targets))

        return self._loop.run_until_complete(all_of())

    def probe(self, child: Child) -> bool:
        base_url = child.url if child.model is None else child.url + "/v1"
        readiness = self.probe_all([(base_url, child.model, child.api_key)])[0]
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
                    raise StackFailure(f"{child.exit_summary(code, 'loading')}; {child.log_tail()}")
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
                    f"{c.name} ({c.reason}); {c.log_tail(10)}" for c in loading))
            if now - last_progress >= self.progress_interval_s:
                last_progress = now
                self.say(self.progress_line(loading, now))
            self.pause()

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
    def check_proxy(self) -> None:
        """The proxy dying fails the stack."""
        for child in self.children:
            code = child.popen.poll()
            if child.model is None and code is not None:
                child.exit_reported = True
                raise StackFailure(f"the {child.exit_summary(code, 'serving')}; {child.log_tail()}")

    def monitor(self) -> None:
        """Until a stop is requested; a vLLM server that dies is reported, the proxy dying fails."""
        while True:
            self.echo_logs()
            self.check_proxy()
            for child in self.children:
                code = child.popen.poll()
                if code is None or child.exit_reported:
                    continue
                child.exit_reported = True
                # Its tensor-parallel workers are useless now and may hold GPU memory.
                signal_group(child.pid, signal.SIGKILL)
                self.say(f"error: {child.exit_summary(code, 'serving')}; the proxy now reports "
                         f"{child.url}/v1 as not ready in /health; {child.log_tail()}")
            self.pause()

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
    def _stop_group(self, child: Child, signum: int) -> None:
        if child.popen.poll() is None:
            child.stop_sent = True  # its exit from now on was asked for
        signal_group(child.pid, signum)

    def shutdown(self) -> list[str]:
        """SIGTERM every child's group (proxy first), SIGKILL what is left after the grace period.

        Returns one report line per child with its exit status.
        """
        if self.children:
            self.state = "stopping"
            self.write_pid_file()
        for child in sorted(self.children, key=lambda c: c.model is not None):
            if child.popen.poll() is None or group_members(child.pid):
                self._stop_group(child, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while self._still_running() and time.monotonic() < deadline and not self.force.is_set():
            self.force.wait(0.1)
        for child in self.children:
            if child.popen.poll() is None or group_members(child.pid):
                child.killed = True
                self._stop_group(child, signal.SIGKILL)
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(10)
        deadline = time.monotonic() + 10
        while self._still_running() and time.monotonic() < deadline:
            time.sleep(0.05)
        return [self._report_line(child)
                for child in sorted(self.children, key=lambda c: c.model is not None)]

    def _report_line(self, child: Child) -> str:
        code = child.popen.returncode
        line = f"{child.name} (pid {child.pid}): {describe_exit(code, asked_to_stop=child.stop_sent)}"
        if child.killed:
            line += f" (still running {self.grace_s:g}s after SIGTERM)"
        if code is not None and not child.stop_sent:
            error = last_error_line(tail_lines(child.log_path, 200))
            line += " before the stop" + (f"; last error in its log: {error}" if error else "")
        if group_members(child.pid):
            line += "; WARNING: processes of its group are still alive"
        return line

    def _still_running(self) -> bool:
        if any(c.popen.poll() is None for c in self.children):
            return True
        groups = live_groups()
        return any(groups.get(c.pid) for c in self.children)

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
        write_pid_file(self.pid_file, {
            "up_pid": os.getpid(), "up_start": process_start_time(os.getpid()),
            "state": self.state, "config": str(self.config_path), "run_dir": str(self.run_dir),
            "processes": [{"name": c.name, "pid": c.pid, "start": c.start_time, "url": c.url,
                           "log": str(c.log_path)} for c in self.children],
        })
