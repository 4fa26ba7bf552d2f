"""256 episodes: one POST /score/batch vs one /score at a time vs the backend-only bound.

The fake vLLM models continuous batching: each request takes latency_base_s + latency_per_seq_s ×
running (0.5 s + 5 ms × running by default), at most max_num_seqs (128) at once, the rest queue.
  bound       256 chat requests sent straight to the fake at once (the proxy's own upstream body):
              what the backend alone needs; no proxy can beat it. Measured with raw sockets
              (the reference) and with an httpx client (whose pool costs show at 256 connections);
              the latency model's own lower bound (no transfer) is printed too
  batch       one POST /score/batch of 256 items through the proxy
  concurrent  256 POST /score at once (what a client without /score/batch does)
  sequential  POST /score one after the other (the seed server's pattern); the first
              --sequential-n are timed and the mean × 256 is reported (say --sequential-n 256
              to time all of them: ~2 min)
Episodes are 16-frame 224×224 MP4s under a temp dir (video_path), or inline JPEG lists
(--source jpeg). Inline frames_npy is not used for the batch: 16×224×224×3 uint8 is 3.2 MB of
base64 per episode, 820 MB for 256 in one body.

The proxy's admission cap (admission.max_in_flight_per_endpoint, default 64) would hold the
fake below its max_num_seqs; the temp config sets it to --max-in-flight (256). With
--default-admission-row the batch is also run through a second proxy left at the default 64.

    python bench/bench_batch.py [--episodes 256] [--repeats 3] [--sequential-n 16]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import env_info, proxy_config, start_fake, start_proxy, stop, write_json  # noqa: E402
from bench.bench_proxy_overhead import MODEL, chat_body  # noqa: E402
from tests.fakes.episodes import episode_frames, images_b64, write_mp4  # noqa: E402

TASK = "put the black bowl on the plate"


def make_items(n: int, source: str, media_dir: Path) -> list[dict]:
    items = []
    for i in range(n):
        frames = episode_frames(16 + (i % 4), 224, 224)  # a few lengths, so items differ
        if source == "mp4":
            path = write_mp4(media_dir / f"ep{i:04d}.mp4", frames, fps=20)
            items.append({"task_text": TASK, "video_path": str(path)})
        else:
            items.append({"task_text": TASK, "frames": images_b64(frames, ".jpg"), "fps": 20.0})
    return items


async def bound(fake_url: str, body: bytes, n: int) -> dict:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(limits=limits, timeout=120.0, trust_env=False) as client:
        url = f"{fake_url}/v1/chat/completions"
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(client.post(url, content=body,
                                                     headers={"content-type": "application/json"})
                                         for _ in range(n)), return_exceptions=True)
        wall = time.perf_counter() - t0
    ok = sum(1 for r in replies if isinstance(r, httpx.Response) and r.status_code == 200)
    return {"wall_s": wall, "ok": ok, "failed": n - ok}


async def bound_raw(port: int, body: bytes, n: int) -> dict:
    """The same, on raw asyncio streams (one connection each, hand-written HTTP/1.1): httpx's
    pool does per-request work quadratic in its connection count, which at 256 connections
    is a visible share of the measured "bound" itself."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode()

    async def one() -> bool:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=2**24)
        try:
            writer.write(head + body)
            await writer.drain()
            status_line = await reader.readline()
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            await reader.readexactly(length)
            return b" 200 " in status_line
        finally:
            writer.close()

    t0 = time.perf_counter()
    replies = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(n)), return_exceptions=True), 120)
    wall = time.perf_counter() - t0
    ok = sum(1 for r in replies if r is True)
    return {"wall_s": wall, "ok": ok, "failed": n - ok}


def model_bound(n: int, base: float, per_seq: float, max_seqs: int) -> float:
    """The fake's latency model alone, all n arriving at t=0, no transfer time: a lower bound."""
    import heapq
    running: list[float] = []  # finish times
    now, waiting, last = 0.0, n, 0.0
    while waiting or running:
        while waiting and len(running) < max_seqs:
            waiting -= 1
            heapq.heappush(running, now + base + per_seq * (len(running) + 1))
        now = heapq.heappop(running)
        last = max(last, now)
    return last


async def batch(proxy_url: str, items: list[dict]) -> dict:
    async with httpx.AsyncClient(timeout=300.0, trust_env=False) as client:
        t0 = time.perf_counter()
        r = await client.post(f"{proxy_url}/score/batch", json={"items": items})
        wall = time.perf_counter() - t0
    if r.status_code != 200:
        return {"wall_s": wall, "ok": 0, "failed": len(items), "error": r.text[:300]}
    summary = r.json()["summary"]
    return {"wall_s": wall, "ok": summary["ok"], "failed": summary["failed"]}


async def concurrent(proxy_url: str, items: list[dict]) -> dict:
    n = len(items)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(limits=limits, timeout=300.0, trust_env=False) as client:
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(client.post(f"{proxy_url}/score", json=it) for it in items),
                                       return_exceptions=True)
        wall = time.perf_counter() - t0
    ok = sum(1 for r in replies if isinstance(r, httpx.Response) and r.status_code == 200)
    return {"wall_s": wall, "ok": ok, "failed": n - ok}


async def sequential(proxy_url: str, items: list[dict], timed: int) -> dict:
    async with httpx.AsyncClient(timeout=120.0, trust_env=False) as client:
        per = []
        failed = 0
        for item in items[:timed]:
            t0 = time.perf_counter()
            r = await client.post(f"{proxy_url}/score", json=item)
            per.append(time.perf_counter() - t0)
            failed += r.status_code != 200
    mean = statistics.fmean(per)
    return {"wall_s": mean * len(items), "timed": timed, "extrapolated": timed < len(items),
            "mean_s": mean, "ok": timed - failed, "failed": failed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--source", choices=["mp4", "jpeg"], default="mp4")
    parser.add_argument("--repeats", type=int, default=3, help="bound/batch/concurrent repeats (median)")
    parser.add_argument("--sequential-n", type=int, default=16)
    parser.add_argument("--latency-base-s", type=float, default=0.5)
    parser.add_argument("--latency-per-seq-s", type=float, default=0.005)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-in-flight", type=int, default=256, help="admission.max_in_flight_per_endpoint")
    parser.add_argument("--default-admission-row", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--root", default=None, help="run the proxy from this checkout (e.g. a scratch copy)")
    parser.add_argument("--out", default="bench/results/batch.json")
    args = parser.parse_args()
    n = args.episodes

    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-batch-", dir="/tmp") as tmp:
        log_dir = Path(tmp)
        media_dir = log_dir / "media"
        media_dir.mkdir()
        items = make_items(n, args.source, media_dir)
        body = chat_body()
        fake = proxy = proxy64 = None
        try:
            fake = start_fake(log_dir, "fake", MODEL, latency_base_s=args.latency_base_s,
                              latency_per_seq_s=args.latency_per_seq_s, max_num_seqs=args.max_num_seqs)
            endpoints = [f"{fake.url}/v1"]
            proxy = start_proxy(log_dir, proxy_config(MODEL, endpoints, max_in_flight=args.max_in_flight,
                                                      media_root=str(media_dir)), root=args.root)
            if args.default_admission_row:
                proxy64 = start_proxy(log_dir, proxy_config(MODEL, endpoints, max_in_flight=64,
                                                            media_root=str(media_dir)), name="proxy-default",
                                      root=args.root)
            # Warm-up: codecs, connections, the fake's semaphore.
            asyncio.run(batch(proxy.url, items[:8]))
            if proxy64:
                asyncio.run(batch(proxy64.url, items[:8]))
            for rep in range(args.repeats):
                for name, fn in ((f"bound: fake alone, {n} at once, raw sockets",
                                  lambda: bound_raw(fake.port, body, n)),
                                 (f"bound: fake alone, {n} at once, httpx client", lambda: bound(fake.url, body, n)),
                                 (f"/score/batch x{n} (max_in_flight {args.max_in_flight})",
                                  lambda: batch(proxy.url, items)),
                                 (f"{n} concurrent /score (max_in_flight {args.max_in_flight})",
                                  lambda: concurrent(proxy.url, items)),
                                 *(((f"/score/batch x{n} (default max_in_flight 64)",
                                     lambda: batch(proxy64.url, items)),) if proxy64 else ())):
                    r = asyncio.run(fn())
                    rows.setdefault(name, []).append(r)
                    print(f"  rep {rep + 1}: {name:<48} {r['wall_s']:7.2f} s  ok {r['ok']} failed {r['failed']}",
                          flush=True)
            seq = asyncio.run(sequential(proxy.url, items, min(args.sequential_n, n)))
            label = f"sequential /score x{n}"
            rows[label + (f" (extrapolated from {seq['timed']})" if seq["extrapolated"] else "")] = [seq]
        finally:
            for server in (proxy64, proxy, fake):
                stop(server)

    bound_s = statistics.median(r["wall_s"] for r in next(iter(rows.values())))
    seq_s = next(v for k, v in rows.items() if k.startswith("sequential"))[0]["wall_s"]
    table = []
    for name, rs in rows.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        table.append({"mode": name, "wall_s": wall, "runs": len(rs), "failed": sum(r["failed"] for r in rs),
                      "x_bound": wall / bound_s, "speedup_vs_sequential": seq_s / wall})
    model_s = model_bound(n, args.latency_base_s, args.latency_per_seq_s, args.max_num_seqs)
    print(f"\nlatency model alone (no transfer, no client): {model_s:.2f} s")
    print(f"\n{n} episodes ({args.source}), fake {args.latency_base_s}s + {args.latency_per_seq_s}s x running, "
          f"max_num_seqs {args.max_num_seqs}; median of {args.repeats}")
    print(f"{'mode':<58} {'wall s':>8} {'x bound':>8} {'vs seq':>8} {'failed':>7}")
    for t in table:
        print(f"{t['mode']:<58} {t['wall_s']:8.2f} {t['x_bound']:8.2f} {t['speedup_vs_sequential']:7.1f}x "
              f"{t['failed']:7d}")
    out = write_json(args.out, {"bench": "batch", **env_info(), "args": vars(args), "table": table,
                                "latency_model_bound_s": model_s,
                                "raw": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
