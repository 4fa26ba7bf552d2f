"""MP4-by-path episodes/s through the proxy's media executor, video decoded on its media threads
(`proxy.video_decoders.isolated: false`, as before issue 40) against decoded in its decoder
processes (the default), at W = 1 and 2 media workers, in one run.

Each configuration runs `MediaExecutor.run_job` — exactly what /score runs for a `video_path`
(open and check the file, decode 16 frames of a 256x256 MP4, resize, JPEG) — with 2 x W jobs always
in flight for `--seconds`, after a warm-up that starts the processes. The bench process (and so
every thread, the forkserver and every decoder process) is pinned to W cores. Configurations run
interleaved, `--reps` times; the table shows the medians and processes/threads of each rep's pair
(its median). `cores`: CPU seconds per second the bench and its children got.

    .venv/bin/python bench/bench_video_workers.py [--reps 7] [--seconds 2] [--workers 1,2] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))



from bench._common import LIMITS, env_info, tree_cpu_seconds, write_json  # noqa: E402
from proxy.config.video_decoders import VideoDecodersConfig  # noqa: E402
from proxy.media.budget import MediaCaps  # noqa: E402
from proxy.media.decode_jobs import EpisodeJob  # noqa: E402
from proxy.media.executor import MediaExecutor  # noqa: E402
from tests.fakes.episodes import episode_frames, write_mp4  # noqa: E402

MODES = ("threads", "processes")
CAPS = MediaCaps(512 * 2**20, 4096, 600.0)




async def saturate(mode: str, workers: int, job: EpisodeJob, seconds: float) -> tuple[float, float]:
    """(episodes/s, cores used) of one executor with 2 x workers jobs always in flight."""
    executor = MediaExecutor(workers, CAPS, VideoDecodersConfig() if mode == "processes" else None)
    try:
        await asyncio.gather(*(executor.run_job(job) for _ in range(4 * workers)))  # warm: processes, codecs
        done, cpu0, start = 0, tree_cpu_seconds(), time.perf_counter()
        deadline = start + seconds

        async def lane() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                await executor.run_job(job)
                done += 1

        await asyncio.gather(*(lane() for _ in range(2 * workers)))
        elapsed = time.perf_counter() - start
        return done / elapsed, (tree_cpu_seconds() - cpu0) / elapsed
    finally:
        await asyncio.to_thread(executor.close)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    allowed = sorted(os.sched_getaffinity(0))
    runs: dict[tuple[int, str], list[tuple[float, float]]] = {(w, m): [] for w in counts for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp).resolve()
        path = write_mp4(root / "episode.mp4", episode_frames(16, 256, 256), fps=20)
        job = EpisodeJob(LIMITS, {"video_path": str(path), "media_roots": [root]})
        for rep in range(args.reps):
            for workers in counts:
                os.sched_setaffinity(0, allowed[:workers])
                order = MODES if rep % 2 == 0 else MODES[::-1]  # neither mode always goes first
                for mode in order:
                    eps, cores = asyncio.run(saturate(mode, workers, job, args.seconds))
                    runs[(workers, mode)].append((eps, cores))
                    print(f"rep {rep} W={workers} {mode:9s} {eps:7.1f} ep/s  cores {cores:.2f}", flush=True)
        os.sched_setaffinity(0, allowed)
    rows = []
    print("\n| W | threads ep/s | cores | processes ep/s | cores | processes / threads (median of reps) |")
    print("|---|---|---|---|---|---|")
    for workers in counts:
        threads, processes = runs[(workers, "threads")], runs[(workers, "processes")]
        ratio = statistics.median(p[0] / t[0] for p, t in zip(processes, threads, strict=True))
        row = {"workers": workers, "threads": statistics.median(e for e, _ in threads),
               "threads_cores": statistics.median(c for _, c in threads),
               "processes": statistics.median(e for e, _ in processes),
               "processes_cores": statistics.median(c for _, c in processes), "ratio": ratio}
        rows.append(row)
        print(f"| {workers} | {row['threads']:.1f} | {row['threads_cores']:.2f} | {row['processes']:.1f} | "
              f"{row['processes_cores']:.2f} | {ratio:.2f}x |")
    if args.out:
        write_json(args.out, {"env": env_info(), "reps": args.reps, "seconds": args.seconds, "rows": rows,
                              "runs": {f"{w}/{m}": v for (w, m), v in runs.items()}})


if __name__ == "__main__":
    main()
