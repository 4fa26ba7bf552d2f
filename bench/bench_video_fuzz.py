"""The fuzz corpus of tests/bad_input/test_video_fuzz.py, longer: `--files` seeded mutations of valid
MP4, AVI and MKV files (tests/fakes/media_corpus.py: bit flips, truncation, box/chunk/element sizes
rewritten, index tables inflated) sent as `video_path` to a real proxy process (default caps,
`--workers` media workers, video in decoder processes unless `--threads`) with 2 x workers
requests in flight. Counts the answers by mutation, status and code, the decoder failures by
cause, and the proxy's RSS (alone, and with its decoder processes) before and after; prints a
table and writes JSON. A 5xx, a dead proxy or an unhealthy one is a failed run (exit status 1).

    .venv/bin/python bench/bench_video_fuzz.py [--files 3000] [--seed 40] [--workers 2] [--threads]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import contextlib

import psutil  # noqa: E402

from tests.fakes.media_corpus import mutants, seed_videos  # noqa: E402
from tests.security._media_stack import media_stack  # noqa: E402


def rss_mb(proc: psutil.Process) -> tuple[float, float]:
    total = own = proc.memory_info().rss
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += child.memory_info().rss
    return round(own / 2**20, 1), round(total / 2**20, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", action="store_true", help="decode video on the media threads (as before)")
    parser.add_argument("--out", default="bench/results/video_fuzz.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, media_stack(
            Path(tmp), media_workers=args.workers, video_decoders={"isolated": not args.threads}) as stack:
        corpus = list(mutants(seed_videos(stack.outside), args.files, args.seed))
        for name, _, data in corpus:
            (stack.media / name).write_bytes(data)
        proxy = psutil.Process(stack.proxy.proc.pid)
        stack.score(stack.media / corpus[0][0], nframes=4)
        before = rss_mb(proxy)

        def ask(name: str):
            return stack.client.post("/score", json={"task_text": "t", "video_path": str(stack.media / name),
                                                     "nframes": 4}, timeout=120)

        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(2 * args.workers) as pool:
            answers = list(pool.map(ask, [name for name, _, _ in corpus]))
        seconds = time.perf_counter() - started
        after = rss_mb(proxy)
        healthy = stack.client.get("/health").status_code == 200 and stack.proxy.alive
    by_mutation: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    causes: collections.Counter = collections.Counter()
    server_errors = []
    for (name, mutation, _), response in zip(corpus, answers, strict=True):
        error = response.json().get("error", {}) if response.status_code != 200 else {}
        by_mutation[mutation][f"{response.status_code} {error.get('code', '')}".strip()] += 1
        if error.get("code") == "media_decoder_failed":
            causes[error["cause"]] += 1
        if response.status_code >= 500:
            server_errors.append((name, response.text[:300]))
    print(f"{args.files} files, seed {args.seed}, {args.workers} workers, "
          f"{'threads' if args.threads else 'decoder processes'}: {seconds:.1f} s ({args.files / seconds:.0f} files/s)")
    for mutation, counts in sorted(by_mutation.items()):
        print(f"  {mutation:<14} " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    print(f"  decoder failures by cause: {dict(causes) or 'none'}; 5xx: {len(server_errors)}")
    print(f"  RSS proxy {before[0]} -> {after[0]} MB; with decoder processes {before[1]} -> {after[1]} MB; "
          f"healthy after: {healthy}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"files": args.files, "seed": args.seed, "workers": args.workers,
                               "threads": args.threads, "seconds": seconds,
                               "by_mutation": {k: dict(v) for k, v in by_mutation.items()},
                               "decoder_failures": dict(causes), "server_errors": server_errors,
                               "rss_before_mb": before, "rss_after_mb": after, "healthy": healthy}, indent=2))
    return 0 if healthy and not server_errors else 1


if __name__ == "__main__":
    sys.exit(main())
