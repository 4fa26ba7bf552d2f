"""Real processes on loopback for the fault suite: the fake vLLM and the proxy as subprocesses,
a raw TCP server for replies no HTTP framework would send, and a /metrics reader.

Every process is killed and waited for, every socket and log file closed, by its owner's
`close()`; the fixtures in conftest.py call it whatever the test did.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import HANG_S, QWEN_REPLY, REPO, free_port, read_http_head

# Children see no proxies or API keys from the machine (as tests/conftest.py does for this process).
_ENV_TO_DROP = {"HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "OPENAI_API_KEY", "OPENAI_BASE_URL", "VLLM_API_KEY"}


def _wait_http(url: str, proc: subprocess.Popen | None, log: Path, timeout_s: float = 120.0,
               ok=lambda r: r.status_code == 200) -> None:
    """Until the process answers `ok`, or it exits (a failure at once). The timeout only bounds a
    hang: 20 s failed a loaded CI run, where a proxy process took longer than that to import."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=1.0, trust_env=False) as http:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if ok(http.get(url)):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up in {timeout_s}s:\n{log.read_text()[-3000:]}")


class _Process:
    """A subprocess with its output in a log file; start/kill/restart keep the same port."""

    def __init__(self, argv: list[str], log: Path, port: int, ready_path: str,
                 env: dict[str, str] | None = None) -> None:
        self.argv, self.log, self.port, self.ready_path = argv, log, port, ready_path
        self.extra_env = env or {}  # test-only switches for this process alone
        self.proc: subprocess.Popen | None = None
        self._log_file = None
        self.starts = 0

    def _ready(self, response: httpx.Response) -> bool:
        return response.status_code == 200

    def start(self):
        if self._log_file is None:
            self._log_file = self.log.open("ab")
        env = {k: v for k, v in os.environ.items() if k.upper() not in _ENV_TO_DROP} | self.extra_env
        self.proc = subprocess.Popen(self.argv, cwd=REPO, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
        self.starts += 1
        _wait_http(f"http://127.0.0.1:{self.port}{self.ready_path}", self.proc, self.log, ok=self._ready)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL (works on a stopped process too) and reap."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(10)

    def restart(self):
        self.kill()
        return self.start()

    def close(self) -> None:
        self.kill()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


class FakeProcess(_Process):
    """`python -m tests.fakes.fake_vllm` on a fixed port, scriptable over /_fake/*."""

    def __init__(self, model: str, log: Path, *, port: int | None = None, default_text: str = QWEN_REPLY,
                 extra: tuple[str, ...] = ()) -> None:
        port = port or free_port()
        argv = [sys.executable, "-m", "tests.fakes.fake_vllm", "--port", str(port),
                "--served-model-name", model, "--default-text", default_text, *extra]
        super().__init__(argv, log, port, "/health")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _control(self, path: str, payload: dict | None = None) -> dict:
        with httpx.Client(timeout=5, trust_env=False) as http:
            url = f"http://127.0.0.1:{self.port}/_fake/{path}"
            response = http.get(url) if payload is None else http.post(url, json=payload)
        response.raise_for_status()
        return response.json()

    def script(self, *actions: dict) -> None:
        self._control("script", {"actions": list(actions)})

    def reset(self) -> None:
        self._control("reset", {})

    def release(self, hold: str) -> None:
        """Let every reply scripted with {"hold": hold} go (it waits for this, however long it takes)."""
        self._control("release", {"hold": hold})

    def chat_count(self) -> int:
        return self._control("requests")["chat_count"]

    def wait_chats(self, count: int, timeout_s: float = HANG_S) -> None:
        deadline = time.monotonic() + timeout_s
        while self.chat_count() < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"fake saw fewer than {count} chat requests in {timeout_s}s")
            time.sleep(0.02)


class ProxyProcess(_Process):
    """`python -m vlm_reward_cli serve --config FILE` on a free port."""

    def __init__(self, settings: dict, workdir: Path, env: dict[str, str] | None = None) -> None:
        port = free_port()
        config = workdir / "proxy.yaml"
        config.write_text(yaml.safe_dump(settings, sort_keys=False))  # the first backend is the default
        argv = [sys.executable, "-m", "vlm_reward_cli", "serve", "--config", str(config), "--port", str(port),
                "--log-level", "info"]
        super().__init__(argv, workdir / "proxy.log", port, "/health", env)

    def _ready(self, response: httpx.Response) -> bool:
        return response.status_code in (200, 503)  # up; backends may be down on purpose

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        super().close()


# -- a raw HTTP/1.1 server: any bytes as the reply, or a TCP reset ------------------------------------
def completion(content: Any, finish_reason: str | None = "stop", model: str = "m") -> dict:
    return {"id": "raw", "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": finish_reason}]}


def http_bytes(status: int, body: bytes, *, content_type: str = "application/json",
               extra: dict[str, str] | None = None, length: int | None = None) -> bytes:
    head = [f"HTTP/1.1 {status} X", f"content-type: {content_type}",
            f"content-length: {len(body) if length is None else length}", "connection: close"]
    head += [f"{k}: {v}" for k, v in (extra or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class RawServer:
    """Thread-per-connection loopback server. Chat requests pop a scripted action:
    `bytes` (sent as is, then the socket is closed) or "rst" (close with SO_LINGER 0: a TCP RST).
    GET /health and /v1/models answer like a ready vLLM serving `model`."""

    def __init__(self, model: str, default: bytes | str) -> None:
        self.model, self.default = model, default
        self.actions: deque = deque()
        self.chats = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.1)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._serve, daemon=True)
        self._accept.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def script(self, *actions: bytes | str) -> None:
        self.actions.extend(actions)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                head, complete, body = read_http_head(conn).partition(b"\r\n\r\n")
                if not complete:
                    return  # closed before the head ended
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                length = next((int(h.split(":", 1)[1]) for h in lines[1:]
                               if h.lower().startswith("content-length:")), 0)
                while len(body) < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    body += chunk
                if method == "GET":
                    payload = {} if path == "/health" else {"object": "list", "data": [{"id": self.model}]}
                    conn.sendall(http_bytes(200, json.dumps(payload).encode()))
                    return
                self.chats += 1
                action = self.actions.popleft() if self.actions else self.default
                if action == "rst":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                conn.sendall(action)
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self._accept.join(5)
        self._sock.close()
        for thread in self._threads:
            thread.join(5)


# -- reading /metrics ---------------------------------------------------------------------------------
def metrics(http: httpx.Client | None, base_url: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, frozenset(labels.items())): value} from the proxy's /metrics."""
    if http is None:
        with httpx.Client(timeout=10, trust_env=False) as own:
            text = own.get(f"{base_url}/metrics").text
    else:
        text = http.get(f"{base_url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def metric_sum(values: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in values.items() if n == name and want <= ls)


def wait_circuits_closed(base_url: str, timeout_s: float = HANG_S) -> None:
    """Until /metrics shows no endpoint out of rotation (the readiness probe saw it come back)."""
    deadline = time.monotonic() + timeout_s
    while metric_sum(metrics(None, base_url), "vlm_proxy_circuit_open") != 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"a circuit stayed open for {timeout_s}s")
        time.sleep(0.05)


def kill_quietly(*owners) -> None:
    for owner in owners:
        with contextlib.suppress(Exception):
            owner.close()
