"""Shared plumbing for the HTTP benchmarks: subprocesses (fake vLLM, the proxy, LiteLLM), a
keep-alive load generator, percentiles and the result table.

Every server runs as its own process, so the proxy, the fake and the load generator (the bench
process itself) never share a GIL. Everything binds and talks to 127.0.0.1 only. Every wait and
loop here is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from proxy.media.encode import FrameLimits
from tests.helpers import QWEN_REPLY, free_ports
from vlm_protocol.frames import IMAGE_MIN_PIXELS, VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS, VIDEO_TOTAL_PIXELS

ROOT = Path(__file__).resolve().parents[1]
# A /score request's frame settings as the shipped Qwen backend resolves them (16 frames, the
# default pixel budget and qwen-vl-utils' video rule), for the benches that call proxy.media.encode.
LIMITS = FrameLimits(nframes=16, max_pixels=200_704, min_pixels=VIDEO_MIN_PIXELS, video_max_pixels=VIDEO_MAX_PIXELS,
                     total_pixels=VIDEO_TOTAL_PIXELS, image_min_pixels=IMAGE_MIN_PIXELS, stills=False,
                     jpeg_quality=90, default_source_fps=4.0, max_inline_frames=4096,
                     max_source_pixels=4096 * 4096)
PY = sys.executable
HOST = "127.0.0.1"


def free_port() -> int:
    return free_ports(1)[0]


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""


def _spawn(name: str, argv: list[str], log_dir: Path, env: dict[str, str | None] | None = None,
           cwd: Path = ROOT, prefix: list[str] | None = None) -> tuple[subprocess.Popen, Path]:
    """`prefix` goes before argv, e.g. pin_prefix(cpus): a wrapper that execs argv (same pid)."""
    argv = [*(prefix or []), *argv]
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the process
    full_env = {**os.environ, **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None = unset
    proc = subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                            env=full_env, start_new_session=True)
    return proc, log_path


def wait_ready(server: Server, path: str, timeout_s: float = 60.0, expect: int = 200) -> None:
    """Poll `path` until it answers `expect`; bounded by time (and so by count)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            r = httpx.get(server.url + path, timeout=2.0, trust_env=False)
            if r.status_code == expect:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as err:
            last = type(err).__name__
        time.sleep(0.2)
    raise RuntimeError(f"{server.name} not ready on {path} after {timeout_s}s ({last}):\n{server.log_tail()}")


def start_fake(log_dir: Path, name: str, model: str, *, latency_base_s: float = 0.0,
               latency_per_seq_s: float = 0.0, max_num_seqs: int = 256, default_text: str = QWEN_REPLY,
               prefix: list[str] | None = None) -> Server:
    port = free_port()
    proc, log = _spawn(name, [PY, "-m", "tests.fakes.fake_vllm", "--host", HOST, "--port", str(port),
                              "--served-model-name", model, "--no-record", "--default-text", default_text,
                              "--latency-base-s", str(latency_base_s),
                              "--latency-per-seq-s", str(latency_per_seq_s),
                              "--max-num-seqs", str(max_num_seqs)], log_dir, prefix=prefix)
    server = Server(name, proc, port, log)
    wait_ready(server, "/health", 30)
    return server


def start_raw_relay(log_dir: Path, upstream_port: int) -> Server:
    """bench/_raw_relay.py in front of the fake: the floor of a store-and-forward relay."""
    port = free_port()
    proc, log = _spawn("raw-relay", [PY, str(ROOT / "bench" / "_raw_relay.py"), "--port", str(port),
                                     "--upstream", f"{HOST}:{upstream_port}"], log_dir)
    server = Server("raw-relay", proc, port, log)
    wait_ready(server, "/health", 30)
    return server


def proxy_config(model: str, endpoints: list[str], *, max_in_flight: int = 64, max_queue: int = 512,
                 media_root: str = "/tmp", retry: dict | None = None, circuit: dict | None = None,
                 health_interval_s: float = 5.0, max_model_len: int | None = 32768) -> dict:
    backend = {
        "model": model, "endpoints": endpoints, "layout": "qwen_video", "prompt": "qwen_progress",
        "sampling": {"temperature": 0.0, "top_p": 1.0, "max_tokens": 64, "seed": 0},
        "frames": {"nframes": 16, "max_pixels": 200704}, "score_mode": "percentage",
        "admission": {"max_in_flight_per_endpoint": max_in_flight, "max_queue": max_queue},
        "max_model_len": max_model_len,
    }
    if retry:
        backend["retry"] = retry
    if circuit:
        backend["circuit"] = circuit
    return {"proxy": {"host": HOST, "port": 0, "allowed_media_roots": [media_root], "max_body_mb": 256,
                      "prompts_dir": str(ROOT / "prompts"), "health_interval_s": health_interval_s},
            "backends": {"bench": backend}}


def start_proxy(log_dir: Path, config: dict, name: str = "proxy", root: Path | None = None,
                prefix: list[str] | None = None) -> Server:
    """`python -m vlm_reward_cli serve` from `root` (default this checkout; another one, e.g. a scratch
    copy with a change, runs with that copy's .venv/bin/python if it has one). `prefix`: see _spawn."""
    root = Path(root) if root else ROOT
    python = str(root / ".venv/bin/python") if root != ROOT and (root / ".venv/bin/python").exists() else PY
    port = free_port()
    cfg_path = log_dir / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
    proc, log = _spawn(name, [python, "-m", "vlm_reward_cli", "serve", "--config", str(cfg_path),
                              "--port", str(port), "--log-level", "warning"], log_dir, cwd=root, prefix=prefix)
    server = Server(name, proc, port, log, {"config": config})
    wait_ready(server, "/health", 60)
    return server


def start_litellm(log_dir: Path, litellm_bin: str, model: str, api_base: str) -> Server:
    """LiteLLM's proxy: one worker, `openai/<model>` at the fake, retries off, no DB.
    `extra["headers"]` holds the bearer header its (random, per-run) master key needs."""
    port = free_port()
    master_key = "sk-bench-" + secrets.token_hex(16)
    cfg = {
        "model_list": [{"model_name": model, "litellm_params": {
            "model": f"openai/{model}", "api_base": api_base, "api_key": "bench-not-checked",
            "num_retries": 0, "timeout": 120}}],
        "litellm_settings": {"num_retries": 0, "request_timeout": 120, "telemetry": False,
                             "turn_off_message_logging": True, "set_verbose": False},
        "router_settings": {"num_retries": 0},
        # A master key is required to start; without a DB it is one string comparison.
        "general_settings": {"master_key": master_key},
    }
    cfg_path = log_dir / "litellm.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "DATABASE_URL": None,
           "LITELLM_TELEMETRY": "False", "NO_PROXY": "*", "no_proxy": "*",
           "HTTP_PROXY": None, "HTTPS_PROXY": None, "http_proxy": None, "https_proxy": None}
    proc, log = _spawn("litellm", [litellm_bin, "--config", str(cfg_path), "--host", HOST,
                                   "--port", str(port), "--num_workers", "1"], log_dir, env)
    server = Server("litellm", proc, port, log,
                    {"config": cfg, "headers": {"authorization": f"Bearer {master_key}"}})
    wait_ready(server, "/health/liveliness", 120)
    return server


def pin_prefix(cpus: list[int] | None) -> list[str]:
    """`taskset -c LIST` (or the same in Python where taskset is missing): the command it runs, and
    every thread that command starts, stay on those CPUs; the command is exec'd, so its pid is the
    server's. [] when cpus is None."""
    if not cpus:
        return []
    if shutil.which("taskset"):
        return ["taskset", "-c", ",".join(map(str, cpus))]
    return [PY, "-c", f"import os, sys; os.sched_setaffinity(0, {sorted(cpus)}); os.execvp(sys.argv[1], sys.argv[1:])"]


def stop(server: Server | None, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
    """Stop one process we started (its own session, so its children go too)."""
    if server is None or server.proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, sig)
    try:
        server.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(5)


# -- load generation ---------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


async def closed_loop(url: str, body: bytes, *, concurrency: int, requests: int, warmup: int,
                      time_cap_s: float = 120.0, headers: dict | None = None) -> dict:
    """`concurrency` workers on one keep-alive client send `requests` POSTs (after `warmup`).
    Returns latency percentiles (ms), req/s and the non-200 count. Bounded by count and time."""
    hdrs = {"content-type": "application/json", **(headers or {})}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60.0, trust_env=False) as client:
        async def run(n: int, lat: list[float], errors: list[str], deadline: float) -> None:
            counter = iter(range(n))

            async def worker() -> None:
                for _ in counter:
                    if time.monotonic() > deadline:
                        return
                    t0 = time.perf_counter()
                    try:
                        r = await client.post(url, content=body, headers=hdrs)
                        ok = r.status_code == 200
                        if not ok:
                            errors.append(f"{r.status_code} {r.text[:160]}")
                    except httpx.HTTPError as err:
                        errors.append(type(err).__name__)
                        continue
                    if ok:
                        lat.append((time.perf_counter() - t0) * 1e3)

            await asyncio.gather(*(worker() for _ in range(concurrency)))

        warm_lat: list[float] = []
        warm_err: list[str] = []
        await run(warmup, warm_lat, warm_err, time.monotonic() + time_cap_s)
        lat: list[float] = []
        errors: list[str] = []
        t0 = time.perf_counter()
        await run(requests, lat, errors, time.monotonic() + time_cap_s)
        wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": requests, "ok": len(lat), "errors": len(errors),
            "first_errors": errors[:3] + warm_err[:2], "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99),
            "mean_ms": statistics.fmean(lat) if lat else float("nan"), "req_per_s": len(lat) / wall,
            "wall_s": wall}


def env_info() -> dict:
    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "loadavg_at_start": os.getloadavg()}


def write_json(path: str | Path, payload: dict) -> Path:
    out = Path(path)
    if not out.is_absolute():
        out = ROOT / out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, default=str))
    return out


def tree_cpu_seconds() -> float:
    """CPU time of this process (all its threads) and of its live children (a process pool's workers)."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += sum(child.cpu_times()[:2])
    return total
