"""What a restart's monitor rebuild costs (issue 39): `proxy.quality.restore.rebuild` over an audit
log holding `--keys` keys x `--window` episodes each (one score line per episode, shaped like the
proxy's, ~2.3 KB), rotated as the proxy rotates it, plus a `quality_alarm` line per key. Wall and
CPU time of the whole rebuild (read backwards, filter, parse, replay), lines per second and the
peak memory it allocates, with the default bounds. Prints a table, writes JSON to
bench/results/bench_restore.json.

    .venv/bin/python bench/bench_restore.py               # 256 keys x 128: ~33,000 lines, ~75 MB
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import write_json  # noqa: E402
from proxy.config import QualityConfig  # noqa: E402
from proxy.quality.restore import rebuild  # noqa: E402

PADDING = {"prompt": {"name": "qwen_progress", "sha256": "0" * 64, "overrides": {}},
           "frames": {"count": 16, "requested": 16, "indices": list(range(0, 512, 32)), "size": [448, 448],
                      "sha256": ["f" * 64] * 16},
           "output_text": "<score>73</score> " + "the gripper closes on the bowl. " * 30}


def write_log(directory: Path, keys: int, window: int, max_mb: float, seed: int) -> tuple[Path, int, int]:
    """The log as the proxy writes it: the current file and its rotations, newest content last."""
    rng = random.Random(seed)
    path = directory / "audit.jsonl"
    files, size, lines = [path.with_name("part.0")], 0, 0
    out = files[0].open("w")
    for i in range(keys * window):
        key = i % keys
        success = rng.random() < 0.4
        score = min(1.0, max(0.0, rng.gauss(0.75 if success else 0.3, 0.2)))
        line = json.dumps({"ts": 1.7e9 + i, "backend": "qwen2_5_vl_vllm", "task_text": f"task {key}",
                           "metadata": {"run": "bench", "task_id": key, "env_success": success,
                                        "episode_id": f"env{key}-ep{i}", "success_threshold": 0.5},
                           "score": score, **PADDING}, separators=(",", ":")) + "\n"
        if size + len(line) > max_mb * 2**20:
            out.close()
            files.append(path.with_name(f"part.{len(files)}"))
            out, size = files[-1].open("w"), 0
        out.write(line)
        size, lines = size + len(line), lines + 1
    for key in range(keys):
        out.write(json.dumps({"ts": 1.8e9, "kind": "quality_window", "run": "bench", "backend": "qwen2_5_vl_vllm",
                              "task_id": str(key), "status": "ok", "episodes_seen": window, "first_window": None,
                              "numbers": {}}, separators=(",", ":")) + "\n")
        lines += 1
    out.close()
    # the newest part is the current file, the one before it `.1`, and so on
    for age, part in enumerate(reversed(files)):
        part.rename(path if age == 0 else path.with_name(f"{path.name}.{age}"))
    return path, lines, sum(p.stat().st_size for p in directory.iterdir())


def measure(keys: int, window: int, max_mb: float, seed: int) -> dict:
    config = QualityConfig(window=window, max_keys=max(keys, 1), alarm={"min_episodes": min(32, window)})
    with tempfile.TemporaryDirectory() as tmp:
        path, lines, size = write_log(Path(tmp), keys, window, max_mb, seed)
        started_cpu, started = time.process_time(), time.perf_counter()
        restored = rebuild(path, config)
        cpu, wall = time.process_time() - started_cpu, time.perf_counter() - started
        tracemalloc.start()
        rebuild(path, config)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert len(restored.windows) == keys and restored.stopped_by == "start_of_log"
    return {"keys": keys, "window": window, "lines": lines, "log_mb": round(size / 2**20, 1),
            "files": len(restored.files), "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
            "lines_per_s": round(lines / wall), "peak_alloc_mb": round(peak / 2**20, 1),
            "max_lines": config.restore.max_lines, "max_seconds": config.restore.max_seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[256])
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--max-mb", type=float, default=16.0, help="rotation size of the synthetic log")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = [measure(k, args.window, args.max_mb, args.seed) for k in args.keys]
    print(f"{'keys':>5} {'window':>6} {'lines':>7} {'MB':>6} {'files':>5} {'wall s':>7} {'cpu s':>6} "
          f"{'lines/s':>8} {'peak MB':>8}")
    for r in rows:
        print(f"{r['keys']:>5} {r['window']:>6} {r['lines']:>7} {r['log_mb']:>6} {r['files']:>5} {r['wall_s']:>7} "
              f"{r['cpu_s']:>6} {r['lines_per_s']:>8} {r['peak_alloc_mb']:>8}")
    out = write_json("bench/results/bench_restore.json", {"rows": rows})
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
