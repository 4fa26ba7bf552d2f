"""How long the largest body the proxy accepts (proxy.max_body_mb) holds the event loop while it
is parsed: FastAPI parses a JSON body with json.loads and validates it with pydantic on the loop.

Three bodies of max_body_mb each: the frames a /score may carry (base64 JPEG strings, what RLinf
sends), a frames_npy string, and the worst JSON per byte (an array of small numbers in a field
the schema refuses: it is parsed whole before validation refuses it). Prints a table and writes
JSON (--out). Numbers: docs/benchmarks.md; the issue's threshold is ~50 ms of stall. The last column
is what the proxy's routes do (proxy/http/json_body.py): refuse a body of too many values, else parse it
with pydantic-core.

    .venv/bin/python bench/bench_json_body.py --out /tmp/json_body.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pydantic import ValidationError  # noqa: E402

from proxy.config import ProxySettings  # noqa: E402
from proxy.errors import PayloadTooLarge  # noqa: E402
from proxy.http.json_body import check_json_values, max_json_values  # noqa: E402
from proxy.protocol.json_peek import loads  # noqa: E402
from proxy.protocol.score import ScoreRequest  # noqa: E402


def bodies(size: int) -> dict[str, bytes]:
    jpeg = base64.b64encode(os.urandom(24_000)).decode()  # ~32 KB of base64, a 224² JPEG's size
    count = max(1, size // (len(jpeg) + 3))
    frames = json.dumps({"task_text": "put the bowl on the plate", "frames": [jpeg] * count}).encode()
    blob = base64.b64encode(os.urandom(size * 3 // 4 - 64)).decode()
    npy = json.dumps({"task_text": "t", "frames_npy": blob}).encode()
    numbers = b'{"task_text": "t", "frames_npy": "", "junk": [' + b"0," * (size // 2 - 40) + b"0]}"
    return {"frames (base64 JPEGs)": frames, "frames_npy (one string)": npy, "junk number array": numbers}


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def validate(doc):
    with contextlib.suppress(ValidationError):  # the junk body is refused, after the parse that stalled the loop
        ScoreRequest.model_validate(doc)


async def _proxy_parse(raw: bytes) -> str:
    """What the proxy's routes do (proxy/http/json_body.py): the value count, then pydantic-core's parse."""
    settings = ProxySettings()
    try:
        await check_json_values(raw, max_json_values(settings.max_inline_frames, settings.max_batch_items))
    except PayloadTooLarge:
        return "refused"
    await asyncio.sleep(0)  # the count ran in a thread: the loop runs between the two steps
    loads(raw)
    return "parsed"


async def _stall_ms(raw: bytes, how: str) -> float:
    """The longest the loop went without running (a 1 ms ticker) while `raw` was parsed."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    if how == "thread":
        await asyncio.to_thread(json.loads, raw)
    elif how == "proxy":
        await _proxy_parse(raw)
    else:
        json.loads(raw)
    await asyncio.sleep(0.01)
    done.set()
    await ticker
    return round(max(gaps) * 1e3, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=ProxySettings().max_body_mb, help="body size (max_body_mb)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    size = int(args.mb * 2**20)
    results = []
    for name, raw in bodies(size).items():
        loads = timed(lambda raw=raw: json.loads(raw), args.repeat)
        doc = json.loads(raw)
        check = timed(lambda doc=doc: validate(doc), args.repeat)
        results.append({"body": name, "bytes": len(raw), "json_loads_ms_median": round(statistics.median(loads), 1),
                        "json_loads_ms_max": round(max(loads), 1),
                        "validate_ms_median": round(statistics.median(check), 1),
                        "loop_stall_ms_on_loop": asyncio.run(_stall_ms(raw, "loop")),
                        "loop_stall_ms_in_thread": asyncio.run(_stall_ms(raw, "thread")),
                        "proxy": asyncio.run(_proxy_parse(raw)),
                        "loop_stall_ms_proxy": asyncio.run(_stall_ms(raw, "proxy"))})
        del doc
    print(f"{'body':26} {'MiB':>5} {'json.loads ms med/max':>22} {'validate ms':>11} {'stall: loop / thread ms':>24}"
          f" {'proxy: stall ms':>16}")
    for r in results:
        print(f"{r['body']:26} {r['bytes'] / 2**20:5.1f} {r['json_loads_ms_median']:>12} / {r['json_loads_ms_max']:<7}"
              f" {r['validate_ms_median']:>11} {r['loop_stall_ms_on_loop']:>13} / {r['loop_stall_ms_in_thread']:<10}"
              f" {r['loop_stall_ms_proxy']:>7} ({r['proxy']})")
    report = {"max_body_mb": args.mb, "python": platform.python_version(), "machine": platform.machine(),
              "cpus": os.cpu_count(), "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
