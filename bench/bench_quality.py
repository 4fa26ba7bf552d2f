"""What the live reward-quality monitor costs per scored episode (issue 26): CPU time of
`QualityMonitor.observe` (window update, the agreement numbers, the alarm rule, the gauges) on the
event loop's thread, and memory per tracked key, by window size. Episodes are spread over `--keys`
keys, with seeded scores and successes; the first window of each key fills before timing starts.
Prints a table, writes JSON to bench/results/bench_quality.json.

    .venv/bin/python bench/bench_quality.py            # windows 32, 128, 512; 16 keys; ~20 s
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import write_json  # noqa: E402
from proxy.audit import AuditLog  # noqa: E402
from proxy.config import QualityConfig  # noqa: E402
from proxy.metrics import Metrics  # noqa: E402
from proxy.quality.monitor import QualityMonitor  # noqa: E402


def episodes(count: int, keys: int, seed: int) -> list[tuple[dict, float]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        success = rng.random() < 0.4
        score = min(1.0, max(0.0, rng.gauss(0.75 if success else 0.3, 0.2)))
        out.append(({"run": "bench", "task_id": i % keys, "env_success": success}, score))
    return out


def measure(window: int, keys: int, timed: int, seed: int) -> dict:
    monitor = QualityMonitor(QualityConfig(window=window, alarm={"min_episodes": min(32, window)}), Metrics(),
                             AuditLog(None))
    for metadata, score in episodes(window * keys, keys, seed):  # every key's window full
        monitor.observe("qwen", "t", metadata, score)
    work = episodes(timed, keys, seed + 1)
    started_cpu, started = time.process_time(), time.perf_counter()
    for metadata, score in work:
        monitor.observe("qwen", "t", metadata, score)
    cpu, wall = time.process_time() - started_cpu, time.perf_counter() - started
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    extra = QualityMonitor(QualityConfig(window=window, alarm={"min_episodes": min(32, window)}), Metrics(),
                           AuditLog(None))
    for metadata, score in episodes(window, 1, seed):
        extra.observe("qwen", "t", metadata, score)
    grown = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    return {"window": window, "keys": keys, "episodes_timed": timed, "cpu_us_per_episode": round(cpu / timed * 1e6, 1),
            "wall_us_per_episode": round(wall / timed * 1e6, 1), "bytes_per_key_incl_metrics": grown}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--keys", type=int, default=16)
    parser.add_argument("--episodes", type=int, default=4000, help="timed episodes per window size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = [measure(w, args.keys, args.episodes, args.seed) for w in args.windows]
    print(f"{'window':>7} {'keys':>5} {'cpu us/episode':>15} {'wall us/episode':>16} {'bytes/key':>10}")
    for row in rows:
        print(f"{row['window']:>7} {row['keys']:>5} {row['cpu_us_per_episode']:>15} {row['wall_us_per_episode']:>16} "
              f"{row['bytes_per_key_incl_metrics']:>10}")
    out = write_json("bench/results/bench_quality.json", {"rows": rows})
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
