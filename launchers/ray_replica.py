"""What runs on a Ray node for one replica: a named actor that owns one stock `vllm serve`.

The actor holds its placement group bundle's GPUs (Ray sets them aside for it) and starts the
command line `up` built, unmodified, with CUDA_VISIBLE_DEVICES naming exactly the GPUs Ray
assigned. The server runs in its own session (its tensor-parallel workers in its group) and gets
SIGKILL if the actor's process dies (PR_SET_PDEATHSIG, through util-linux's setpriv where the node
has it), so a driver or node failure that takes the actor down leaves no server behind; a restart
first kills what is left of the previous server's process group. Its output goes to a log file
on that node; `log_tail` reads it back.

Standard library only (plus ray inside the methods): the class is shipped to the nodes by value,
so the cluster needs ray but not this project installed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _with_pdeathsig(argv: list[str]) -> tuple[list[str], Callable[[], None] | None]:
    """The command and a pre-exec hook giving the server SIGKILL when the actor process dies.
    Resolved here, on the node and in the parent: util-linux's setpriv when the node has it (no
    Python runs after fork), else prctl looked up now, so the child only makes the call."""
    setpriv = shutil.which("setpriv")
    if setpriv:
        return [setpriv, "--pdeathsig", "KILL", "--", *argv], None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the actor's own stop() is the only cleanup
        return argv, None
    return argv, lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ReplicaProcess:
    def __init__(self, name: str, run_id: str) -> None:
        self.name = name
        # A directory of its own, made new (mkdtemp: owner-only, a name nobody can guess and plant
        # first): a fixed /tmp path let another local user pre-create it and link the log to any
        # file the launching user may write, or read every replica's log.
        folder = tempfile.mkdtemp(prefix=f"vlm-reward-proxy-ray-{run_id}-{name}-")
        self.log_path = Path(folder) / f"{name}.log"
        self.popen: subprocess.Popen | None = None

    def node(self) -> dict:
        """Where Ray put this actor and which GPUs it holds."""
        import ray

        context = ray.get_runtime_context()
        return {"node_ip": ray.util.get_node_ip_address(), "node_id": context.get_node_id(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "log": str(self.log_path),
                "hostname": os.uname().nodename}

    def start(self, argv: list[str], env: dict[str, str]) -> int:
        """Start (or restart) the server; its pid. CUDA_VISIBLE_DEVICES is the assigned GPUs."""
        import ray

        if self.popen is not None and self.popen.poll() is None:
            raise RuntimeError(f"{self.name} is already running (pid {self.popen.pid})")
        if self.popen is not None:  # its leader exited: workers of its group may still hold the GPUs
            self._kill_group(self.popen.pid)
        child_env = {**os.environ, **env, "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in ray.get_gpu_ids())}
        wrapped, preexec = _with_pdeathsig(argv)
        # O_NOFOLLOW: the log is never a link, whoever could write in the folder since
        with os.fdopen(os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600),
                       "ab") as log:
            log.write(f"# {' '.join(argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(wrapped, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=child_env, start_new_session=True,
                                          preexec_fn=preexec)  # noqa: PLW1509 - only prctl, resolved before
        return self.popen.pid

    @staticmethod
    def _kill_group(pgid: int, wait_s: float = 10.0) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.05)

    def poll(self) -> int | None:
        """None while the server runs; its exit code once it has exited."""
        return None if self.popen is None else self.popen.poll()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as err:
            return f"(no log at {self.log_path}: {err.strerror})"

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM to the server's group, SIGKILL after `grace_s`; its exit code."""
        if self.popen is None:
            return None
        for signum, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.popen.pid, signum)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and _group_alive(self.popen.pid):
                self.popen.poll()
                time.sleep(0.05)
            if not _group_alive(self.popen.pid):
                break
        try:
            return self.popen.wait(10)
        except subprocess.TimeoutExpired:
            return None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie group leader still counts as a member until reaped: check for live members
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False
