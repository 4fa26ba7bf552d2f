"""The real stack of this tier: config, `up --detach` / `down`, the extra shell-launcher server,
replica restarts, the audit log, and the check that nothing is left running.

Imported by the tests in the MAIN environment (no vllm or torch here): every real server runs
in the reference venv through its `vllm` executable (VLM_REFERENCE_VLLM).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from launchers.commands import CPU_ARGS
from launchers.processes import group_members
from proxy.prompting.templates import PromptStore, apply_seed_overrides
from tests.helpers import HANG_S, PROMPTS_DIR, REPO, wait_until

LAUNCHERS = REPO / "launchers"
SHIPPED_CONFIG = REPO / "configs" / "libero.yaml"

QWEN, PRIMO = "qwen2_5_vl_vllm", "PRIMO-R1"
QWEN_MODEL, PRIMO_MODEL = "Qwen2.5-VL-7B-Instruct", "PRIMO-R1-7B"
# Not shipped: the shipped Qwen backend with one ask (retry.parse_attempts 1), no launch section,
# on the same two replicas. Its audit line's output_text is the greedy (temperature 0) reply,
# where the shipped backend's is the re-ask's (temperature 0.3, seed + 1).
QWEN_ONE_ASK = "qwen_one_ask"
QWEN_DIGIT = "qwen_digit"  # qwen_one_ask on a 0-9 template: one token per value (logprob scores)
# qwen_one_ask on the shipped field methods' templates: TOPReward's P(done), RoboReward's 1-5
QWEN_P_DONE, QWEN_ROBOREWARD = "qwen_p_done", "qwen_roboreward"
CASCADE_ALWAYS, CASCADE_NEVER = "p_done_always_on", "p_done_never_on"  # cascades on the Qwen replicas
QWEN_GVL = "qwen_gvl"  # GVL's one-call progress: layout shuffled_images, an image per frame on the Qwen replicas
GVL_IMAGES = 9  # the reference frame and 8 shown frames: the Qwen replicas take this many images too
# qwen_one_ask with a second camera (frames.extra_view): its own video (the Qwen replicas take two), or
# side by side with the main view in each frame
QWEN_TWO_VIDEOS, QWEN_SIDE_BY_SIDE = "qwen_two_videos", "qwen_side_by_side"
# The tiny checkpoint served as a pooling model (`up` adds --runner pooling --convert embed).
EMBED, EMBED_MODEL = "embed", "Qwen2.5-VL-embed"
DIGIT_TEMPLATE = ("variables: {task_text: {}}\nuser: 'How far along is ${task_text}? Answer one digit from 0 to 9.'\n"
                  "answer: {scale: {min: 0, max: 9}, constrain: true}\n")
MAX_MODEL_LEN = 8192
PRIMO_MAX_TOKENS = 128  # the shipped 4096 does not fit a 8192-token context; random text anyway
# vLLM CPU: one OpenMP core list per server. Each Qwen replica gets its own core.
OMP_BIND = {"qwen_r0": "0", "qwen_r1": "1", "primo": "1", "launcher": "0", "embed": "0"}
# Every server of the tier: eager (no compile), room for a 100-frame prompt in one step (the
# CPU default of 2048 batched tokens crashed seeded long prompts: real-stack.md), float32.
# The KV cache is sized in bytes: the tiny model holds 1 KiB per token (2 layers, 1 KV head of 64,
# float32), so 128 MiB is 131k tokens, 16 prompts of the full 8192. VLLM_CPU_KVCACHE_SPACE counts
# whole GiB, and each server's worker then held 1.7 GB instead of 0.8 (measured): six servers of
# the real tiers at once put the suite at the machine's 24 GB (Ray's OOM killer fired in CI).
KV_CACHE_BYTES = "128M"
EXTRA_ARGS = list(CPU_ARGS)  # launchers/commands.py: the flags of `launch.device: cpu`
assert EXTRA_ARGS[EXTRA_ARGS.index("--kv-cache-memory-bytes") + 1] == KV_CACHE_BYTES

ENV_PYTHON, ENV_VLLM, ENV_REQUIRE = "VLM_REFERENCE_PYTHON", "VLM_REFERENCE_VLLM", "VLM_REQUIRE_REAL"
_ENV_DROPPED = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY",
                "http_proxy", "https_proxy", "all_proxy", "VLLM_API_KEY", "OPENAI_API_KEY",
                "OPENAI_BASE_URL", "CUDA_VISIBLE_DEVICES",
                # vLLM 0.32 lets this override --kv-cache-memory-bytes (EXTRA_ARGS): never inherited
                "VLLM_CPU_KVCACHE_SPACE")


def say(line: str) -> None:
    """Progress for `pytest -s`; flushed so it interleaves with the servers' own output."""
    print(f"[real_vllm] {line}", flush=True)


def reference_executables() -> tuple[str, str]:
    """(python, vllm) of the reference venv; skips when unset, fails under VLM_REQUIRE_REAL=1."""
    python = os.environ.get(ENV_PYTHON, "").strip()
    vllm = os.environ.get(ENV_VLLM, "").strip()
    if not python or not vllm:
        missing = " and ".join(n for n, v in ((ENV_PYTHON, python), (ENV_VLLM, vllm)) if not v)
        msg = (f"{missing} not set: the real-vLLM tier needs the reference venv; run `make "
               "test-real-vllm`, or export VLM_REFERENCE_VLLM=\"$(scripts/reference_env.sh | tail -n1)\" "
               "VLM_REFERENCE_PYTHON=\"$(dirname \"$VLM_REFERENCE_VLLM\")/python\"")
        if os.environ.get(ENV_REQUIRE, "") == "1":
            pytest.fail(f"{ENV_REQUIRE}=1 but {msg}", pytrace=False)
        pytest.skip(msg)
    for name, path in ((ENV_PYTHON, python), (ENV_VLLM, vllm)):
        if not (Path(path).is_file() and os.access(path, os.X_OK)):
            pytest.fail(f"{name}={path!r} is not an executable file; rerun scripts/reference_env.sh",
                        pytrace=False)
    return python, vllm


def project_cli() -> str:
    """The project venv's `vlm-reward-proxy` (beside the python running the tests)."""
    beside = Path(sys.executable).with_name("vlm-reward-proxy")
    found = str(beside) if beside.exists() else shutil.which("vlm-reward-proxy")
    if not found:
        pytest.fail("vlm-reward-proxy is not installed in the test environment (make install)",
                    pytrace=False)
    return found


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _ENV_DROPPED}
    env.update(extra or {})
    return env


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


# -- the stack config ----------------------------------------------------------------------------
def shipped_backends() -> dict[str, Any]:
    return yaml.safe_load(SHIPPED_CONFIG.read_text())["backends"]


def stack_config(*, model_dir: Path, ports: dict[str, int], media_root: Path, audit_log: Path,
                 prompts_dir: Path) -> dict:
    """configs/libero.yaml's two backends (sampling, frames, prompt, retry, score_mode as shipped),
    with launch sections on the tiny checkpoint, a 8192-token context and PRIMO's max_tokens to fit.
    `prompts_dir` gets the shipped templates and the 0-9 one of QWEN_DIGIT."""
    shutil.copytree(PROMPTS_DIR, prompts_dir, dirs_exist_ok=True)
    (prompts_dir / "scale_0_9.yaml").write_text(DIGIT_TEMPLATE)
    shipped = shipped_backends()
    qwen = dict(shipped[QWEN])
    primo = dict(shipped[PRIMO])
    assert qwen["layout"] == "qwen_video" and qwen["prompt"] == "qwen_seed", qwen
    assert primo["layout"] == "primo_interleave" and primo["prompt"] == "primo_r1_trained", primo

    def launch(replicas: list[dict]) -> dict:
        return {"model_path": str(model_dir), "replicas": replicas, "max_model_len": MAX_MODEL_LEN,
                "extra_args": list(EXTRA_ARGS)}

    qwen.update(
        endpoints=[f"http://127.0.0.1:{ports['qwen_r0']}/v1", f"http://127.0.0.1:{ports['qwen_r1']}/v1"],
        max_model_len=MAX_MODEL_LEN,
        launch={**launch([
            # vLLM on the CPU ignores CUDA_VISIBLE_DEVICES: the GPU indices only feed the plan.
            {"gpus": [0], "port": ports["qwen_r0"], "env": {"VLLM_CPU_OMP_THREADS_BIND": OMP_BIND["qwen_r0"]}},
            {"gpus": [1], "port": ports["qwen_r1"], "env": {"VLLM_CPU_OMP_THREADS_BIND": OMP_BIND["qwen_r1"]}},
        ]), "limit_mm_per_prompt": {"video": 2, "image": GVL_IMAGES}})  # QWEN_GVL's images, QWEN_TWO_VIDEOS' videos
    primo.update(
        endpoints=[f"http://127.0.0.1:{ports['primo']}/v1"],
        max_model_len=MAX_MODEL_LEN,
        sampling={**primo["sampling"], "max_tokens": PRIMO_MAX_TOKENS},
        launch=launch([{"gpus": [2], "port": ports["primo"],
                        "env": {"VLLM_CPU_OMP_THREADS_BIND": OMP_BIND["primo"]}}]))
    embed = {"model": EMBED_MODEL, "kind": "embedding", "endpoints": [f"http://127.0.0.1:{ports['embed']}/v1"],
             "frames": {"nframes": 8, "max_pixels": 50176}, "retry": qwen["retry"],
             "launch": launch([{"gpus": [3], "port": ports["embed"],
                                "env": {"VLLM_CPU_OMP_THREADS_BIND": OMP_BIND["embed"]}}])}
    one_ask = {k: v for k, v in qwen.items() if k != "launch"}
    one_ask["retry"] = {**qwen["retry"], "parse_attempts": 1}
    digit = {**one_ask, "prompt": "scale_0_9", "score_mode": "auto"}
    p_done = {**one_ask, "prompt": "topreward", "score_mode": "auto"}
    gvl = {**one_ask, "prompt": "gvl", "score_mode": "auto", "layout": "shuffled_images",
           "frames": {**one_ask["frames"], "nframes": GVL_IMAGES},
           "sampling": {**one_ask["sampling"], "max_tokens": 256}}  # 8 lines of ~20 tokens
    two_videos, side_by_side = ({**one_ask, "frames": {**one_ask["frames"], "extra_view": placement}}
                                for placement in ("second_video", "side_by_side"))
    roboreward = {**one_ask, "prompt": "roboreward", "score_mode": "auto",
                  "sampling": {**one_ask["sampling"], "max_tokens": 16}}  # RoboReward's own budget
    return {
        "proxy": {"host": "127.0.0.1", "port": ports["proxy"], "allowed_media_roots": [str(media_root)],
                  "prompts_dir": str(prompts_dir), "audit_log": str(audit_log),
                  "health_interval_s": 1.0},
        "backends": {QWEN: qwen, PRIMO: primo, QWEN_ONE_ASK: one_ask, QWEN_DIGIT: digit, QWEN_P_DONE: p_done,
                     QWEN_ROBOREWARD: roboreward, QWEN_GVL: gvl, QWEN_TWO_VIDEOS: two_videos,
                     QWEN_SIDE_BY_SIDE: side_by_side, EMBED: embed},
        # P(done), then the generating backend, on the same two replicas (one pool): always on
        # (a band that holds every score) and never on (a band no probability falls in exactly).
        "cascades": {CASCADE_ALWAYS: {"stages": [{"backend": QWEN_P_DONE, "band": [0.0, 1.0]},
                                                 {"backend": QWEN_ONE_ASK}]},
                     CASCADE_NEVER: {"stages": [{"backend": QWEN_P_DONE, "band": [2e-9, 2e-9], "audit_fraction": 0.0},
                                                {"backend": QWEN_ONE_ASK}]}},
    }


def text_only_messages(backend: str) -> list[dict]:
    """What the proxy sends for this backend's template, minus the image and video parts."""
    prompt = shipped_backends()[backend]["prompt"]
    system, user = PromptStore(PROMPTS_DIR).get(prompt).render({"task_text": TASK})
    system, user = apply_seed_overrides(system, user, TASK, {})
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": [{"type": "text", "text": user}]}]



# -- processes -----------------------------------------------------------------------------------
def stop_group(pgid: int, grace_s: float = 20.0) -> list[int]:
    """SIGTERM a process group we started, SIGKILL after `grace_s`; returns pids still alive."""
    if not group_members(pgid):
        return []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if group_members(pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
    return group_members(pgid)


def split_shell_line(line: str) -> tuple[dict[str, str], list[str]]:
    """`K=V ... argv` (launchers.commands.shell_line's format) back into (env, argv)."""
    words = shlex.split(line)
    env: dict[str, str] = {}
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


@dataclass
class Server:
    """A server this tier started itself (outside `up`): a Popen in its own session."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    port: int
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)

    @property
    def pgid(self) -> int:
        return self.popen.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> list[int]:
        left = stop_group(self.pgid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        return left

    def serving_after(self) -> float | None:
        """Seconds from start until vLLM logged "Starting vLLM server on ..." (1 s resolution),
        or None if it has not yet."""
        match = re.search(r" (\d\d-\d\d \d\d:\d\d:\d\d) \[[\w.]+:\d+\] Starting vLLM server on ",
                          self.log_path.read_text(errors="replace"))
        if not match:
            return None
        year = time.localtime(self.started_wall).tm_year
        logged = time.mktime(time.strptime(f"{year}-{match.group(1)}", "%Y-%m-%d %H:%M:%S"))
        return logged - self.started_wall

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def start_server(name: str, argv: list[str], env: dict[str, str], log_path: Path, port: int) -> Server:
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 env=child_env(env), start_new_session=True, cwd=REPO)
    return Server(name=name, popen=popen, log_path=log_path, port=port)


def wait_http_ready(server: Server, timeout_s: float, model: str | None = None) -> float:
    """Seconds until GET /health is 200 (and /v1/models lists `model`); fails with the log tail
    when the server exits or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=2.0) as http:
        while time.monotonic() < deadline:
            if server.popen.poll() is not None:
                raise AssertionError(f"{server.name} exited with {server.popen.returncode} while "
                                     f"loading; last lines of {server.log_path}:\n{server.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if http.get(server.url + "/health").status_code == 200:
                    if model is None:
                        return time.monotonic() - server.started
                    served = [m["id"] for m in http.get(server.url + "/v1/models").json()["data"]]
                    if model in served:
                        return time.monotonic() - server.started
            time.sleep(0.5)
    raise AssertionError(f"{server.name} not ready after {timeout_s:.0f}s; last lines of "
                         f"{server.log_path}:\n{server.log_tail()}")


def leftovers(pgids: Iterable[int], markers: Iterable[str], ports: Iterable[int]) -> list[str]:
    """What is still running of this tier: live members of its process groups, processes whose
    command line names one of `markers` (the tiny model dir, the config), listening ports."""
    found = []
    for pgid in pgids:
        members = group_members(pgid)
        if members:
            found.append(f"process group {pgid}: {members}")
    markers = [m for m in markers if m]
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        if proc.info["status"] in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            continue
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.info["pid"] != os.getpid() and any(m in cmdline for m in markers):
            found.append(f"pid {proc.info['pid']}: {cmdline[:200]}")
    found += [f"port {p} still accepts connections" for p in ports if port_open(p)]
    return found


# -- the audit log -------------------------------------------------------------------------------
@dataclass
class AuditLog:
    path: Path

    def records(self, predicate: Callable[[dict], bool] = lambda _r: True) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                if predicate(record):
                    out.append(record)
        return out

    def by_run(self, run: str) -> list[dict]:
        return self.records(lambda r: (r.get("metadata") or {}).get("run") == run)

    def wait_for(self, run: str, count: int) -> list[dict]:
        """Run `run`'s audit lines once `count` are there (the proxy, a subprocess, writes them on
        its writer thread after answering)."""
        def enough() -> list[dict] | None:
            found = self.by_run(run)
            return found if len(found) >= count else None

        return wait_until(enough, HANG_S, f"{count} audit lines of run {run!r} in {self.path}")

    def one(self, run: str) -> dict:
        # The proxy (a subprocess) writes audit lines on its writer thread: wait for the line.
        found = wait_until(lambda: self.by_run(run), HANG_S, f"run {run!r}'s audit line in {self.path}")
        assert len(found) == 1, f"audit log {self.path}: {len(found)} lines for run {run!r}"
        return found[0]


# -- the running stack ---------------------------------------------------------------------------
@dataclass
class RealStack:
    """Everything the tests need to know about the stack `up` started (plus the extra servers)."""

    config_path: Path
    run_dir: Path
    runs_dir: Path
    pid_file: Path
    model_dir: Path
    media_root: Path
    ports: dict[str, int]
    vllm: str
    python: str
    audit: AuditLog
    up_output: str
    start_to_ready_s: float
    launcher: Server | None = None
    restarted: list[Server] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['proxy']}"

    def server_url(self, key: str) -> str:
        return f"http://127.0.0.1:{self.ports[key]}"

    def pid_record(self) -> dict:
        return json.loads(self.pid_file.read_text())

    def process(self, name: str) -> dict:
        found = [p for p in self.pid_record()["processes"] if p["name"] == name]
        assert found, f"no process {name!r} in {self.pid_file}"
        return found[0]

    def command_line(self, name: str) -> str:
        """The exact command `up` ran for replica `name`, from the run dir's commands.sh."""
        lines = (self.run_dir / "commands.sh").read_text().splitlines()
        return lines[lines.index(f"# {name}") + 1]

    def restart_replica(self, name: str, port_key: str) -> Server:
        """Start replica `name` again with `up`'s own command line (commands.sh): `up` has no restart
        of its own, and a server that dies after loading stays down under it."""
        env, argv = split_shell_line(self.command_line(name))
        server = start_server(f"{name}-restarted", argv, env, self.run_dir / f"{name}.restarted.log",
                              self.ports[port_key])
        self.restarted.append(server)
        return server

    def up_log(self) -> str:
        path = self.run_dir / "up.log"
        return path.read_text(errors="replace") if path.exists() else ""


# -- request bodies ------------------------------------------------------------------------------
TASK = "put the black bowl on the plate"


def episode_source(source: str, count: int, height: int, width: int, media_root: Path,
                   *, variant: int = 0) -> dict[str, Any]:
    """The frames field of a /score request: `mp4` (video_path under the allowed root), `png`
    (frames, base64 PNG) or `npy` (frames_npy) holding `count` synthetic frames (tests/fakes).
    `variant` shifts the frames' content, so two episodes of one size differ."""
    from tests.fakes.episodes import episode_frames, images_b64, npy_b64, write_mp4

    frames = episode_frames(count, height, width)
    if variant:
        frames = ((frames.astype("int32") + 7 * variant) % 256).astype("uint8")
    if source == "mp4":
        path = media_root / f"episode-{count}x{height}x{width}-v{variant}.mp4"
        if not path.exists():
            write_mp4(path, frames)
        return {"video_path": str(path)}
    if source == "png":
        return {"frames": images_b64(frames, ".png")}
    if source == "npy":
        return {"frames_npy": npy_b64(frames)}
    raise ValueError(source)


def vision_tokens_of(layout: str, frames: dict) -> int:
    """Qwen2.5-VL's cost of what the proxy reports it sent (frames.count/size/still_size):
    video ceil(T/2)*(H/28)*(W/28)+2, each image (H/28)*(W/28)+2 (PRIMO: first and last frame; the
    image layouts: every frame)."""
    width, height = frames["size"]
    if layout in ("images", "shuffled_images"):  # an image per frame
        return frames["count"] * ((height // 28) * (width // 28) + 2)
    count = -(-frames["count"] // 2) * (height // 28) * (width // 28) + 2
    if layout == "primo_interleave":
        still_w, still_h = frames["still_size"]
        count += 2 * ((still_h // 28) * (still_w // 28) + 2)
    return count
