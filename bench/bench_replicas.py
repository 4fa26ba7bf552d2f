"""Two fake replicas behind one backend; one is SIGKILLed mid-run. Failed items (target 0) and
each replica's share of answered requests before and after the kill.

Two phases, each with fresh replicas and a fresh proxy:
  stream  --requests /score calls (16-frame MP4 episodes) at --concurrency; replica B is
          SIGKILLed once a third of them have been answered
  batch   one POST /score/batch of --batch-items; B is SIGKILLed --kill-after-s into it
Requests in flight on B when it dies fail with a transport error and are retried on A (the
retry policy avoids the endpoint that failed); B's circuit opens after its consecutive failures
and the background probe keeps it out. Fakes model continuous batching (0.1 s + 1 ms × running).

    python bench/bench_replicas.py [--requests 600] [--concurrency 16] [--batch-items 256]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import env_info, pct, proxy_config, start_fake, start_proxy, stop, write_json  # noqa: E402
from bench.bench_batch import make_items  # noqa: E402
from bench.bench_proxy_overhead import MODEL  # noqa: E402

LATENCY = {"latency_base_s": 0.1, "latency_per_seq_s": 0.001, "max_num_seqs": 128}


def shares(endpoints: list[str], counts: collections.Counter) -> dict:
    total = sum(counts[e] for e in endpoints) or 1
    return {e: {"count": counts[e], "share": round(counts[e] / total, 3)} for e in endpoints}


async def stream_phase(proxy_url: str, items: list[dict], n: int, concurrency: int, kill) -> dict:
    results: list[dict] = []
    killed_at: list[float] = []
    counter = iter(range(n))
    deadline = time.monotonic() + 300
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=120.0, trust_env=False) as client:
        async def worker() -> None:
            for i in counter:
                if time.monotonic() > deadline:
                    return
                t0 = time.perf_counter()
                try:
                    r = await client.post(f"{proxy_url}/score", json=items[i % len(items)])
                    body = r.json()
                    ok = r.status_code == 200
                except (httpx.HTTPError, ValueError) as err:
                    ok, body = False, {"error": type(err).__name__}
                done = time.perf_counter()
                results.append({"ok": ok, "t_done": done, "latency_s": done - t0,
                                "endpoint": body.get("endpoint") if ok else None,
                                "attempts": body.get("attempts") if ok else None,
                                "error": None if ok else body.get("error")})
                if not killed_at and len(results) >= n // 3:
                    killed_at.append(time.perf_counter())
                    kill()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"results": results, "killed_at": killed_at[0] if killed_at else None}


async def batch_phase(proxy_url: str, items: list[dict], kill_after_s: float, kill) -> dict:
    async with httpx.AsyncClient(timeout=300.0, trust_env=False) as client:
        async def killer() -> float:
            await asyncio.sleep(kill_after_s)
            kill()
            return time.perf_counter()

        t0 = time.perf_counter()
        kill_task = asyncio.create_task(killer())
        r = await client.post(f"{proxy_url}/score/batch", json={"items": items})
        wall = time.perf_counter() - t0
        killed_at = await kill_task
    body = r.json()
    # A batch answers at once, so "before/after" is by when each item was scored:
    # total - upstream (the item's own wait) is unknown here; use attempts and endpoint instead.
    return {"status": r.status_code, "wall_s": wall, "killed_after_s": killed_at - t0,
            "results": body.get("results", []), "summary": body.get("summary")}


def run_phase(phase: str, args, items: list[dict]) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-replicas-{phase}-", dir="/tmp") as tmp:
        log_dir = Path(tmp)
        a = b = proxy = None
        try:
            a = start_fake(log_dir, "replica-a", MODEL, **LATENCY)
            b = start_fake(log_dir, "replica-b", MODEL, **LATENCY)
            endpoints = [f"{a.url}/v1", f"{b.url}/v1"]
            proxy = start_proxy(log_dir, proxy_config(MODEL, endpoints, max_in_flight=128,
                                                      media_root=args.media_root, health_interval_s=1.0))

            def kill() -> None:
                stop(b, signal.SIGKILL)

            if phase == "stream":
                out = asyncio.run(stream_phase(proxy.url, items, args.requests, args.concurrency, kill))
                res, killed = out["results"], out["killed_at"]
                before = collections.Counter(r["endpoint"] for r in res if r["ok"] and r["t_done"] <= killed)
                after = collections.Counter(r["endpoint"] for r in res if r["ok"] and r["t_done"] > killed)
                lat_after = [r["latency_s"] * 1e3 for r in res if r["t_done"] > killed]
                return {"phase": phase, "requests": len(res), "failed": sum(not r["ok"] for r in res),
                        "errors": [r["error"] for r in res if not r["ok"]][:5],
                        "retried": sum(1 for r in res if r["ok"] and (r["attempts"] or 1) > 1),
                        "before": shares(endpoints, before), "after": shares(endpoints, after),
                        "p50_ms_after_kill": pct(lat_after, 50), "p99_ms_after_kill": pct(lat_after, 99)}
            out = asyncio.run(batch_phase(proxy.url, items[: args.batch_items], args.kill_after_s, kill))
            res = out["results"]
            ok = [r for r in res if r.get("ok")]
            first = collections.Counter(r["result"]["endpoint"] for r in ok if r["result"]["attempts"] == 1)
            retried = collections.Counter(r["result"]["endpoint"] for r in ok if r["result"]["attempts"] > 1)
            return {"phase": phase, "requests": len(items[: args.batch_items]),
                    "failed": len(items[: args.batch_items]) - len(ok), "status": out["status"],
                    "errors": [r.get("error") for r in res if not r.get("ok")][:5],
                    "retried": sum(retried.values()), "wall_s": out["wall_s"],
                    "killed_after_s": out["killed_after_s"],
                    "answered_first_try": shares(endpoints, first), "answered_after_retry": shares(endpoints, retried)}
        finally:
            for server in (proxy, b, a):
                stop(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--batch-items", type=int, default=256)
    parser.add_argument("--kill-after-s", type=float, default=0.6)
    parser.add_argument("--only", choices=["stream", "batch"])
    parser.add_argument("--out", default="bench/results/replicas.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-replicas-media-", dir="/tmp") as media:
        args.media_root = media
        items = make_items(max(64, args.batch_items), "mp4", Path(media))
        for phase in [args.only] if args.only else ["stream", "batch"]:
            row = run_phase(phase, args, items)
            rows.append(row)
            print(f"\n== {phase}: {row['requests']} requests, failed {row['failed']}, retried {row['retried']}")
            for key in ("before", "after", "answered_first_try", "answered_after_retry"):
                if key in row:
                    cells = ", ".join(f"{'A' if i == 0 else 'B'} {v['count']} ({v['share']:.0%})"
                                      for i, v in enumerate(row[key].values()))
                    print(f"   {key:<22} {cells}")
            if "p99_ms_after_kill" in row:
                print(f"   after kill: p50 {row['p50_ms_after_kill']:.0f} ms, p99 {row['p99_ms_after_kill']:.0f} ms")
            if "wall_s" in row:
                print(f"   batch wall {row['wall_s']:.2f} s, B killed {row['killed_after_s']:.2f} s in")
            if row["errors"]:
                print(f"   first errors: {row['errors']}")
    del args.media_root
    out = write_json(args.out, {"bench": "replicas", **env_info(), "args": vars(args), "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
