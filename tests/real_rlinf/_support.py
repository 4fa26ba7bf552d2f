"""Helpers of the real-RLinf tier: the venv paths, the tiny real `vllm serve`, the score mapping
and frame sampling written out independently of the product, and frame decoding. RLinf's reward
formulas over whole episodes are tests/rlinf_semantics.py."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import REPO, free_port

RUNNER = Path(__file__).resolve().with_name("libero_runner.py")
ENV_RLINF = "VLM_RLINF_PYTHON"
ENV_REF_PYTHON = "VLM_REFERENCE_PYTHON"
ENV_REF_VLLM = "VLM_REFERENCE_VLLM"
ENV_REQUIRE = "VLM_REQUIRE_REAL"

# What the tier measured, printed at the end of the pytest run (conftest.py).
SUMMARY: dict[str, Any] = {}

_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


def required() -> bool:
    return os.environ.get(ENV_REQUIRE, "") == "1"


def _executable(name: str, how: str) -> str | None:
    """The path in $name; None (skip) if unset, unless VLM_REQUIRE_REAL=1 (fail)."""
    path = os.environ.get(name, "").strip()
    if not path:
        msg = f"{name} is not set: {how}"
        if required():
            pytest.fail(f"{ENV_REQUIRE}=1 but {msg}", pytrace=False)
        return None
    if not (Path(path).is_file() and os.access(path, os.X_OK)):
        pytest.fail(f"{name}={path!r} is not an executable file ({how})", pytrace=False)
    return path


def rlinf_python() -> str:
    """The RLinf venv's python (scripts/rlinf_env.sh); skips when unset, fails under VLM_REQUIRE_REAL=1."""
    how = ('the real RLinf tier needs RLinf 0.3.0\'s venv: `make test-real-rlinf`, or '
           f'`export {ENV_RLINF}="$(scripts/rlinf_env.sh | tail -n 1)"`')
    path = _executable(ENV_RLINF, how)
    if path is None:
        pytest.skip(f"{ENV_RLINF} is not set: {how}")
    return path


def reference_vllm() -> tuple[str, str] | None:
    """(python, vllm) of the reference venv, or None when VLM_REFERENCE_VLLM is unset (the tier then
    runs without the real-vLLM episode; under VLM_REQUIRE_REAL=1 that is a failure)."""
    how = ('the real-vLLM episode needs the reference venv: `make test-real-rlinf` sets it, or '
           f'`export {ENV_REF_VLLM}="$(scripts/reference_env.sh | tail -n 1)"`')
    vllm = _executable(ENV_REF_VLLM, how)
    if vllm is None:
        return None
    python = os.environ.get(ENV_REF_PYTHON, "").strip() or str(Path(vllm).with_name("python"))
    return python, vllm


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for subprocesses: no proxies (loopback only), no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()  # VLLM_CPU_KVCACHE_SPACE would override --kv-cache-memory-bytes
           if k not in _PROXY_VARS and k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VLLM_CPU_KVCACHE_SPACE")}
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env.update(extra)
    return env


def http_json(url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


class TinyVLLM:
    """A real `vllm serve` (the reference venv's vllm-cpu) of the tiny random Qwen2.5-VL from
    scripts/make_tiny_qwen25vl.py, started in a background thread so it loads while the envs run
    (once `start_when()` is true, or after `start_after_s`). Flags as measured in the reference env
    (and as the launchers pass them)."""

    def __init__(self, python: str, vllm: str, workdir: Path, served_model_name: str,
                 start_when: Callable[[], bool] | None = None, start_after_s: float = 300.0) -> None:
        self.python, self.vllm, self.workdir = python, vllm, workdir
        self.start_when, self.start_after_s = start_when, start_after_s
        self.served_model_name = served_model_name
        self.port = free_port()
        self.log_path = workdir / "vllm.log"
        self.process: subprocess.Popen | None = None
        self.error: str | None = None
        self.timings: dict[str, float] = {}
        self._thread = threading.Thread(target=self._start, daemon=True)
        self._stopping = False

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> TinyVLLM:
        self._thread.start()
        return self

    def _start(self) -> None:
        try:
            waited = time.perf_counter()
            while (self.start_when is not None and not self._stopping and not self.start_when()
                   and time.perf_counter() - waited < self.start_after_s):
                time.sleep(0.5)
            self.timings["start_delay_s"] = time.perf_counter() - waited
            t0 = time.perf_counter()
            model = self.workdir / "tiny-qwen25vl"
            made = subprocess.run([self.python, str(REPO / "scripts" / "make_tiny_qwen25vl.py"), str(model)],
                                  capture_output=True, text=True, timeout=300, env=clean_env(), check=False)
            if made.returncode != 0:
                self.error = f"make_tiny_qwen25vl.py failed ({made.returncode}): {made.stderr[-3000:]}"
                return
            self.timings["make_model_s"] = time.perf_counter() - t0
            if self._stopping:
                return
            cmd = [self.vllm, "serve", str(model), "--served-model-name", self.served_model_name,
                   "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
                   "--max-model-len", "16384", "--max-num-batched-tokens", "16384",
                   "--limit-mm-per-prompt", json.dumps({"image": 2, "video": 1}),
                   "--media-io-kwargs", json.dumps({"video": {"num_frames": -1}}),
                   "--trust-request-mm-kwargs", "--seed", "0",
                   # 128 MiB of KV cache holds 131k tokens of the tiny model; whole GiB
                   # (VLLM_CPU_KVCACHE_SPACE) doubled the worker's memory (tests/real_vllm/stack.py)
                   "--kv-cache-memory-bytes", "128M"]
            self._t_serve = time.perf_counter()
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                                env=clean_env(), cwd=self.workdir)
            while not self._stopping and self.process.poll() is None:
                with contextlib.suppress(Exception):
                    status, _ = http_json(f"http://127.0.0.1:{self.port}/health", timeout=2)
                    if status == 200:
                        self.timings["serve_ready_s"] = time.perf_counter() - self._t_serve
                        return
                time.sleep(1.0)
            if self.process.poll() is not None:
                self.error = f"vllm serve exited with {self.process.returncode}: {self.log_tail()}"
        except Exception as err:  # noqa: BLE001 (reported by the test that needs it)
            self.error = f"{type(err).__name__}: {err}"

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def stop(self) -> None:
        self._stopping = True
        self._thread.join(320)
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # the API server stops its engine processes
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(30)
        # whatever the main process did, nothing of the group this fixture started outlives it
        # (vLLM's engine core is a child that a clean exit may leave behind)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)


# -- written out here, not imported from the product ----------------------------------------------
def mapped_score(score: float, *, binary_reward: bool, success_threshold: float = 0.5) -> float:
    """The seed's fork: binary_reward → 1 if score >= threshold else 0; otherwise the score."""
    return (1.0 if score >= success_threshold else 0.0) if binary_reward else float(score)


def rule_rewards(num_steps: int, end_step: int, mapped: float, *, reward_coef: float,
                 use_rel_reward: bool) -> list[float]:
    """RLinf's `_calc_step_reward` (v0.3) with the episode's mapped score in place of the success
    flag: value_t = reward_coef * mapped from the 1-based end step on, 0 before; the reward is the
    value, or with use_rel_reward its change since the previous step (`prev_step_reward`)."""
    rewards, prev = [], 0.0
    for t in range(1, num_steps + 1):
        value = reward_coef * mapped if t >= end_step else 0.0
        rewards.append(value - prev if use_rel_reward else value)
        if use_rel_reward:
            prev = value
    return rewards


def uniform_indices(count: int, nframes: int) -> list[int]:
    """The frames sampled from `count`: all if fewer; else evenly spread, first and last kept,
    rounded half up (the proxy's documented rule, written out)."""
    if nframes >= count:
        return list(range(count))
    return [int(math.floor(i * (count - 1) / (nframes - 1) + 0.5)) for i in range(nframes)]


def decode_jpegs(jpegs: list[bytes]) -> np.ndarray:
    import cv2

    frames = [cv2.cvtColor(cv2.imdecode(np.frombuffer(j, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
              for j in jpegs]
    return np.stack(frames)


def mad(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(np.abs(a.astype(np.int16) - b.astype(np.int16))))
