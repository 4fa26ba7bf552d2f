"""How fast `vlm-reward-proxy report` reads an audit log, and how much memory it holds.

Not a test. Writes synthetic audit logs shaped like the proxy's real lines (two backends, ten
LIBERO tasks, 16 frame hashes + PRIMO's 2 stills per line, metadata with env_success, ~3% parse
failures, ~1% upstream errors, usage and timings), then runs the real command in a fresh process
per size, timing it end to end (imports and figures included) and reading the child's peak RSS.
The slope between two sizes gives the per-line cost; 1M lines is extrapolated from it.

    .venv/bin/python bench/bench_report.py [--lines 10000,100000] [--keep DIR]

Prints a table and writes bench/results/bench_report-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import env_info, write_json  # noqa: E402

BACKENDS = (("qwen2_5_vl_vllm", "Qwen2.5-VL-7B-Instruct", "qwen_progress"), ("PRIMO-R1", "PRIMO-R1-7B", "primo_r1"))


def _hex(rng: random.Random) -> str:
    return f"{rng.getrandbits(256):064x}"


def audit_line(i: int, rng: random.Random) -> dict:
    backend, model, prompt = BACKENDS[i % 2]
    success = rng.random() < 0.4
    task = rng.randrange(10)
    line = {
        "ts": 1795387681.0 + i * 0.05, "backend": backend, "task_text": f"LIBERO-10 task {task}: put the bowl #{i}",
        "metadata": {"env_success": success, "task_id": task, "episode_id": f"env{i % 64}-ep{i // 64}",
                     "step": rng.randrange(100, 512), "run": "B", "env": i % 64},
        "prompt": {"name": prompt, "sha256": "e7caff8b7ab975ba52fe09e5895fb4d8fc961b78062088fafc8b9c98c4f577ce",
                   "overrides": {}},
        "frames": {"count": 16, "requested": 16, "indices": list(range(0, 512, 32)), "size": [336, 336],
                   "still_size": [56, 56] if i % 2 else None, "fps": 4.0, "vision_tokens": 1154,
                   "sha256": [_hex(rng) for _ in range(16)], "still_sha256": [_hex(rng), _hex(rng)] if i % 2 else []},
        "frame_store": {"written": 16, "present": 0, "error": None},
        "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                     "presence_penalty": 0.0, "frequency_penalty": 0.0, "max_tokens": 64, "seed": 0},
        "asks": 1, "finish_reason": "stop", "endpoint": "http://127.0.0.1:8001/v1",
        "usage": {"prompt_tokens": 1300 + rng.randrange(40), "completion_tokens": 4 + rng.randrange(400) * (i % 2),
                  "total_tokens": 0},
        "usage_all_calls": {"prompt_tokens": 1300, "completion_tokens": 4, "total_tokens": 1304},
    }
    roll = rng.random()
    if roll < 0.03:
        line.update(output_text="I cannot tell from these frames.", attempts=2, asks=2, error={
            "code": "unparseable_score", "message": "the reply holds no <score>…</score> (after 2 asks)"})
    elif roll < 0.04:
        line.update(output_text=None, attempts=4, error={"code": "upstream_unavailable", "message": "503 x4"})
    else:
        raw = min(100, max(0, round(rng.gauss(80 if success else 25, 18))))
        line.update(output_text=f"<score>{raw}</score>", model=model, score=raw / 100, raw_score=float(raw),
                    parse={"mode": "percentage", "scale": "0-100", "source": "score_tag", "finish_reason": "stop"},
                    attempts=1, timings_ms={"load": 0.5, "encode": 20 + rng.random() * 5,
                                            "upstream": 300 + rng.expovariate(1 / 200), "total": 0.0})
        line["timings_ms"]["total"] = round(sum(line["timings_ms"].values()), 3)
    return line


def write_log(path: Path, lines: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    with path.open("w") as fh:
        for i in range(lines):
            fh.write(json.dumps(audit_line(i, rng), separators=(",", ":")) + "\n")
    return path.stat().st_size


def run_report(log: Path, out: Path) -> dict:
    """The real command in a child process: wall time and the child's peak RSS."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "vlm_reward_cli", "report", str(log), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=3600, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"report failed ({done.returncode}):\n{done.stderr[-2000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux; max over children so far
    return {"wall_s": wall, "peak_rss_mib": peak / 1024, "peak_grew": peak > before}


def read_only(log: Path) -> float:
    """Just the streaming reader, in this process (no imports, no figures)."""
    from reports.audit import read_audit_log

    started = time.perf_counter()
    read_audit_log(log)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", default="10000,100000", help="comma-separated log sizes, smallest first")
    parser.add_argument("--keep", default=None, help="write the logs and reports here (default: a temp dir)")
    args = parser.parse_args()
    sizes = sorted(int(n) for n in args.lines.split(","))
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.keep or scratch)
        root.mkdir(parents=True, exist_ok=True)
        for lines in sizes:  # smallest first: ru_maxrss of children only grows
            log = root / f"audit-{lines}.jsonl"
            size = write_log(log, lines)
            timed = run_report(log, root / f"report-{lines}")
            reader_s = read_only(log)
            rows.append({"lines": lines, "log_mib": size / 2**20, **timed, "reader_s": reader_s,
                         "lines_per_s": lines / timed["wall_s"], "reader_lines_per_s": lines / reader_s})
    print(f"{'lines':>9} {'log MiB':>8} {'wall s':>7} {'lines/s':>9} {'reader s':>8} {'reader l/s':>10} "
          f"{'peak RSS MiB':>12}")
    for r in rows:
        print(f"{r['lines']:>9,} {r['log_mib']:8.1f} {r['wall_s']:7.2f} {r['lines_per_s']:9,.0f} {r['reader_s']:8.2f} "
              f"{r['reader_lines_per_s']:10,.0f} {r['peak_rss_mib']:12.1f}")
    extrapolated = None
    if len(rows) >= 2:
        small, big = rows[0], rows[-1]
        per_line_s = (big["wall_s"] - small["wall_s"]) / (big["lines"] - small["lines"])
        per_line_kib = (big["peak_rss_mib"] - small["peak_rss_mib"]) * 1024 / (big["lines"] - small["lines"])
        extrapolated = {"lines": 1_000_000, "wall_s": big["wall_s"] + per_line_s * (1_000_000 - big["lines"]),
                        "peak_rss_mib": big["peak_rss_mib"] + per_line_kib * (1_000_000 - big["lines"]) / 1024,
                        "per_line_us": per_line_s * 1e6, "per_line_rss_bytes": per_line_kib * 1024}
        print(f"1M lines (extrapolated from the slope): ~{extrapolated['wall_s']:.0f} s, "
              f"peak RSS ~{extrapolated['peak_rss_mib']:.0f} MiB ({extrapolated['per_line_us']:.0f} µs and "
              f"{extrapolated['per_line_rss_bytes']:.0f} B per line)")
    out = write_json(f"bench/results/bench_report-{time.strftime('%Y%m%d-%H%M%S')}.json",
                     {"bench": "report", "machine": env_info(), "rows": rows, "extrapolated_1m": extrapolated})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
