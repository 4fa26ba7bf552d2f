"""Fixtures for the launcher tests: the stand-in `vllm` first on PATH, free loopback ports,
configs with launch sections written to disk, and a reaper that kills every process group a test
started, whatever happened in the test."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from tests.helpers import HANG_S, PRIMO_MODEL, PROMPTS_DIR, QWEN_MODEL, REPO, free_ports, wait_until  # noqa: F401 - the tier's tests import these from here

FAKE_BIN = REPO / "tests" / "fakes" / "bin"
LAUNCHERS = REPO / "launchers"
QWEN_PATH = "/models/Qwen2.5-VL-7B-Instruct"
PRIMO_PATH = "/models/PRIMO-R1-7B"


def alive(pid: int) -> bool:
    """Running, not a zombie (an exited child nobody reaped yet counts as gone)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def stack_config(*, proxy_port: int, qwen_replicas: list[dict], primo_replicas: list[dict],
                 qwen_endpoints: list[int] | None = None, primo_endpoints: list[int] | None = None,
                 qwen_launch: dict | None = None, primo_launch: dict | None = None,
                 media_root: str = "/tmp/vlm-reward-media") -> dict:  # the shipped root
    """configs/stack-4gpu.yaml's shape; replicas as [{"gpus": [...], "port": P}, ...]."""

    def endpoints(ports: list[int]) -> list[str]:
        return [f"http://127.0.0.1:{p}/v1" for p in ports]

    return {
        "proxy": {"host": "127.0.0.1", "port": proxy_port, "prompts_dir": str(PROMPTS_DIR),
                  "allowed_media_roots": [media_root], "health_timeout_s": 1.0},
        "backends": {
            "qwen2_5_vl_vllm": {
                "model": QWEN_MODEL, "layout": "qwen_video", "prompt": "qwen_progress",
                "endpoints": endpoints(qwen_endpoints or [r["port"] for r in qwen_replicas]),
                "launch": {"model_path": "${QWEN2_5_VL_MODEL_PATH}",
                           "tensor_parallel_size": len(qwen_replicas[0]["gpus"]),
                           "replicas": qwen_replicas, **(qwen_launch or {})},
            },
            "PRIMO-R1": {
                "aliases": ["primo_r1_vllm"], "model": PRIMO_MODEL, "layout": "primo_interleave",
                "prompt": "primo_r1",
                "endpoints": endpoints(primo_endpoints or [r["port"] for r in primo_replicas]),
                "launch": {"model_path": "${PRIMO_R1_MODEL_PATH}",
                           "tensor_parallel_size": len(primo_replicas[0]["gpus"]),
                           "replicas": primo_replicas, **(primo_launch or {})},
            },
        },
    }


def write_config(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


class FakeVllmEnv:
    """The environment under which `vllm` is the stand-in and each one records itself."""

    def __init__(self, tmp_path: Path) -> None:
        self.record_dir = tmp_path / "records"
        self.record_dir.mkdir()
        self.env = {
            **{k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"},
            "PATH": os.pathsep.join([str(FAKE_BIN), str(Path(sys.executable).parent),
                                     os.environ.get("PATH", "")]),
            "FAKE_VLLM_RECORD_DIR": str(self.record_dir),
            "FAKE_VLLM_LIFETIME_S": "120",
            "QWEN2_5_VL_MODEL_PATH": QWEN_PATH,
            "PRIMO_R1_MODEL_PATH": PRIMO_PATH,
            "PYTHONUNBUFFERED": "1",
        }

    def records(self) -> dict[int, dict]:
        return {int(p.stem): json.loads(p.read_text()) for p in self.record_dir.glob("*.json")}

    def record(self, port: int, timeout_s: float = HANG_S) -> dict:
        return wait_until(lambda: self.records().get(port), timeout_s, f"the server on :{port}")

    def all_pids(self) -> list[int]:
        pids = []
        for record in self.records().values():
            pids.append(record["pid"])
            if record.get("worker_pid"):
                pids.append(record["worker_pid"])
        return pids


class Reaper:
    """Starts test subprocesses in their own sessions and kills every group at teardown."""

    def __init__(self, fake: FakeVllmEnv) -> None:
        self.fake = fake
        self.popens: list[subprocess.Popen] = []
        self.files: list[Any] = []
        self.groups: set[int] = set()  # process groups started behind the test's back (--detach)

    def up(self, *args: str, out: Path, **env: str) -> subprocess.Popen:
        stdout = open(out, "wb")  # noqa: SIM115 - closed at teardown
        self.files.append(stdout)
        popen = subprocess.Popen([sys.executable, "-m", "vlm_reward_cli", "up", *args],
                                 stdout=stdout, stderr=subprocess.STDOUT,
                                 env={**self.fake.env, **env}, start_new_session=True, cwd=REPO)
        self.popens.append(popen)
        return popen

    def run(self, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "vlm_reward_cli", *args], capture_output=True,
                              text=True, env={**self.fake.env, **env}, timeout=timeout, cwd=REPO)

    def cleanup(self) -> None:
        groups = {p.pid for p in self.popens} | self.groups
        for record in self.fake.records().values():
            groups.add(record["pgid"])
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        for pid in self.fake.all_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        # A proxy `up` started in a session of its own outlives a killed `up` (a test that failed before
        # its `down`, seen once in CI): anything whose command line names this test's files goes too.
        test_dir = str(self.fake.record_dir.parent)
        for process in psutil.process_iter(["pid", "cmdline"]):
            if process.pid != os.getpid() and any(test_dir in part for part in process.info["cmdline"] or ()):
                with contextlib.suppress(psutil.Error):
                    process.kill()
        for popen in self.popens:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(10)
        for f in self.files:
            f.close()


@pytest.fixture
def fake_vllm_env(tmp_path: Path) -> FakeVllmEnv:
    return FakeVllmEnv(tmp_path)


@pytest.fixture
def reaper(fake_vllm_env: FakeVllmEnv) -> Iterator[Reaper]:
    reaper = Reaper(fake_vllm_env)
    try:
        yield reaper
    finally:
        reaper.cleanup()
