"""Where the proxy's CPU goes at its peak: py-spy samples the proxy process (a subprocess, all its
threads) while this process drives load, for two workloads:

  chat   /v1/chat/completions pass-through, ~280 KB video body, concurrency 32
  score  /score with inline frames_npy (16 frames 224×224), concurrency 8
  batch  POST /score/batch of 256 MP4 episodes, admission max_in_flight 256, against a fake with
         bench_batch's latency model (0.5 s + 5 ms × running, 128 at most), repeated

For chat and score the fake answers at once, so the proxy is the bottleneck. Writes, per workload, a py-spy
flame graph (SVG) and the collapsed stacks, then prints the top frames by own ("self") time
and by inclusive time, as a share of all samples.

Needs py-spy in the venv (`pip install py-spy`) and ptrace permission on the proxy process.

    python bench/profile_proxy.py [--seconds 20] [--only chat|score] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import (  # noqa: E402
    ROOT,
    closed_loop,
    env_info,
    proxy_config,
    start_fake,
    start_proxy,
    stop,
    write_json,
)
from bench.bench_proxy_overhead import MODEL, chat_body  # noqa: E402
from tests.fakes.episodes import episode_frames, npy_b64  # noqa: E402


def score_body() -> bytes:
    rng = np.random.default_rng(1)
    frames = np.clip(episode_frames(16).astype(np.float32) + rng.normal(0, 7.5, (16, 224, 224, 3)),
                     0, 255).astype(np.uint8)
    return json.dumps({"task_text": "put the black bowl on the plate", "frames_npy": npy_b64(frames),
                       "fps": 4.0}).encode()


def _frame_name(frame: str) -> str:
    # py-spy raw frames look like "function (path/to/file.py:123)"; keep function + short file.
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    path, _, _line = where.rpartition(":")
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if parts else path
    return f"{name} ({short})"


def top_frames(raw_path: Path, n: int = 15) -> dict:
    """Self and inclusive shares from py-spy's collapsed stacks ("a;b;c count" per line)."""
    self_t: collections.Counter = collections.Counter()
    incl_t: collections.Counter = collections.Counter()
    total = 0
    for line in raw_path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        c = int(count)
        frames = [_frame_name(f) for f in stack.split(";") if f and not f.startswith("process ")
                  and not f.startswith("thread ")]
        if not frames:
            continue
        total += c
        self_t[frames[-1]] += c
        for f in set(frames):
            incl_t[f] += c
    pct = lambda counter: [(f, round(100 * v / total, 1)) for f, v in counter.most_common(n)]  # noqa: E731
    return {"samples": total, "self": pct(self_t), "inclusive": pct(incl_t)}


def batch_body(media_dir: Path, n: int = 256) -> bytes:
    from bench.bench_batch import make_items
    return json.dumps({"items": make_items(n, "mp4", media_dir)}).encode()


def profile(workload: str, seconds: int, out_dir: Path, py_spy: str, rate: int, root: Path | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-profile-", dir="/tmp") as tmp:
        log_dir = Path(tmp)
        fake = proxy = None
        try:
            latency = {"latency_base_s": 0.5, "latency_per_seq_s": 0.005, "max_num_seqs": 128} \
                if workload == "batch" else {}
            fake = start_fake(log_dir, "fake", MODEL, **latency)
            proxy = start_proxy(log_dir, proxy_config(MODEL, [f"{fake.url}/v1"], max_in_flight=256,
                                                      media_root=str(log_dir)), root=root)
            if workload == "chat":
                url, body, concurrency = f"{proxy.url}/v1/chat/completions", chat_body(), 32
            elif workload == "score":
                url, body, concurrency = f"{proxy.url}/score", score_body(), 8
            else:
                media = log_dir / "media"
                media.mkdir()
                url, body, concurrency = f"{proxy.url}/score/batch", batch_body(media), 1
            asyncio.run(closed_loop(url, body, concurrency=concurrency, requests=2 if workload == "batch" else 50,
                                    warmup=0 if workload == "batch" else 10, time_cap_s=60))
            raw = out_dir / f"profile_{workload}.txt"
            svg = out_dir / f"profile_{workload}.svg"
            base = [py_spy, "record", "--pid", str(proxy.pid), "--duration", str(seconds), "--rate", str(rate),
                    "--nonblocking"]
            spies = [subprocess.Popen([*base, "--format", "raw", "-o", str(raw)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE)]
            # The load outlasts the sampling window; bounded by count and time.
            stats = asyncio.run(closed_loop(url, body, concurrency=concurrency, requests=100_000, warmup=0,
                                            time_cap_s=seconds + 1))
            for spy in spies:
                _, err = spy.communicate(timeout=60)
                if spy.returncode != 0:
                    raise RuntimeError(f"py-spy failed: {err.decode(errors='replace')[-800:]}")
            # The flame graph is drawn from the same samples.
            _flamegraph(raw, svg)
        finally:
            stop(proxy)
            stop(fake)
    return {"workload": workload, "concurrency": concurrency, "body_bytes": len(body),
            "load": {k: stats[k] for k in ("req_per_s", "p50_ms", "p99_ms", "errors")},
            "raw": str(raw.relative_to(ROOT)) if raw.is_relative_to(ROOT) else str(raw),
            "svg": str(svg.relative_to(ROOT)) if svg.is_relative_to(ROOT) else str(svg),
            **top_frames(raw)}


def _flamegraph(raw: Path, svg: Path) -> None:
    """A small self-contained icicle SVG from collapsed stacks (py-spy's own SVG needs a 2nd run)."""
    tree: dict = {}
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        node = tree
        total += int(count)
        for f in stack.split(";"):
            child = node.setdefault(f, {"_n": 0, "_c": {}})
            child["_n"] += int(count)
            node = child["_c"]
    width, row = 1600.0, 16
    rects: list[str] = []
    depth_max = [0]

    def draw(children: dict, x: float, depth: int) -> None:
        depth_max[0] = max(depth_max[0], depth)
        for name, node in sorted(children.items(), key=lambda kv: -kv[1]["_n"]):
            w = width * node["_n"] / total
            if w >= 0.5:
                label = name.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
                text = label if w > 60 else ""
                rects.append(f'<g><title>{label} ({100 * node["_n"] / total:.1f}%)</title>'
                             f'<rect x="{x:.1f}" y="{depth * row}" width="{w:.1f}" height="{row - 1}" '
                             f'fill="hsl({(hash(name) % 60) + 10},80%,65%)"/>'
                             f'<text x="{x + 2:.1f}" y="{depth * row + 12}" font-size="10" '
                             f'clip-path="none">{text[: int(w / 6)]}</text></g>')
                draw(node["_c"], x, depth + 1)
            x += w

    if total:
        draw(tree, 0.0, 0)
    svg.write_text(f'<svg xmlns="http://www.w3.org/2000/svg" width="{int(width)}" '
                   f'height="{(depth_max[0] + 2) * row}" font-family="monospace">{"".join(rects)}</svg>')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--only", choices=["chat", "score", "batch"])
    parser.add_argument("--root", default=None, help="run the proxy from this checkout (a scratch copy)")
    parser.add_argument("--out-dir", default="bench/results")
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"))
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir = out_dir if out_dir.is_absolute() else ROOT / out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for workload in [args.only] if args.only else ["chat", "score", "batch"]:
        r = profile(workload, args.seconds, out_dir, args.py_spy, args.rate,
                    Path(args.root) if args.root else None)
        results.append(r)
        print(f"\n== {workload}: c={r['concurrency']} {r['load']['req_per_s']:.1f} req/s under py-spy, "
              f"{r['samples']} samples -> {r['svg']}")
        print(f"{'self %':>7}  frame")
        for f, p in r["self"]:
            print(f"{p:7.1f}  {f}")
        print(f"{'incl %':>7}  frame")
        for f, p in r["inclusive"]:
            print(f"{p:7.1f}  {f}")
    out = write_json(out_dir / "profile.json", {"bench": "profile", **env_info(), "results": results})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
