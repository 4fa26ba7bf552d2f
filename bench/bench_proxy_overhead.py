"""Pass-through overhead: the same chat request direct to vLLM (the fake), through our proxy's
/v1/chat/completions, and through LiteLLM's proxy, at concurrency 1 and 32.

`relay floor` is bench/_raw_relay.py: a store-and-forward relay with no routing, parsing,
retries or metrics (httptools on uvloop), the cost of copying the bytes twice over loopback.

The request is what /score sends for a 16-frame 224×224 episode: one `video_url` part of 16
JPEGs (~520 KiB body with the noise below), built with proxy.media.encode + proxy.prompting.layouts.
The fake answers at once (no latency model), so what is measured is each hop's own cost. Fake,
proxy and LiteLLM are separate processes; this process is the load generator (httpx.AsyncClient,
keep-alive, closed loop).
Cells are interleaved (direct, ours, litellm for each concurrency), so drift on the shared
machine hits all three alike: compare ratios within one run, not absolute numbers.

LiteLLM lives in its own venv (bash bench/setup_litellm.sh → ~/.cache/vlm-reward-proxy/litellm-venv);
without it the LiteLLM column is skipped and the reason printed.

    python bench/bench_proxy_overhead.py [--runs 3] [--n1 300] [--n32 2000] [--no-litellm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import (  # noqa: E402
    HOST,
    LIMITS,  # noqa: E402
    closed_loop,
    env_info,
    proxy_config,
    start_fake,
    start_litellm,
    start_proxy,
    start_raw_relay,
    stop,
    write_json,
)
from proxy.config import BackendConfig, SamplingConfig  # noqa: E402
from proxy.media.encode import prepare_frames  # noqa: E402
from proxy.prompting.layouts import build_chat_body  # noqa: E402
from tests.fakes.episodes import episode_frames, npy_b64  # noqa: E402

MODEL = "Qwen2.5-VL-7B-Instruct"
DEFAULT_LITELLM = Path.home() / ".cache/vlm-reward-proxy/litellm-venv/bin/litellm"


def chat_body(noise: float = 7.5) -> bytes:
    """The /score upstream body for 16 frames of 224×224 (noise makes the JPEGs realistic-sized)."""
    rng = np.random.default_rng(0)
    frames = np.clip(episode_frames(16).astype(np.float32) + rng.normal(0, noise, (16, 224, 224, 3)),
                     0, 255).astype(np.uint8)
    encoded = prepare_frames(LIMITS, frames_npy=npy_b64(frames), fps=4.0)
    cfg = BackendConfig(model=MODEL, endpoints=["http://127.0.0.1:1/v1"], layout="qwen_video",
                        prompt="qwen_progress")
    body = build_chat_body(cfg, SamplingConfig(), None, "Rate the task progress from 0 to 100.", encoded, 4.0)
    return json.dumps(body, separators=(",", ":")).encode()


def _cpu_s(pid: int | None) -> float:
    """CPU seconds of a server process and its children (LiteLLM's worker), 0 without one."""
    if pid is None:
        return 0.0
    process = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in (process, *process.children(recursive=True)))


def run_cells(targets: dict[str, tuple[str, dict]], body: bytes, n1: int, n32: int, warmup: int,
              pids: dict[str, int]) -> list[dict]:
    """Each cell's latency and throughput, and the CPU the hop's own process spent per request
    (its relay cost, free of how the 2 cores were shared at that moment)."""
    rows = []
    for concurrency, n in ((1, n1), (32, n32)):
        for name, (url, headers) in targets.items():
            before = _cpu_s(pids.get(name))
            warm = max(warmup, concurrency * 2)
            stats = asyncio.run(closed_loop(url, body, concurrency=concurrency, requests=n, headers=headers,
                                            warmup=warm, time_cap_s=180))
            cpu_ms = (_cpu_s(pids.get(name)) - before) * 1e3 / (warm + stats["requests"]) if name in pids else None
            rows.append({"target": name, **stats, "cpu_ms_per_request": cpu_ms})
            print(f"  c={concurrency:<3} {name:<16} p50 {stats['p50_ms']:7.2f} ms  p99 {stats['p99_ms']:7.2f} ms"
                  f"  {stats['req_per_s']:7.1f} req/s  errors {stats['errors']}"
                  + (f"  cpu {cpu_ms:.2f} ms/req" if cpu_ms is not None else ""), flush=True)
    return rows


def summarize(runs: list[list[dict]]) -> list[dict]:
    """Median over runs of each (concurrency, target) cell."""
    cells: dict[tuple[int, str], list[dict]] = {}
    for rows in runs:
        for r in rows:
            cells.setdefault((r["concurrency"], r["target"]), []).append(r)
    out = []
    for (c, target), rs in cells.items():
        out.append({"concurrency": c, "target": target, "runs": len(rs),
                    **{k: statistics.median(r[k] for r in rs) for k in ("p50_ms", "p99_ms", "req_per_s")},
                    "cpu_ms_per_request": (statistics.median(r["cpu_ms_per_request"] for r in rs)
                                           if rs[0].get("cpu_ms_per_request") is not None else None),
                    "errors": sum(r["errors"] for r in rs)})
    return out


def ratios(summary: list[dict]) -> dict:
    by = {(r["concurrency"], r["target"]): r for r in summary}
    ours_like = ["ours", "relay floor", *sorted({t for _, t in by if t.startswith("alt:")})]
    out: dict = {}
    for c in (1, 32):
        direct = by.get((c, "direct"))
        for target in (*ours_like, "litellm"):
            row = by.get((c, target))
            if direct and row:
                out[f"c{c}_{target}_added_p50_ms"] = row["p50_ms"] - direct["p50_ms"]
                out[f"c{c}_{target}_throughput_vs_direct"] = row["req_per_s"] / direct["req_per_s"]
        for ours in ours_like:
            if (c, ours) in by and (c, "litellm") in by:
                lit_added = out[f"c{c}_litellm_added_p50_ms"]
                out[f"c{c}_{ours}_added_over_litellm_added"] = (out[f"c{c}_{ours}_added_p50_ms"] / lit_added
                                                                if lit_added > 0 else float("nan"))
                out[f"c{c}_{ours}_throughput_over_litellm"] = (by[(c, ours)]["req_per_s"]
                                                               / by[(c, "litellm")]["req_per_s"])
    return out


def per_run_ratios(runs: list[list[dict]]) -> list[dict]:
    return [ratios(summarize([rows])) for rows in runs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="repeat the whole grid; medians reported")
    parser.add_argument("--n1", type=int, default=300, help="requests per cell at concurrency 1")
    parser.add_argument("--n32", type=int, default=2000, help="requests per cell at concurrency 32")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--litellm-bin", default=str(DEFAULT_LITELLM))
    parser.add_argument("--no-litellm", action="store_true")
    parser.add_argument("--compare-root", action="append", default=[],
                        help="also run the proxy from this checkout (e.g. a scratch copy with a change) "
                             "as target 'alt:<dir name>'; repeatable")
    parser.add_argument("--out", default="bench/results/proxy_overhead.json")
    args = parser.parse_args()

    body = chat_body()
    print(f"request body: {len(body) / 1024:.0f} KiB (16 JPEG frames 224x224 in one video_url part)")
    litellm_note = None
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        log_dir = Path(tmp)
        fake = proxy = litellm = floor = None
        alts: list = []
        try:
            fake = start_fake(log_dir, "fake", MODEL)
            api_base = f"http://{HOST}:{fake.port}/v1"
            proxy = start_proxy(log_dir, proxy_config(MODEL, [api_base], max_in_flight=256))
            floor = start_raw_relay(log_dir, fake.port)
            targets = {"direct": (f"{fake.url}/v1/chat/completions", {}),
                       "relay floor": (f"{floor.url}/v1/chat/completions", {}),
                       "ours": (f"{proxy.url}/v1/chat/completions", {})}
            for root in args.compare_root:
                label = "alt:" + Path(root).name
                alts.append(start_proxy(log_dir, proxy_config(MODEL, [api_base], max_in_flight=256),
                                        name=label.replace(":", "-"), root=Path(root)))
                targets[label] = (f"{alts[-1].url}/v1/chat/completions", {})
            if args.no_litellm:
                litellm_note = "skipped (--no-litellm)"
            elif not Path(args.litellm_bin).exists():
                litellm_note = f"skipped: {args.litellm_bin} not found (run bash bench/setup_litellm.sh)"
            else:
                try:
                    litellm = start_litellm(log_dir, args.litellm_bin, MODEL, api_base)
                    targets["litellm"] = (f"{litellm.url}/v1/chat/completions", litellm.extra["headers"])
                except RuntimeError as err:
                    litellm_note = f"LiteLLM did not start: {err}"
            if litellm_note:
                print(litellm_note)
            pids = {"relay floor": floor.pid, "ours": proxy.pid, **({"litellm": litellm.pid} if litellm else {}),
                    **{f"alt:{Path(root).name}": alt.pid for root, alt in zip(args.compare_root, alts, strict=True)}}
            runs = []
            for i in range(args.runs):
                print(f"run {i + 1}/{args.runs}", flush=True)
                runs.append(run_cells(targets, body, args.n1, args.n32, args.warmup, pids))
        finally:
            for server in (litellm, *alts, proxy, floor, fake):
                stop(server)

    summary = summarize(runs)
    rat = ratios(summary)
    print(f"\nmedian of {args.runs} run(s); body {len(body) / 1024:.0f} KiB")
    print(f"{'c':>3} {'target':<16} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'added p50':>10} {'x direct':>9}"
          f" {'cpu ms/req':>10}")
    direct = {r["concurrency"]: r for r in summary if r["target"] == "direct"}
    for r in summary:
        d = direct[r["concurrency"]]
        print(f"{r['concurrency']:>3} {r['target']:<16} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['req_per_s']:8.1f} "
              f"{r['p50_ms'] - d['p50_ms']:10.2f} {r['req_per_s'] / d['req_per_s']:9.2f}"
              + (f" {r['cpu_ms_per_request']:10.2f}" if r["cpu_ms_per_request"] is not None else ""))
    for key, value in rat.items():
        if "over_litellm" in key:
            print(f"{key}: {value:.3f}")
    out = write_json(args.out, {"bench": "proxy_overhead", **env_info(), "body_bytes": len(body),
                                "litellm": litellm_note or "ok", "compare_root": args.compare_root,
                                "runs": runs, "summary": summary,
                                "ratios": rat, "per_run_ratios": per_run_ratios(runs),
                                "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
