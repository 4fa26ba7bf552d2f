"""Capacity of one proxy: episodes/s and CPU per episode against backends that answer at once, by
input kind, at a given number of cores, with the GIL time per episode; then how many GPUs one
proxy core can feed.

Not a test. The fake vLLMs (tests/fakes/fake_vllm.py, instant replies; one or more per backend)
and the proxy run as their own processes on 127.0.0.1; the proxy is pinned with `taskset -c` to
`--cores` CPUs (every thread it starts inherits that), with `proxy.media_workers` = cores. The
fakes, the load generator (persistent processes sending pre-built bodies over keep-alive httpx,
closed loop) and py-spy get the other CPUs when there are any; when the proxy has every CPU
(e.g. `--cores 2` on a 2-core machine) they all share, and the output says so.

Two backends, shaped as configs/libero.yaml ships them: qwen (`qwen_video`, prompt
`qwen_progress`) and primo (`primo_interleave`: first frame, the 16-frame video, last frame,
prompt `primo_r1_trained`); and, not run by default, pdone (a P(done) backend, prompt `topreward`,
on Qwen's replicas) and cascade (a cascade of pdone, then qwen, whose first stage is sure on every
episode: its row against pdone's, in the same run, is the cascade's own proxy CPU, printed at the
end as a ratio). Input kinds, each one body built before the timed loop and re-sent
(a 16-step pick of a 512-step 256x256 LIBERO-like episode; KINDS maps a kind to its builder):
  npy               the RLinf client's binary transport: multipart, the 16 frames as a raw .npy part
  jpeg_final        16 JPEGs at the size the proxy sends (336x336), base64 in JSON `frames`
  jpeg_final_parts  the same JPEGs as raw multipart parts (`frames: ["part:f0", ...]`)
  jpeg_other        16 JPEGs at 256x256, base64 in JSON: the proxy decodes, resizes, encodes
  mp4_path          a 16-frame MP4 (the client's path transport) under the media root, by video_path
  client_default    whatever the client's default RewardModelConfig builds (not in the default list)
PRIMO's stills are made from the frames it gets: from 336x336 JPEGs they are 336x336 (forwarded,
1446 vision tokens) instead of 252x252 (1320); the upstream capture printed at the end says so.

Per (cores, backend, kind), after a warm-up, one timed window (until `--requests` answers or
`--seconds`, whichever first) gives:
  ep/s      answers per second (every answer must be 200 with a numeric score, else the cell FAILS)
  cpu ms    the proxy process's CPU (psutil, all threads) over the window / episodes
  util      that CPU / (wall x cores): near 1 = the proxy's cores are the bottleneck
  oth%      the proxy's CPUs busy with other work (this bench's own when shared, anyone's on a
            shared machine): what the proxy could not have
  gil ms    py-spy `record --gil --nonblocking` over the same window: samples / rate / episodes
            (only the thread holding the GIL is sampled); gil% = GIL-held share of the wall time,
            near 100% = the process is GIL-bound whatever its cores. A thread that holds the GIL
            while waiting for a CPU counts as holding it: `*` marks gil ms > cpu ms (busy CPUs, or
            1 core shared by the loop and the media threads)
  loop, thr cores used by the proxy's event-loop thread and by its other threads (the media pool):
            with 2+ cores and neither near 1 per thread, the threads wait on each other (the GIL)
  gen, fake CPU ms per episode of the load generator and the fakes (and gen util), to show
  they are not the bottleneck
Then the written model: episodes/s per proxy core (1000 / cpu ms at the fewest cores), the GIL
ceiling of one process (1000 / the least gil ms), GPUs fed per core = ep/s per core / one GPU's
ep/s (Qwen: 15/s per H100, measured; PRIMO-R1 derived from its token counts, read from the bodies
the proxy sent, see `model_gpu_rates`), and what `--gpus` GPUs need.

    .venv/bin/pip install py-spy     # for the GIL column (or py-spy on PATH, or --py-spy PATH)
    .venv/bin/python bench/bench_capacity.py [--cores 1,2] [--kinds npy,jpeg_final] [--backends qwen,primo]
        [--requests 400] [--seconds 10] [--concurrency 0 (8 x cores)] [--no-gil] [--out FILE]
    # a 16-core box, time-bound windows (~4 min): --cores 1,2,4,8 --requests 100000 --seconds 4

Prints a row per cell as it goes, the GIL's top holders at the most cores, what the proxy sent
upstream, and the model; writes bench/results/bench_capacity-<time>.json (after each core count
too, so a cut-short run keeps what it measured). Exits 1 if any answer was not 200 with a score.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import concurrent.futures
import contextlib
import io
import json
import math
import multiprocessing
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import httpx
import numpy as np
import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._common import (  # noqa: E402
    HOST,
    Server,
    env_info,
    pct,
    pin_prefix,
    start_fake,
    start_proxy,
    stop,
    write_json,
)
from rlinf_client import Episode, RewardClient, RewardModelConfig  # noqa: E402
from rlinf_client._base_client import build_request_body  # noqa: E402
from tests.helpers import PRIMO_MODEL, PRIMO_REPLY, QWEN_MODEL, QWEN_REPLY  # noqa: E402
from vlm_protocol.frames import sample_indices, video_frame_size, vision_tokens  # noqa: E402
from vlm_protocol.multipart import PART_PREFIX, decode_form, encode_form, is_form  # noqa: E402

# -- backends: configs/libero.yaml's two, pointed at fakes ------------------------------------------
SHIPPED = REPO / "configs" / "libero.yaml"


@dataclass(frozen=True)
class BackendSpec:
    key: str  # the name on the command line
    name: str  # the proxy backend (the request's `backend`)
    model: str
    reply: str  # what its fake answers (the template's answer format)
    layout: str
    prompt: str
    gpu_note: str
    fakes: str = ""  # the backend whose fakes (replicas) it shares; "" = fakes of its own


BACKENDS = {
    "qwen": BackendSpec("qwen", "qwen2_5_vl_vllm", QWEN_MODEL, QWEN_REPLY, "qwen_video", "qwen_progress",
                        "Qwen2.5-VL-7B-Instruct"),
    "primo": BackendSpec("primo", "PRIMO-R1", PRIMO_MODEL, PRIMO_REPLY, "primo_interleave", "primo_r1_trained",
                         "PRIMO-R1-7B"),
    # P(done) (prompt topreward: one token's logprobs) on Qwen's replicas, and a cascade of it before
    # Qwen. The fakes answer P(True) = CASCADE_P_TRUE, outside the band, and the audit is off: every
    # episode stops at the first stage, so the cascade's row against pdone's is the cascade's own
    # overhead (its stage bookkeeping, the stage keys on the monitor), never a second call.
    "pdone": BackendSpec("pdone", "qwen_p_done", QWEN_MODEL, QWEN_REPLY, "qwen_video", "topreward",
                         "P(done) on Qwen2.5-VL-7B", fakes="qwen"),
    "cascade": BackendSpec("cascade", "qwen_cascade", QWEN_MODEL, QWEN_REPLY, "qwen_video", "",
                           "a cascade: P(done), then Qwen2.5-VL-7B on doubt", fakes="qwen"),
}
CASCADE_P_TRUE, CASCADE_BAND = 0.95, (0.3, 0.7)
TASK = "put both the alphabet soup and the tomato sauce in the basket"
# What RLinf's hook sends (rlinf_client/hook.py _metadata), so the live quality monitor does its work.
METADATA = {"env_success": False, "env": 0, "run": "capacity", "success_threshold": 0.5,
            "task_id": "libero_10_task_0"}


def capacity_config(endpoints: dict[str, list[str]], media_root: Path, media_workers: int) -> dict:
    """configs/libero.yaml with the fakes' endpoints, this media root and `media_workers`; replicas
    picked least-outstanding (the body never changes, so affinity would pin one fake)."""
    shipped = yaml.safe_load(SHIPPED.read_text())
    proxy = {**shipped["proxy"], "allowed_media_roots": [str(media_root)], "prompts_dir": str(REPO / "prompts"),
             "audit_log": None, "media_workers": media_workers, "host": HOST}
    backends = {}
    for spec in (s for s in BACKENDS.values() if not s.fakes):
        backend = dict(shipped["backends"][spec.name])
        backend.update(model=spec.model, endpoints=endpoints[spec.key], layout=spec.layout, prompt=spec.prompt,
                       routing={"policy": "least_outstanding"})
        backends[spec.name] = backend
    qwen, pdone, cascade = BACKENDS["qwen"], BACKENDS["pdone"], BACKENDS["cascade"]
    # the same replicas, so the same pool settings (one pool: proxy/config/settings.py)
    backends[pdone.name] = {**backends[qwen.name], "aliases": [], "prompt": pdone.prompt, "score_mode": "auto"}
    cascades = {cascade.name: {"stages": [{"backend": pdone.name, "band": list(CASCADE_BAND), "audit_fraction": 0.0},
                                          {"backend": qwen.name}]}}
    return {"proxy": proxy, "backends": backends, "cascades": cascades}


# -- input kinds ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Body:
    content_type: str
    data: bytes
    note: str = ""


@dataclass
class Inputs:
    """What every body builder shares: the episode, its 16 picked frames, the media root, and the
    running proxy (bodies are built once it is up, before their first timed window)."""

    episode: np.ndarray  # T x 256 x 256 x 3 RGB uint8
    media_root: Path
    nframes: int = 16
    jpeg_quality: int = 90
    proxy_url: str | None = None
    bodies: dict[tuple[str, str], Body] = field(default_factory=dict)  # (backend, kind) -> the body sent

    @property
    def picked(self) -> np.ndarray:
        return self.episode[sample_indices(len(self.episode), self.nframes)]

    def body(self, backend: BackendSpec, kind: str) -> Body:
        if (backend.key, kind) not in self.bodies:
            self.bodies[(backend.key, kind)] = KINDS[kind](self, backend)
        return self.bodies[(backend.key, kind)]

    def client_body(self, backend: BackendSpec, **overrides) -> tuple[Body, dict]:
        """The RLinf client's own body for this episode (its default config plus `overrides`)."""
        cfg = RewardModelConfig.from_mapping({"endpoint": "http://127.0.0.1:1/score", "backend": backend.name,
                                              "nframes": self.nframes, "temp_video_dir": str(self.media_root),
                                              **overrides})
        body = build_request_body(Episode(self.episode, TASK, metadata=dict(METADATA)), cfg)
        content_type, data = body.encoded()
        return Body(content_type, data), body.payload  # a path body's MP4 stays until the root goes


def _jpegs(frames: np.ndarray, size: tuple[int, int], quality: int) -> list[bytes]:
    out = []
    for frame in frames:
        if frame.shape[:2] != size:
            shrinking = size[0] * size[1] < frame.shape[0] * frame.shape[1]
            interpolation = cv2.INTER_AREA if shrinking else cv2.INTER_CUBIC  # the proxy's rule
            frame = cv2.resize(frame, (size[1], size[0]), interpolation=interpolation)
        ok, jpeg = cv2.imencode(".jpg", cv2.cvtColor(frame, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
        assert ok
        out.append(jpeg.tobytes())
    return out


def _frames_payload(inputs: Inputs, backend: BackendSpec) -> dict:
    """The client's payload (task, nframes, rates, backend, metadata) without its frames."""
    _, payload = inputs.client_body(backend, transport="binary")
    return {k: v for k, v in payload.items() if k != "frames_npy"}


def _json_jpegs(inputs: Inputs, backend: BackendSpec, size: tuple[int, int], note: str) -> Body:
    payload = _frames_payload(inputs, backend)
    payload["frames"] = [base64.b64encode(j).decode() for j in _jpegs(inputs.picked, size, inputs.jpeg_quality)]
    return Body("application/json", json.dumps(payload, separators=(",", ":")).encode(), note)


def final_size(inputs: Inputs) -> tuple[int, int]:
    h, w = inputs.episode.shape[1:3]
    return video_frame_size(h, w, inputs.nframes, max_pixels=200_704)


def kind_npy(inputs: Inputs, backend: BackendSpec) -> Body:
    body, _ = inputs.client_body(backend, transport="binary", client_sampling=True)
    return Body(body.content_type, body.data, "client transport: binary (raw .npy part)")


def kind_jpeg_final(inputs: Inputs, backend: BackendSpec) -> Body:
    size = final_size(inputs)
    return _json_jpegs(inputs, backend, size, f"{size[0]}x{size[1]} JPEGs, base64 in JSON")


def kind_jpeg_final_parts(inputs: Inputs, backend: BackendSpec) -> Body:
    size = final_size(inputs)
    payload = _frames_payload(inputs, backend)
    jpegs = _jpegs(inputs.picked, size, inputs.jpeg_quality)
    payload["frames"] = [f"{PART_PREFIX}f{i}" for i in range(len(jpegs))]
    content_type, data = encode_form(json.dumps(payload, separators=(",", ":")).encode(),
                                     {f"f{i}": ("image/jpeg", j) for i, j in enumerate(jpegs)})
    return Body(content_type, data, f"{size[0]}x{size[1]} JPEGs as raw multipart parts")


def kind_jpeg_other(inputs: Inputs, backend: BackendSpec) -> Body:
    size = tuple(inputs.episode.shape[1:3])
    return _json_jpegs(inputs, backend, size, f"{size[0]}x{size[1]} JPEGs (resized by the proxy), base64 in JSON")


def kind_mp4_path(inputs: Inputs, backend: BackendSpec) -> Body:
    body, payload = inputs.client_body(backend, transport="path", client_sampling=True)
    kib = Path(payload["video_path"]).stat().st_size // 1024
    return Body(body.content_type, body.data, f"client transport: path ({kib} KiB mp4v)")


class _Recording(httpx.AsyncBaseTransport):
    """Passes the client's requests on to the proxy and keeps its /score bodies as sent."""

    def __init__(self) -> None:
        self.inner, self.sent = httpx.AsyncHTTPTransport(), []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path.rstrip("/").endswith("/score"):
            self.sent.append((request.headers.get("content-type", ""), await request.aread()))
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def client_sent(inputs: Inputs, backend: BackendSpec, note: str, **overrides) -> Body:
    """The body RewardClient itself sends for this episode to the running proxy (after whatever it
    asks the proxy first), with its default config plus `overrides`."""
    recorder = _Recording()
    cfg = RewardModelConfig.from_mapping({"endpoint": f"{inputs.proxy_url}/score", "backend": backend.name,
                                          "batch": "never", "fail_on_request_error": True, "keep_temp_video": True,
                                          "temp_video_dir": str(inputs.media_root), **overrides})
    with RewardClient(cfg, http_transport=recorder) as client:
        (result,) = client.score_episodes([Episode(inputs.episode, TASK, metadata=dict(METADATA))])
    if not result.ok or not recorder.sent:
        raise RuntimeError(f"RewardClient could not score the episode: {result}")
    content_type, data = recorder.sent[-1]
    request = decode_form(data, content_type, max_parts=4096)[0] if is_form(content_type) else data
    fields = sorted(k for k in json.loads(request) if k in ("frames", "frames_npy", "stills", "video_path"))
    return Body(content_type, data, f"{note}: {content_type.split(';')[0]}, {', '.join(fields)}")


def kind_client_default(inputs: Inputs, backend: BackendSpec) -> Body:
    return client_sent(inputs, backend, "as RewardClient sends it by default")


# kind -> builder(inputs, backend) -> Body, called once the proxy is up. A new kind is one function
# here (and, to run it by default, its name in DEFAULT_KINDS). `client_default` records what the
# client's default config sends (whatever that is now); client_sent(..., **overrides) gives others,
# client_body builds offline with build_request_body.
KINDS: dict[str, Callable[[Inputs, BackendSpec], Body]] = {
    "npy": kind_npy,
    "jpeg_final": kind_jpeg_final,
    "jpeg_final_parts": kind_jpeg_final_parts,
    "jpeg_other": kind_jpeg_other,
    "mp4_path": kind_mp4_path,
    "client_default": kind_client_default,
}
DEFAULT_KINDS = ["npy", "jpeg_final", "jpeg_final_parts", "jpeg_other", "mp4_path"]


# -- CPUs ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    proxy: list[int]
    others: list[int]  # fakes, load generator, py-spy
    shared: bool  # the proxy's CPUs are also the others'


def _cpu_list(text: str) -> set[int]:
    out: set[int] = set()
    for piece in text.strip().split(","):
        if piece:
            low, _, high = piece.partition("-")
            out.update(range(int(low), int(high or low) + 1))
    return out


def smt_siblings(cpus: list[int]) -> dict[int, set[int]]:
    """Each CPU's hyperthread siblings (itself included), from sysfs; {} where it says nothing."""
    out = {}
    for cpu in cpus:
        with contextlib.suppress(OSError, ValueError):
            out[cpu] = _cpu_list(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text())
    return out


def place(cores: int, available: list[int]) -> Placement:
    """The proxy on `cores` CPUs of distinct physical cores first (one hyperthread of each, then the
    second ones); the rest for the others, leaving out the proxy's hyperthread siblings while at
    least 3 CPUs remain without them."""
    if cores > len(available):
        raise SystemExit(f"--cores {cores}: only {len(available)} CPUs available ({available})")
    if cores == len(available):
        return Placement(available, available, True)
    siblings = smt_siblings(available)
    order = sorted(available, key=lambda c: (sorted(siblings.get(c, {c})).index(c), c))
    proxy = sorted(order[:cores])
    rest = [c for c in available if c not in proxy]
    apart = [c for c in rest if not any(c in siblings.get(p, ()) for p in proxy)]
    return Placement(proxy, apart if len(apart) >= 3 else rest, False)


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def auto_counts(placement: Placement) -> tuple[int, int]:
    """(fakes per backend, load processes): enough that neither is the bottleneck, from the spare CPUs."""
    spare = len(placement.others)
    n = 1 if placement.shared or spare < 4 else 2 if spare < 8 else 3
    return n, n


# -- load generator: persistent processes, one asyncio httpx client each -----------------------------
def _load_main(conn, cpus: list[int]) -> None:
    """A load process: per cell, a warm-up, then (on "go") the timed window; answers over `conn`."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, cpus)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        try:
            asyncio.run(_load_cell(conn, msg))
        except Exception as err:  # noqa: BLE001 - reported to the parent, which fails the cell
            conn.send({"error": f"{type(err).__name__}: {err}"})


async def _load_cell(conn, spec: dict) -> None:
    headers = {"content-type": spec["content_type"]}
    limits = httpx.Limits(max_connections=spec["concurrency"], max_keepalive_connections=spec["concurrency"])
    async with httpx.AsyncClient(limits=limits, timeout=120.0, trust_env=False) as client:
        async def run(n: int, seconds: float) -> dict:
            counter = iter(range(n))
            deadline = time.monotonic() + seconds
            lat: list[float] = []
            errors: list[str] = []

            async def worker() -> None:
                for _ in counter:
                    if time.monotonic() > deadline:
                        return
                    t0 = time.perf_counter()
                    try:
                        r = await client.post(spec["url"], content=spec["body"], headers=headers)
                    except httpx.HTTPError as err:
                        errors.append(f"{type(err).__name__}: {err}")
                        continue
                    if r.status_code != 200:
                        errors.append(f"{r.status_code} {r.text[:300]}")
                        continue
                    try:
                        answer = r.json()
                    except ValueError:
                        answer = None
                    score = answer.get("score") if isinstance(answer, dict) else None
                    if not isinstance(score, int | float) or isinstance(score, bool):
                        errors.append(f"200 without a score: {r.text[:300]}")
                        continue
                    lat.append((time.perf_counter() - t0) * 1e3)

            await asyncio.gather(*(worker() for _ in range(spec["concurrency"])))
            return {"ok": len(lat), "lat": lat, "errors": len(errors), "first_errors": errors[:3]}

        warm = await run(spec["warmup"], spec["warmup_seconds"])
        conn.send({"warm": warm["ok"], "errors": warm["errors"], "first_errors": warm["first_errors"]})
        if conn.recv() != "go":
            return
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.time()
        timed = await run(spec["requests"], spec["seconds"])
        t1 = time.time()
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        timed.update(t0=t0, t1=t1, cpu_s=(cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime))
        conn.send(timed)


class LoadPool:
    def __init__(self, procs: int, cpus: list[int]) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with OpenBLAS/OpenCV threads
        self.conns, self.procs = [], []
        for _ in range(procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_load_main, args=(child, cpus), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def _recv(self, conn, timeout_s: float) -> dict:
        if not conn.poll(timeout_s):
            raise RuntimeError(f"a load process did not answer in {timeout_s:.0f} s")
        msg = conn.recv()
        if "error" in msg:
            raise RuntimeError(f"load process: {msg['error']}")
        return msg

    def prepare(self, spec: dict) -> list[dict]:
        n = len(self.conns)
        for i, conn in enumerate(self.conns):
            conn.send({**spec, "concurrency": max(1, spec["concurrency"] // n + (i < spec["concurrency"] % n)),
                       "requests": spec["requests"] // n + (i < spec["requests"] % n),
                       "warmup": max(1, spec["warmup"] // n)})
        return [self._recv(conn, spec["warmup_seconds"] + 120) for conn in self.conns]

    def go(self, timeout_s: float) -> list[dict]:
        for conn in self.conns:
            conn.send("go")
        return [self._recv(conn, timeout_s) for conn in self.conns]

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send(None)
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


# -- py-spy ------------------------------------------------------------------------------------------
class GilSampler:
    """`py-spy record --gil --nonblocking --threads --format raw` on the proxy, stopped with SIGINT."""

    def __init__(self, py_spy: str, pid: int, rate: int, out: Path, cpus: list[int]) -> None:
        self.rate, self.out = rate, out
        argv = [*pin_prefix(cpus), py_spy, "record", "--gil", "--nonblocking", "--threads", "--rate", str(rate),
                "--pid", str(pid), "--format", "raw", "-o", str(out), "--duration", "600"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.started = time.monotonic()
        self.cpu = None

    def stop(self) -> dict:
        self.wall = time.monotonic() - self.started
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(self.proc.pid).cpu_times()
            self.cpu = t.user + t.system
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=10)
        err_text = err.decode(errors="replace")
        if not self.out.exists():
            return {"error": f"py-spy wrote nothing (rc {self.proc.returncode}): {err_text[-600:]}"}
        return {**parse_gil(self.out), "rate": self.rate, "spy_wall_s": self.wall, "spy_cpu_s": self.cpu,
                "spy_warnings": [ln for ln in err_text.splitlines() if "behind" in ln.lower()][:2]}


UVLOOP_C = "(event loop C code: uvloop I/O, callbacks)"  # the GIL held below asyncio's Runner.run
PROJECT = ("proxy/", "vlm_protocol/", "rlinf_client/")
ENTRY = ("proxy/cli.py", "proxy/http/serve.py")  # every loop sample's callers: no information


def _frame_path(frame: str) -> str:
    return frame.partition(" (")[2].rstrip(")").rpartition(":")[0]


def _frame_name(frame: str) -> str:
    name, path = frame.partition(" (")[0], _frame_path(frame)
    if name == "Runner.run" and path.endswith("asyncio/runners.py"):
        return UVLOOP_C
    return f"{name} ({'/'.join(Path(path).parts[-3:])})" if path else name


def parse_gil(raw: Path, top: int = 8) -> dict:
    """Samples by thread kind (loop = MainThread, media = the media pool, other) and the top frames:
    own ("self": the innermost Python frame, the C calls it makes included) and inclusive (this
    project's functions only, below the server's entry points)."""
    by_thread: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = [f for f in stack.split(";") if f]
        thread = frames[0].partition("): ")[2] if frames and frames[0].startswith("thread (") else ""
        frames = [f for f in frames if not f.startswith(("thread (", "process "))]
        total += n
        by_thread["loop" if thread == "MainThread" else "media" if thread.startswith("media") else "other"] += n
        if frames:
            own[_frame_name(frames[-1])] += n
            for f in {_frame_name(f) for f in frames if any(p in _frame_path(f) for p in PROJECT)
                      and not _frame_path(f).endswith(ENTRY)}:
                incl[f] += n
    share = lambda c: [(f, round(100 * v / total, 1)) for f, v in c.most_common(top)] if total else []  # noqa: E731
    return {"samples": total, "by_thread": dict(by_thread), "self": share(own), "inclusive": share(incl)}


def ptracer_prefix() -> list[str]:
    """Where Yama allows ptrace of descendants only (ptrace_scope 1), the proxy declares any process
    of its user its ptracer (prctl PR_SET_PTRACER_ANY, kept across the exec into the server) so
    py-spy, its sibling, may read it without CAP_SYS_PTRACE. [] elsewhere."""
    try:
        scope = Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
    except OSError:
        return []
    if scope != "1":
        return []
    return [sys.executable, "-c", "import ctypes, os, sys; ctypes.CDLL(None, use_errno=True).prctl(0x59616D61, "
            "ctypes.c_ulong(2**64 - 1), 0, 0, 0); os.execvp(sys.argv[1], sys.argv[1:])"]


def find_py_spy(given: str | None) -> str | None:
    for candidate in (given, shutil.which("py-spy"), str(Path(sys.executable).parent / "py-spy")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


# -- one run: servers at `cores`, every backend x kind ------------------------------------------------
@dataclass
class Stack:
    proxy: Server
    fakes: dict[str, list[Server]] = field(default_factory=dict)


def cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def thread_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds of a process's main thread (the proxy's event loop) and of all its other threads."""
    loop = rest = 0.0
    with contextlib.suppress(psutil.Error):
        for t in psutil.Process(pid).threads():
            if t.id == pid:
                loop += t.user_time + t.system_time
            else:
                rest += t.user_time + t.system_time
    return loop, rest


def busy_s(cpus: list[int]) -> float:
    """CPU seconds those CPUs spent on anything (every process), from /proc/stat."""
    per_cpu = psutil.cpu_times(percpu=True)
    return sum(sum(t) - t.idle - getattr(t, "iowait", 0.0) for i, t in enumerate(per_cpu) if i in cpus)


def capture_upstream(stack: Stack, spec: BackendSpec, url: str, body: Body) -> dict:
    """One request with the backend's fakes recording: what the proxy sent upstream, in tokens."""
    fakes = stack.fakes[spec.key]
    with httpx.Client(timeout=60, trust_env=False) as client:
        for fake in fakes:
            client.post(f"{fake.url}/_fake/reset")
            client.post(f"{fake.url}/_fake/config", json={"record": True})
        try:
            r = client.post(url, content=body.data, headers={"content-type": body.content_type})
            r.raise_for_status()
            sent = [req for fake in fakes for req in client.get(f"{fake.url}/_fake/requests").json()["requests"]]
        finally:
            for fake in fakes:
                client.post(f"{fake.url}/_fake/config", json={"record": False})
                client.post(f"{fake.url}/_fake/reset")
    return upstream_tokens(sent[0]) if sent else {}


def _jpeg_size(data: str) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(data))) as image:
        return image.height, image.width


def upstream_tokens(body: dict) -> dict:
    """Vision tokens (each image/video part's size, vlm_protocol.frames.vision_tokens) and text
    characters of one chat body; text tokens are estimated in model_gpu_rates."""
    vision, text_chars, parts, messages = 0, 0, [], 0
    for message in body.get("messages", []):
        messages += 1
        content = message.get("content")
        if isinstance(content, str):
            text_chars += len(content)
            continue
        for part in content or []:
            if part.get("type") == "text":
                text_chars += len(part.get("text", ""))
            elif part.get("type") in ("image_url", "video_url"):
                url = part[part["type"]]["url"]
                pieces = url.partition(";base64,")[2].split(",")
                h, w = _jpeg_size(pieces[0])
                video = part["type"] == "video_url"
                vision += vision_tokens(h, w, len(pieces), video=video)
                parts.append(f"{'video' if video else 'image'} {len(pieces)}x{h}x{w}")
    return {"vision_tokens": vision, "text_chars": text_chars, "messages": messages, "parts": parts,
            "max_tokens": body.get("max_tokens")}


def run_cell(stack: Stack, pool: LoadPool, spec: BackendSpec, kind: str, body: Body, args, placement: Placement,
             cores: int, spy_dir: Path, py_spy: str | None, capture: bool) -> dict:
    url = f"{stack.proxy.url}/score"
    row = {"cores": cores, "backend": spec.key, "kind": kind, "body_kib": len(body.data) / 1024, "note": body.note,
           "shared_cpus": placement.shared}
    if capture:
        row["upstream"] = capture_upstream(stack, spec, url, body)
    concurrency = args.concurrency or max(16, 8 * cores)
    warm = pool.prepare({"url": url, "content_type": body.content_type, "body": body.data,
                         "concurrency": concurrency, "requests": args.requests, "seconds": args.seconds,
                         "warmup": args.warmup or concurrency, "warmup_seconds": args.warmup_seconds})
    warm_errors = [e for w in warm for e in w["first_errors"]]
    fake_pids = [f.pid for f in stack.fakes[spec.key]]
    spy = None
    if py_spy and args.gil:
        spy = GilSampler(py_spy, stack.proxy.pid, args.gil_rate, spy_dir / f"gil-{cores}-{spec.key}-{kind}.txt",
                         placement.others)
        time.sleep(0.5)  # attach; the proxy is idle meanwhile (no GIL samples)
    proxy_cpu0, fake_cpu0, busy0 = cpu_s([stack.proxy.pid]), cpu_s(fake_pids), busy_s(placement.proxy)
    threads0 = thread_cpu_s(stack.proxy.pid)
    done = pool.go(args.seconds + 180)
    proxy_cpu1, fake_cpu1, busy1 = cpu_s([stack.proxy.pid]), cpu_s(fake_pids), busy_s(placement.proxy)
    threads1 = thread_cpu_s(stack.proxy.pid)
    gil = spy.stop() if spy else None
    if gil is not None and "error" in gil:
        print(f"py-spy failed, no GIL column from here on: {gil['error']}", flush=True)
        args.gil = False
    ok = sum(d["ok"] for d in done)
    errors = sum(d["errors"] for d in done) + sum(w["errors"] for w in warm)
    wall = max(d["t1"] for d in done) - min(d["t0"] for d in done)
    lat = [x for d in done for x in d["lat"]]
    gen_cpu = sum(d["cpu_s"] for d in done)
    row.update(concurrency=concurrency, episodes=ok, errors=errors,
               first_errors=[e for d in done for e in d["first_errors"]][:3] + warm_errors[:2],
               wall_s=wall, eps=ok / wall if wall > 0 else 0.0,
               cpu_ms=1e3 * (proxy_cpu1 - proxy_cpu0) / max(ok, 1),
               util=(proxy_cpu1 - proxy_cpu0) / (wall * cores) if wall > 0 else 0.0,
               # the proxy's CPUs busy with anything but the proxy (the other processes of this bench
               # when shared, anyone else's work on a shared machine): what the proxy did not get
               others_util=max(0.0, (busy1 - busy0) - (proxy_cpu1 - proxy_cpu0)) / (wall * cores) if wall > 0 else 0.0,
               gen_ms=1e3 * gen_cpu / max(ok, 1), gen_util=gen_cpu / (wall * len(pool.procs)) if wall > 0 else 0.0,
               fake_ms=1e3 * (fake_cpu1 - fake_cpu0) / max(ok, 1), p50_ms=pct(lat, 50), p99_ms=pct(lat, 99),
               # cores the event-loop thread used, and the other threads (the media pool): whether
               # the loop or the pool is the one that is busy (docs/benchmarks.md §8, stop 36)
               loop_cores=(threads1[0] - threads0[0]) / wall if wall > 0 else 0.0,
               threads_cores=(threads1[1] - threads0[1]) / wall if wall > 0 else 0.0)
    if gil is not None:
        row["gil"] = gil
        if "samples" in gil:
            gil_s = gil["samples"] / gil["rate"]
            row.update(gil_ms=1e3 * gil_s / max(ok, 1), gil_busy=gil_s / wall if wall > 0 else 0.0)
    return row


def run_cores(cores: int, args, inputs: Inputs, available: list[int], py_spy: str | None, work: Path,
              captured: set) -> tuple[list[dict], dict]:
    placement = place(cores, available)
    fakes_n, procs_n = auto_counts(placement)
    fakes_n, procs_n = args.fakes or fakes_n, args.load_procs or procs_n
    others = pin_prefix(placement.others)
    info = {"cores": cores, "proxy_cpus": placement.proxy, "other_cpus": placement.others, "shared": placement.shared,
            "fakes_per_backend": fakes_n, "load_procs": procs_n, "media_workers": cores,
            "loadavg_at_start": os.getloadavg(),
            "others_on_proxy_smt_siblings": sorted(c for c in placement.others if not placement.shared and any(
                c in smt_siblings([p]).get(p, ()) for p in placement.proxy))}
    log_dir = work / f"cores{cores}"
    log_dir.mkdir()
    stack, pool, rows = None, None, []
    fakes: dict[str, list[Server]] = {}
    own_affinity, setup_started = os.sched_getaffinity(0), time.monotonic()
    os.sched_setaffinity(0, placement.others)  # this process (it only waits) and the load processes
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as starter:  # each start waits for its /health
            for spec in (s for s in BACKENDS.values() if not s.fakes):
                fakes[spec.key] = list(starter.map(
                    lambda i, spec=spec: start_fake(log_dir, f"fake-{spec.key}-{i}", spec.model,
                                                    default_text=spec.reply, prefix=others), range(fakes_n)))
        with httpx.Client(timeout=30, trust_env=False) as client:  # P(done)'s answer: sure, outside the band
            for fake in fakes["qwen"]:
                client.post(f"{fake.url}/_fake/config", json={"label_logprobs": {
                    "True": math.log(CASCADE_P_TRUE), "False": math.log(1 - CASCADE_P_TRUE)}}).raise_for_status()
        for spec in (s for s in BACKENDS.values() if s.fakes):
            fakes[spec.key] = fakes[spec.fakes]
        config = capacity_config({k: [f"{f.url}/v1" for f in v] for k, v in fakes.items()}, inputs.media_root, cores)
        info["config"] = config
        proxy = start_proxy(log_dir, config, prefix=(ptracer_prefix() if py_spy else []) + pin_prefix(placement.proxy),
                            root=Path(args.root) if args.root else None)
        stack = Stack(proxy, fakes)
        inputs.proxy_url = proxy.url
        info["proxy_affinity"] = sorted(psutil.Process(proxy.pid).cpu_affinity())
        info["proxy_children"] = len(psutil.Process(proxy.pid).children(recursive=True))
        pool = LoadPool(procs_n, placement.others)
        info["setup_s"] = round(time.monotonic() - setup_started, 1)
        print(f"-- cores {cores}: proxy on CPUs {placement.proxy} (media_workers {cores}); "
              f"{fakes_n} fake(s) per backend, {procs_n} load process(es)"
              f"{', py-spy' if py_spy and args.gil else ''} on CPUs {placement.others}; "
              f"started in {info['setup_s']} s"
              + ("  [SHARED: the load generator and fakes compete with the proxy]" if placement.shared else "")
              + (f"  [CPUs {info['others_on_proxy_smt_siblings']} are hyperthreads of the proxy's cores]"
                 if info["others_on_proxy_smt_siblings"] else ""),
              flush=True)
        for key in args.backends:
            spec = BACKENDS[key]
            for kind in args.kinds:
                try:
                    body = inputs.body(spec, kind)
                except Exception as err:  # noqa: BLE001 - a builder that fails is this cell's failure, not the run's
                    row = {"cores": cores, "backend": key, "kind": kind, "errors": 1, "episodes": 0,
                           "first_errors": [f"building the body: {type(err).__name__}: {err}"]}
                    rows.append(row)
                    print(f"{cores:>5} {key:7} {kind:17} FAILED: {row['first_errors'][0]}", flush=True)
                    continue
                row = run_cell(stack, pool, spec, kind, body, args, placement, cores, work, py_spy,
                               capture=(key, kind) not in captured)
                captured.add((key, kind))
                rows.append(row)
                print_row(row, flush=True)
    finally:
        os.sched_setaffinity(0, own_affinity)
        if pool:
            pool.close()
        if stack:
            stop(stack.proxy)
        for key, servers in fakes.items():
            for server in servers if not BACKENDS[key].fakes else ():  # a shared fake stops once
                stop(server)
    return rows, info


# -- printing and the model --------------------------------------------------------------------------
HEAD = (f"{'cores':>5} {'backend':7} {'kind':17} {'KiB':>6} {'ep/s':>7} {'cpu ms':>7} {'util':>5} {'oth%':>5} "
        f"{'gil ms':>7} {'gil%':>5} {'loop':>5} {'thr':>5} {'gen ms':>6} {'gen%':>5} {'fake ms':>7} {'p50 ms':>7} "
        f"{'n':>5} {'err':>4}")


def _f(value, spec: str, width: int) -> str:
    return f"{value:{width}{spec}}" if isinstance(value, int | float) and not math.isnan(value) else f"{'-':>{width}}"


def print_row(r: dict, flush: bool = False) -> None:
    print(f"{r['cores']:>5} {r['backend']:7} {r['kind']:17} {r['body_kib']:>6.0f} {_f(r['eps'], '.1f', 7)} "
          f"{_f(r['cpu_ms'], '.2f', 7)} {_f(r['util'], '.2f', 5)} {_f(100 * r['others_util'], '.0f', 5)} "
          f"{_f(r.get('gil_ms'), '.2f', 6)}{'*' if r.get('gil_ms', 0) > 1.05 * r['cpu_ms'] else ' '}"
          f"{_f(100 * r['gil_busy'] if 'gil_busy' in r else None, '.0f', 5)} {_f(r.get('loop_cores'), '.2f', 5)} "
          f"{_f(r.get('threads_cores'), '.2f', 5)} {_f(r['gen_ms'], '.2f', 6)} "
          f"{_f(100 * r['gen_util'], '.0f', 5)} {_f(r['fake_ms'], '.2f', 7)} {_f(r['p50_ms'], '.0f', 7)} "
          f"{r['episodes']:>5} {r['errors']:>4}" + ("  FAILED: " + "; ".join(r["first_errors"]) if r["errors"] else ""),
          flush=flush)


def estimate_text_tokens(up: dict) -> int:
    """Text tokens of a chat body from its characters: ~4 characters per token (English under
    Qwen2's BPE), plus ~5 template tokens per message, plus Qwen's default system message (~20
    tokens) when the body has no system message of its own (qwen_progress has one)."""
    return round(up["text_chars"] / 4) + 5 * (up["messages"] + 1)


def model_gpu_rates(captures: dict, args) -> dict:
    """One H100's episodes/s per backend. Qwen: args.qwen_gpu_eps, the issue's measurement (15/s
    with args.qwen_prompt_tokens = 1154 vision + ~200 text tokens each and a few output tokens:
    prefill-bound), which gives the prefill rate P (ViT included) in prompt tokens/s. PRIMO-R1's
    episode then costs its prompt / P plus its reasoning output / D: args.primo_output_tokens at
    args.decode_tok_s, the aggregate decode tokens/s of one H100 running a 7B model at a burst's
    batch (both assumed). Its prompt: the vision tokens of what the proxy sent (first still, the
    video, last still) and its text estimated from characters. Additive, so on the low side: vLLM
    overlaps decode steps with chunked prefill."""
    qwen_up = captures.get(("qwen", "npy")) or {"vision_tokens": 1154, "text_chars": 490, "messages": 2}
    primo_up = captures.get(("primo", "npy")) or {"vision_tokens": 1320, "text_chars": 3186, "messages": 2}
    prefill = args.qwen_gpu_eps * args.qwen_prompt_tokens
    primo_prompt = primo_up["vision_tokens"] + estimate_text_tokens(primo_up)

    def primo_eps(output_tokens: int) -> float:
        return 1 / (primo_prompt / prefill + output_tokens / args.decode_tok_s)

    return {
        "qwen": {"gpu_eps": args.qwen_gpu_eps, "prompt_tokens": args.qwen_prompt_tokens,
                 "vision_tokens": qwen_up["vision_tokens"], "text_tokens_est": estimate_text_tokens(qwen_up),
                 "source": "measured on one H100 (the issue); text estimated here from the body sent"},
        "primo": {"gpu_eps": primo_eps(args.primo_output_tokens), "prompt_tokens": primo_prompt,
                  "vision_tokens": primo_up["vision_tokens"], "text_tokens_est": estimate_text_tokens(primo_up),
                  "output_tokens": args.primo_output_tokens,
                  "sensitivity": {n: primo_eps(n) for n in (200, 400, 800, 1600)},
                  "source": f"prompt / {prefill:.0f} prefill tok/s (Qwen's: 15 ep/s x {args.qwen_prompt_tokens}) "
                            f"+ {args.primo_output_tokens} output tokens / {args.decode_tok_s:.0f} decode tok/s"},
        "prefill_tok_s": prefill, "decode_tok_s": args.decode_tok_s,
        # P(done) and the cascade whose first stage is sure: Qwen's prefill, one output token
        **{key: {"gpu_eps": args.qwen_gpu_eps, "prompt_tokens": args.qwen_prompt_tokens,
                 "vision_tokens": qwen_up["vision_tokens"], "text_tokens_est": estimate_text_tokens(qwen_up),
                 "source": "as Qwen's: the same prefill, one output token"} for key in ("pdone", "cascade")},
    }


def the_model(rows: list[dict], gpu: dict) -> list[dict]:
    """Per backend x kind: proxy capacity per core and the GPUs it feeds, from the 1-core row (the
    CPU cost) and the row at the most cores (what one proxy reaches, GIL included)."""
    out = []
    keys = sorted({(r["backend"], r["kind"]) for r in rows if not r["errors"]}, key=lambda k: (k[0], k[1]))
    for backend, kind in keys:
        mine = sorted((r for r in rows if (r["backend"], r["kind"]) == (backend, kind) and not r["errors"]),
                      key=lambda r: r["cores"])
        low, high = mine[0], mine[-1]
        per_core = 1e3 / low["cpu_ms"] if low["cpu_ms"] > 0 else float("inf")
        # A thread holding the GIL while it waits for a CPU counts too, which only adds: the least
        # over the core counts is the GIL work itself (usually the most cores).
        gils = [r["gil_ms"] for r in mine if r.get("gil_ms")]
        gil_ms = min(gils) if gils else None
        gil_ceiling = 1e3 / gil_ms if gil_ms else None
        g = gpu[backend]["gpu_eps"]
        out.append({"backend": backend, "kind": kind, "cpu_ms_per_ep": low["cpu_ms"], "at_cores": low["cores"],
                    "eps_per_core": per_core, "gpus_per_core": per_core / g,
                    "gil_ms_per_ep": gil_ms, "gil_ceiling_eps": gil_ceiling,
                    "gil_ceiling_gpus": gil_ceiling / g if gil_ceiling else None,
                    "max_cores": high["cores"], "eps_at_max_cores": high["eps"], "gpus_at_max_cores": high["eps"] / g,
                    "scaling": high["eps"] / low["eps"] if low["eps"] else None,
                    "scaling_ceiling": shared_ceiling(low, high)})
    return out


def shared_ceiling(low: dict, high: dict) -> float | None:
    """When the load generator and the fakes run on the proxy's CPUs (a 2-core machine at 2 cores),
    the scaling a proxy would reach that kept its CPU per episode of the fewest cores and got every
    CPU cycle the bench's own processes leave: the cores over (proxy + generator + fake) ms per
    episode, against the fewest cores' episodes/s. None when they had CPUs of their own."""
    if not high["shared_cpus"] or not low["eps"]:
        return None
    per_episode_ms = low["cpu_ms"] + high["gen_ms"] + high["fake_ms"]
    return high["cores"] * 1e3 / per_episode_ms / low["eps"]


def cascade_overhead(rows: list[dict]) -> list[dict]:
    """Per (cores, kind) with a cascade row: its proxy CPU per episode over P(done)'s alone (the
    cascade's first stage, the same call) and over Qwen's, measured in the same run."""
    out = []
    by = {(r["cores"], r["backend"], r["kind"]): r for r in rows if not r["errors"]}
    for (cores, backend, kind), row in sorted(by.items()):
        if backend != "cascade":
            continue
        entry = {"cores": cores, "kind": kind, "cascade_cpu_ms": row["cpu_ms"]}
        for base in ("pdone", "qwen"):
            other = by.get((cores, base, kind))
            if other and other["cpu_ms"] > 0:
                entry[f"{base}_cpu_ms"], entry[f"over_{base}"] = other["cpu_ms"], row["cpu_ms"] / other["cpu_ms"]
        out.append(entry)
    return out


def print_cascade_overhead(overhead: list[dict]) -> None:
    if not overhead:
        return
    print("\nThe cascade's overhead (its first stage sure on every episode: no second call), proxy CPU ms per episode:")
    for o in overhead:
        print(f"  {o['cores']} core(s) {o['kind']:17} cascade {o['cascade_cpu_ms']:.2f}"
              + "".join(f"; {b} alone {o[f'{b}_cpu_ms']:.2f} (x{o[f'over_{b}']:.2f})" for b in ("pdone", "qwen")
                        if f"over_{b}" in o))


def sizing(model: list[dict], gpus: int) -> list[str]:
    """For `gpus` GPUs of one backend: the cores (CPU cost) and the proxy processes (GIL cap) needed."""
    lines = []
    for m in model:
        cores = gpus / m["gpus_per_core"]
        procs = math.ceil(gpus / m["gil_ceiling_gpus"]) if m["gil_ceiling_gpus"] else None
        lines.append(f"  {m['backend']:6} {m['kind']:17} {gpus} GPUs need {cores:5.2f} proxy cores"
                     + (f", and at least {procs} proxy process(es) by the GIL cap" if procs else ""))
    return lines


def print_model(model: list[dict], gpu: dict, gpus: int) -> None:
    print("\nThe model: GPUs one proxy feeds")
    for key, g in ((k, gpu[k]) for k in ("qwen", "primo", "pdone", "cascade")):
        print(f"  {BACKENDS[key].gpu_note}: {g['gpu_eps']:.1f} episodes/s per H100 ({g['prompt_tokens']} prompt "
              f"tokens: {g['vision_tokens']} vision + ~{g['text_tokens_est']} text"
              + (f", ~{g['output_tokens']} output" if "output_tokens" in g else "") + f"; {g['source']})")
    sens = gpu["primo"]["sensitivity"]
    print("  PRIMO-R1 ep/s per H100 by output length: " + ", ".join(f"{n} tok {v:.1f}" for n, v in sens.items()))
    print(f"{'backend':7} {'kind':17} {'cpu ms':>7} {'ep/s/core':>9} {'GPUs/core':>9} {'gil ms':>7} "
          f"{'GIL cap ep/s':>12} {'GIL cap GPUs':>12} {'max cores':>9} {'ep/s there':>10} {'GPUs there':>10} "
          f"{'scale':>6} {'ceil':>5}")
    for m in model:
        print(f"{m['backend']:7} {m['kind']:17} {m['cpu_ms_per_ep']:>7.2f} {m['eps_per_core']:>9.1f} "
              f"{m['gpus_per_core']:>9.2f} {_f(m['gil_ms_per_ep'], '.2f', 7)} {_f(m['gil_ceiling_eps'], '.0f', 12)} "
              f"{_f(m['gil_ceiling_gpus'], '.1f', 12)} {m['max_cores']:>9} {m['eps_at_max_cores']:>10.1f} "
              f"{m['gpus_at_max_cores']:>10.2f} {_f(m['scaling'], '.2f', 6)} {_f(m['scaling_ceiling'], '.2f', 5)}")
    print("  ep/s/core = 1000 / (CPU ms per episode at the fewest cores); GPUs/core = that / one GPU's ep/s;\n"
          "  GIL cap = 1000 / (the least GIL ms per episode over the core counts): one proxy process cannot pass\n"
          "  it however many cores it has;\n"
          "  'there' = measured at the most cores run (scale = its ep/s over the fewest cores' ep/s);\n"
          "  ceil = where the bench's own processes shared the proxy's CPUs, the most 'scale' could be: a proxy\n"
          "  whose CPU per episode stayed as at the fewest cores, given every cycle they leave.")
    print("\n".join(sizing(model, gpus)))


def print_gil_tops(rows: list[dict], kinds: list[str], cores: int) -> None:
    for r in rows:
        if r["cores"] != cores or r["kind"] not in kinds or "gil" not in r or "self" not in r["gil"]:
            continue
        g = r["gil"]
        threads = ", ".join(f"{k} {100 * v / max(g['samples'], 1):.0f}%" for k, v in sorted(g["by_thread"].items()))
        print(f"\nGIL holders, {r['backend']} {r['kind']} at {cores} core(s): {r.get('gil_ms', 0):.2f} ms/episode "
              f"({g['samples']} samples at {g['rate']} Hz; {threads})")
        print("  self:      " + "; ".join(f"{share:.0f}% {name}" for name, share in g["self"][:6]))
        print("  inclusive: " + "; ".join(f"{share:.0f}% {name}" for name, share in g["inclusive"][:6]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", default="1,2", help="comma list: CPUs the proxy is pinned to, one run each")
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help=f"comma list of {', '.join(KINDS)}")
    parser.add_argument("--backends", default="qwen,primo",
                        help="comma list of qwen, primo, pdone (P(done) on Qwen's replicas), cascade (P(done) then "
                             "Qwen, the first stage sure: its overhead against pdone's, printed at the end)")
    parser.add_argument("--requests", type=int, default=400, help="answers per timed window at most")
    parser.add_argument("--seconds", type=float, default=10.0, help="timed window at most (s)")
    parser.add_argument("--concurrency", type=int, default=0, help="requests in flight (0: 8 x cores, at least 16)")
    parser.add_argument("--warmup", type=int, default=0, help="warm-up requests per cell (0: the concurrency)")
    parser.add_argument("--warmup-seconds", type=float, default=3.0)
    parser.add_argument("--gil", action=argparse.BooleanOptionalAction, default=True,
                        help="py-spy --gil over each timed window")
    parser.add_argument("--gil-rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--py-spy", default=None, help="py-spy binary (default: on PATH or beside python)")
    parser.add_argument("--fakes", type=int, default=0, help="fake vLLMs per backend (0: from the spare CPUs)")
    parser.add_argument("--load-procs", type=int, default=0, help="load processes (0: from the spare CPUs)")
    parser.add_argument("--steps", type=int, default=512, help="episode length (LIBERO-10: 512)")
    parser.add_argument("--root", default=None, help="run the proxy from this checkout (a scratch copy)")
    parser.add_argument("--qwen-gpu-eps", type=float, default=15.0, help="Qwen2.5-VL-7B episodes/s per H100")
    parser.add_argument("--qwen-prompt-tokens", type=int, default=1354,
                        help="the prompt those episodes had (1154 vision + ~200 text)")
    parser.add_argument("--primo-output-tokens", type=int, default=400,
                        help="PRIMO-R1's <think> reasoning + answer tokens per episode (assumed)")
    parser.add_argument("--decode-tok-s", type=float, default=4000.0,
                        help="one H100's aggregate decode tokens/s for a 7B model at burst batch sizes (assumed)")
    parser.add_argument("--gpus", type=int, default=8, help="the sizing line: GPUs of one backend to feed")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/bench_capacity-<time>.json)")
    args = parser.parse_args()
    args.cores_list = [int(c) for c in args.cores.split(",") if c]
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.backends = [b for b in args.backends.split(",") if b]
    for k in args.kinds:
        if k not in KINDS:
            parser.error(f"unknown kind {k!r}: {', '.join(KINDS)}")
    for b in args.backends:
        if b not in BACKENDS:
            parser.error(f"unknown backend {b!r}: {', '.join(BACKENDS)}")
    available = sorted(os.sched_getaffinity(0))
    py_spy = find_py_spy(args.py_spy) if args.gil else None
    if args.gil and not py_spy:
        print("py-spy not found (pip install py-spy, or --py-spy PATH): no GIL column", flush=True)

    from bench.bench_client import synthetic_episode  # here: the load processes re-import this module

    started = time.time()
    rows, runs, captured, captures = [], [], set(), {}
    with tempfile.TemporaryDirectory(prefix="bench-capacity-") as tmp:
        work = Path(tmp)
        media = work / "media"
        media.mkdir(mode=0o700)
        inputs = Inputs(synthetic_episode(args.steps), media)
        print(f"{cpu_model()}, {len(available)} CPUs {available}, python {sys.version.split()[0]}; "
              f"episode {args.steps}x{inputs.episode.shape[1]}x{inputs.episode.shape[2]}, 16 sent; "
              f"window <= {args.requests} answers or {args.seconds:g} s; GIL {'py-spy ' + py_spy if py_spy else 'off'}")
        print(HEAD, flush=True)
        failed = False
        out_path = args.out or f"bench/results/bench_capacity-{time.strftime('%Y%m%d-%H%M%S')}.json"
        head = {"bench": "capacity", "args": dict(vars(args)), "cpu_model": cpu_model(), "available_cpus": available,
                "machine": env_info(), "smt_siblings": {c: sorted(s) for c, s in smt_siblings(available).items()}}
        for cores in args.cores_list:
            if cores > len(available):
                print(f"-- cores {cores}: skipped, only {len(available)} CPUs", flush=True)
                continue
            run_rows, info = run_cores(cores, args, inputs, available, py_spy, work, captured)
            rows += run_rows
            runs.append(info)
            failed |= any(r["errors"] for r in run_rows)
            write_json(out_path, {**head, "partial": True, "runs": runs, "rows": rows})  # kept if cut short
        if rows:
            print_gil_tops(rows, ["npy", "jpeg_final", "jpeg_final_parts", "client_default"],
                           max(r["cores"] for r in rows))
        for r in rows:
            if "upstream" in r:
                captures[(r["backend"], r["kind"])] = r["upstream"]
        print("\nThe bodies:")
        for (b, k), body in inputs.bodies.items():
            print(f"  {b:6} {k:17} {len(body.data) / 1024:7.0f} KiB  {body.note}")
        print("\nWhat the proxy sent upstream (one captured request per backend x kind):")
        for (b, k), up in sorted(captures.items()):
            print(f"  {b:6} {k:17} {up.get('vision_tokens')} vision tokens ({', '.join(up.get('parts', []))}), "
                  f"{up.get('text_chars')} text chars in {up.get('messages')} messages")
        gpu = model_gpu_rates(captures, args)
        model = the_model(rows, gpu)
        print_model(model, gpu, args.gpus)
        overhead = cascade_overhead(rows)
        print_cascade_overhead(overhead)
        out = write_json(out_path, {
            **head, "duration_s": time.time() - started, "runs": runs, "rows": rows,
            "upstream": {f"{b}/{k}": v for (b, k), v in captures.items()}, "gpu": gpu, "model": model,
            "sizing": sizing(model, args.gpus), "cascade_overhead": overhead,
            "failed": failed})
    print(f"wrote {out}  ({time.time() - started:.0f} s)")
    if failed:
        print("FAILED: some answers were not 200 with a score (see the rows marked FAILED)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
