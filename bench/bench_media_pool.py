"""Episodes/s of the proxy's media work across cores: a thread pool against a process pool, by raw input kind.

For each raw input kind the proxy decodes itself — an MP4 by path (16 frames of 256×256), a
`frames_npy` array (16×256×256×3, the RLinf client's raw transport) and a list of 16 JPEG frames of
256×256 (decoded, resized to 336×336 and re-encoded) — runs `proxy.media.encode.prepare_frames`, the
per-episode work /score runs on the media executor (decode budget included), at saturation through

- threads: a ThreadPoolExecutor of W workers, OpenCV's own pool at one thread (as `MediaExecutor`);
- processes: a ProcessPoolExecutor of W spawned workers, the input passed as the proxy would have
  to pass it (the path for an MP4, the request's strings for npy and JPEG), the JPEG bytes back;

for W = 1, 2 and powers of two up to the cores this process may use (at most 8, the default
`proxy.media_workers` cap), the process (and so every pool thread and worker) pinned to W cores with
os.sched_setaffinity. Configurations run interleaved, `--reps` times, and the table shows medians
(scaling: the median of each rep's W-over-first-W ratio). `cores` is the CPU time the bench and its
workers got per second of the window: on a shared machine, read the scaling against it (W=2 can
only reach 2x when it got 2 cores); `free` is the scaling over only the reps whose two windows got
at least 90% of their cores. Compare the rows of one run with each other.

The GIL columns: one thread doing episodes back to back in a child process, sampled by py-spy
twice (`py-spy record`, then `py-spy record --gil`, which keeps only the samples where the thread
holds the GIL); their ratio is the share of an episode's CPU time spent holding the GIL, and times
the episode's CPU ms (the thread's CPU time) it is GIL ms per episode. Threads cannot go past
1 / share times one thread. Without py-spy (`.venv/bin/pip install py-spy`) those columns are empty.
(A pure-Python counter spinning beside the work was tried instead: it counts every GIL hand-off's
wake-up latency as held time, 2-6x over on a loaded VM.)

    .venv/bin/python bench/bench_media_pool.py [--reps 5] [--seconds 1.5] [--gil-seconds 3]
                                               [--workers 1,2] [--out PATH]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cv2  # noqa: E402

from bench._common import LIMITS, env_info, tree_cpu_seconds, write_json  # noqa: E402
from proxy.media.encode import prepare_frames  # noqa: E402
from tests.fakes.episodes import episode_frames, images_b64, npy_b64, write_mp4  # noqa: E402

KINDS = ("mp4", "npy", "jpeg")
MODES = ("threads", "processes")


def sources(tmp: Path) -> dict[str, dict]:
    """Each kind's `prepare_frames` keywords, as a /score request would give them."""
    frames = episode_frames(16, 256, 256)
    return {"mp4": {"video_path": str(write_mp4(tmp / "episode.mp4", frames, fps=20)), "media_roots": [tmp]},
            "npy": {"frames_npy": npy_b64(frames), "fps": 20.0},
            "jpeg": {"frames": images_b64(frames, ".jpg"), "fps": 20.0}}


def episode(source: dict) -> list[bytes]:
    """One episode's media work; what a process pool would send back (the JPEGs)."""
    return prepare_frames(LIMITS, **source).jpegs


def one_opencv_thread() -> None:
    cv2.setNumThreads(1)  # as MediaExecutor's workers: the pool is the parallelism


# -- pools at saturation ----------------------------------------------------------------------------
_process_barrier = None  # a spawned worker's copy of the pool's start barrier


def _init_process(barrier) -> None:
    global _process_barrier
    _process_barrier = barrier
    one_opencv_thread()


def _meet(barrier=None) -> tuple[int, int, int]:
    """(pid, thread id, cores it may run on), once every worker of the pool runs one of these."""
    (barrier or _process_barrier).wait(timeout=120)
    return os.getpid(), threading.get_ident(), len(os.sched_getaffinity(0))


def make_pool(mode: str, workers: int) -> cf.Executor:
    """A pool whose every worker exists and runs on the calling thread's cores (set before)."""
    if mode == "threads":
        barrier = threading.Barrier(workers)
        pool: cf.Executor = cf.ThreadPoolExecutor(workers, initializer=one_opencv_thread)
        futures = [pool.submit(_meet, barrier) for _ in range(workers)]
    else:
        context = multiprocessing.get_context("spawn")
        pool = cf.ProcessPoolExecutor(workers, mp_context=context, initializer=_init_process,
                                      initargs=(context.Barrier(workers),))
        futures = [pool.submit(_meet) for _ in range(workers)]
    seen = [future.result() for future in futures]  # a barrier: all `workers` of them ran at once
    if {cores for _, _, cores in seen} != {workers}:
        raise RuntimeError(f"{mode} workers may run on {seen} cores, expected {workers}")
    return pool




def saturate(pool: cf.Executor, source: dict, workers: int, seconds: float) -> tuple[float, float]:
    """(episodes/s, cores used) with 2 × workers always queued, over `seconds` (bounded; the tail is
    drained uncounted). Cores used: CPU seconds of the bench and its workers per second."""
    for future in [pool.submit(episode, source) for _ in range(2 * workers)]:
        future.result()  # warm: codecs, page cache, pickling paths
    inflight = {pool.submit(episode, source) for _ in range(2 * workers)}
    done_count, cpu0, start = 0, tree_cpu_seconds(), time.perf_counter()
    deadline = start + seconds
    while True:
        done, inflight = cf.wait(inflight, return_when=cf.FIRST_COMPLETED)
        for future in done:
            future.result()
        done_count += len(done)
        now = time.perf_counter()
        if now >= deadline:
            break
        inflight |= {pool.submit(episode, source) for _ in done}
    cores = (tree_cpu_seconds() - cpu0) / (now - start)
    cf.wait(inflight)
    return done_count / (now - start), cores


# -- GIL share of one episode -----------------------------------------------------------------------
def loop_episodes(kind: str, seconds: float) -> dict:
    """One thread doing episodes back to back (the child py-spy samples): episodes and CPU ms each."""
    one_opencv_thread()
    with tempfile.TemporaryDirectory() as tmp:
        source = sources(Path(tmp))[kind]
        episode(source)
        done, cpu0, start = 0, time.thread_time(), time.perf_counter()
        while time.perf_counter() - start < seconds:
            episode(source)
            done += 1
        return {"episodes": done, "cpu_ms": (time.thread_time() - cpu0) / done * 1e3}


def _pyspy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def _samples_in_episode(raw: Path) -> int:
    """Samples whose stack passes through `episode` (py-spy's raw format: stack, space, count)."""
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "episode (" in stack:
            total += int(count)
    return total


def gil_share(kind: str, seconds: float, pyspy: str) -> dict:
    """CPU ms of one episode, and the share of it spent holding the GIL: py-spy sampling one thread
    that does episodes back to back, once counting every sample (the thread is always busy) and once
    with --gil (only samples where it holds the GIL)."""
    counts, cpu = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for gil in (False, True):
            raw = Path(tmp) / f"{gil}.txt"
            argv = [pyspy, "record", "--rate", "250", "--format", "raw", "--output", str(raw),
                    *(["--gil"] if gil else []), "--", sys.executable, __file__, "--loop", kind,
                    "--gil-seconds", str(seconds)]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds * 4 + 60, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 or not lines or not raw.exists():
                raise RuntimeError(f"py-spy failed ({done.returncode}): {done.stderr[-400:]}")
            cpu.append(json.loads(lines[-1])["cpu_ms"])
            counts[gil] = _samples_in_episode(raw)
    share = counts[True] / max(counts[False], 1)
    cpu_ms = statistics.median(cpu)
    return {"cpu_ms": cpu_ms, "gil_ms": share * cpu_ms, "gil_share": share}


# -- the run ----------------------------------------------------------------------------------------
def worker_counts(requested: str | None) -> list[int]:
    cores = len(os.sched_getaffinity(0))
    if requested:
        return [int(w) for w in requested.split(",")]
    counts, w = [], 1
    while w <= min(cores, 8):
        counts.append(w)
        w *= 2
    return counts if min(cores, 8) in counts else [*counts, min(cores, 8)]


def run(reps: int, seconds: float, workers: list[int], gil_seconds: float) -> dict:
    all_cores = sorted(os.sched_getaffinity(0))
    if max(workers) > len(all_cores):
        raise SystemExit(f"asked for {max(workers)} workers, this process may use {len(all_cores)} cores")
    pyspy = _pyspy() if gil_seconds > 0 else None
    if gil_seconds > 0 and not pyspy:
        print("no py-spy here (.venv/bin/pip install py-spy): no GIL columns", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        srcs = sources(Path(tmp))
        pools: dict[tuple[str, int], cf.Executor] = {}
        try:
            for mode in MODES:
                for w in workers:
                    os.sched_setaffinity(0, all_cores[:w])  # threads and processes started now inherit it
                    pools[(mode, w)] = make_pool(mode, w)
            rates: dict[tuple[str, str, int], list[float]] = {}
            used: dict[tuple[str, str, int], list[float]] = {}
            gil: dict[str, list[dict]] = {}
            for rep in range(reps):
                for kind in KINDS:
                    for w in workers:
                        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                            os.sched_setaffinity(0, all_cores[:w])
                            rate, cores = saturate(pools[(mode, w)], srcs[kind], w, seconds)
                            rates.setdefault((kind, mode, w), []).append(rate)
                            used.setdefault((kind, mode, w), []).append(cores)
                    if pyspy:
                        try:
                            gil.setdefault(kind, []).append(gil_share(kind, gil_seconds, pyspy))
                        except (RuntimeError, subprocess.TimeoutExpired) as err:
                            print(f"no GIL columns: {err}", flush=True)
                            pyspy = None
                print(f"rep {rep + 1}/{reps} done (load average {os.getloadavg()[0]:.2f})", flush=True)
        finally:
            os.sched_setaffinity(0, all_cores)
            for pool in pools.values():
                pool.shutdown(wait=True, cancel_futures=True)
    rows = []
    for kind in KINDS:
        shares = gil.get(kind, [])
        probe = {key: statistics.median(s[key] for s in shares) for key in ("cpu_ms", "gil_ms", "gil_share")} \
            if shares else {}
        for w in workers:
            row = {"kind": kind, "workers": w, **{f"{k}": v for k, v in probe.items()}}
            for mode in MODES:
                samples = rates[(kind, mode, w)]
                base = rates[(kind, mode, workers[0])]
                row[f"{mode}_eps"] = statistics.median(samples)
                row[f"{mode}_eps_all"] = samples
                cores, base_cores = used[(kind, mode, w)], used[(kind, mode, workers[0])]
                row[f"{mode}_cores"] = statistics.median(cores)
                row[f"{mode}_cores_all"] = cores
                # The same over the reps whose windows both got their cores (90%): the machine's
                # other work left out, what the pool itself does with W cores.
                free = [s / b for s, b, c, bc in zip(samples, base, cores, base_cores, strict=True)
                        if c >= 0.9 * w and bc >= 0.9 * workers[0]]
                row[f"{mode}_scaling_free"] = statistics.median(free) if free else None
                row[f"{mode}_free_reps"] = len(free)
                # Scaling per rep (the same rep's W=1 and W), then the median: drift hits both alike.
                row[f"{mode}_scaling"] = statistics.median(s / b for s, b in zip(samples, base, strict=True))
            rows.append(row)
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.5, help="length of each saturated window")
    parser.add_argument("--workers", help="comma-separated W values (default 1, 2, 4 ... up to the cores, max 8)")
    parser.add_argument("--gil-seconds", type=float, default=3.0, help="each py-spy sampling run (0: none)")
    parser.add_argument("--out", default=f"bench/results/bench_media_pool-{time.strftime('%Y%m%d-%H%M%S')}.json")
    parser.add_argument("--loop", choices=KINDS, help=argparse.SUPPRESS)  # the child py-spy samples
    args = parser.parse_args()
    if args.loop:
        print(json.dumps(loop_episodes(args.loop, args.gil_seconds)))
        return
    workers = worker_counts(args.workers)
    env = env_info()
    result = run(args.reps, args.seconds, workers, args.gil_seconds)
    def free(r: dict, mode: str) -> str:
        return f"{r[f'{mode}_scaling_free']:5.2f}/{r[f'{mode}_free_reps']}" if r[f"{mode}_free_reps"] else "    -/0"

    print(f"\n{'kind':<5} {'W':>2} | {'threads ep/s':>12} {'x W=1':>6} {'free':>7} {'cores':>5} | {'procs ep/s':>10} "
          f"{'x W=1':>6} {'free':>7} {'cores':>5} | {'CPU ms/ep':>9} {'GIL ms/ep':>9} {'GIL share':>9}")
    for r in result["rows"]:
        gil = (f"{r['cpu_ms']:9.2f} {r['gil_ms']:9.2f} {r['gil_share']:9.1%}" if "cpu_ms" in r else "")
        print(f"{r['kind']:<5} {r['workers']:>2} | {r['threads_eps']:12.1f} {r['threads_scaling']:6.2f} "
              f"{free(r, 'threads')} {r['threads_cores']:5.2f} | {r['processes_eps']:10.1f} "
              f"{r['processes_scaling']:6.2f} {free(r, 'processes')} {r['processes_cores']:5.2f} | {gil}")
    print("x W=1: median over reps of the rep's ratio; free: the same over the reps (count after /) whose W and "
          "first-W windows both got >= 90% of their cores; cores: CPU seconds per second the pool got")
    out = write_json(args.out, {"bench": "media_pool", **env, "loadavg_at_end": os.getloadavg(),
                                "reps": args.reps, "seconds": args.seconds, "workers": workers,
                                "cv2": cv2.__version__, **result})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
