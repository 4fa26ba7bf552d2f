"""The cost of SRPO's progress math per step (proxy/progress_math.py), beside one embedding call.

A GRPO step of LIBERO-10 ends, say, 64-512 episodes over 10 tasks. Per task the proxy standardises
and clusters the successes (pairwise distances: O(successes^2 x dim)) and measures each failure
to the centres. This times `srpo_progress` for one task at several sizes and embedding widths
(3584: Qwen2.5-VL-7B's hidden size; 1408: V-JEPA 2 ViT-g), with the successes in a few tight
clusters as a trained policy's would be. Prints a table and writes JSON. Compare rows of one run
with each other (and with the embedding call's time the real-vLLM tier prints), not with other runs.

    python bench/bench_progress.py [--runs 20] [--out bench/results/progress.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import env_info, write_json  # noqa: E402
from proxy.progress_math import srpo_progress  # noqa: E402


def _case(successes: int, failures: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 1, (3, dim))
    refs = centres[rng.integers(0, 3, successes)] + rng.normal(0, 0.01, (successes, dim))
    return refs, rng.normal(0, 1, (failures, dim))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", default="bench/results/progress.json")
    args = parser.parse_args(argv)
    rows = []
    for dim in (1408, 3584):
        for successes, failures in ((4, 4), (32, 32), (128, 128), (256, 256)):
            refs, fails = _case(successes, failures, dim)
            srpo_progress(refs, fails)  # warm-up
            cpu = []
            for _ in range(args.runs):
                begin = time.process_time()
                result = srpo_progress(refs, fails)
                cpu.append((time.process_time() - begin) * 1e3)
            rows.append({"dim": dim, "successes": successes, "failures": failures, "centres": result.centres,
                         "cpu_ms_median": round(statistics.median(cpu), 3),
                         "cpu_us_per_episode": round(statistics.median(cpu) * 1e3 / (successes + failures), 1)})
            print(f"dim {dim:5d}  successes {successes:4d}  failures {failures:4d}  centres {result.centres}  "
                  f"cpu {rows[-1]['cpu_ms_median']:8.2f} ms  ({rows[-1]['cpu_us_per_episode']:.1f} us/episode)")
    print("wrote", write_json(args.out, {"bench": "progress_math", "runs": args.runs, "rows": rows, "env": env_info()}))


if __name__ == "__main__":
    main()
