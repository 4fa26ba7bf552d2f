"""Per-episode CPU cost of load + sample + resize + JPEG-encode, by frame source.

Measures `proxy.media.encode.prepare_frames` (the exact code /score runs in its worker thread) plus
the base64 step, for a 16-frame 224×224 episode and for a LIBERO-sized one (512 frames of
256×256 sampled down to 16), from an MP4 on disk and from each inline encoding.
Prints a table and writes JSON. Not a test: numbers on a shared 2-core machine are noisy,
compare the rows of one run with each other.

    python bench/bench_media.py [--runs 200] [--out bench/results/media.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import LIMITS  # noqa: E402
from proxy.media.encode import prepare_frames  # noqa: E402
from tests.fakes.episodes import episode_frames, images_b64, npy_b64, write_mp4  # noqa: E402


def _measure(fn, runs: int) -> dict:
    fn()  # warm-up (codec init, page cache)
    cpu, wall = [], []
    for _ in range(runs):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append((time.process_time() - c0) * 1e3)
        wall.append((time.perf_counter() - w0) * 1e3)
    return {"cpu_ms_median": statistics.median(cpu), "wall_ms_median": statistics.median(wall),
            "wall_ms_p90": statistics.quantiles(wall, n=10)[-1], "runs": runs}


def run(runs: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, count, side in (("16 frames 224x224", 16, 224), ("512 frames 256x256 -> 16", 512, 256)):
            frames = episode_frames(count, side, side)
            mp4 = write_mp4(Path(tmp) / f"ep{count}.mp4", frames, fps=20)
            sources = {
                "mp4 (video_path)": {"video_path": mp4, "media_roots": [Path(tmp)]},
                "inline npy (frames_npy)": {"frames_npy": npy_b64(frames), "fps": 20.0},
                "inline PNG list (frames)": {"frames": images_b64(frames, ".png"), "fps": 20.0},
                "inline JPEG list (frames)": {"frames": images_b64(frames, ".jpg"), "fps": 20.0},
            }
            for source_name, source in sources.items():
                def once(source=source):
                    encoded = prepare_frames(LIMITS, **source)
                    return encoded.base64_frames
                n = runs if count <= 16 else max(10, runs // 8)
                stats = _measure(once, n)
                rows.append({"episode": label, "source": source_name, **stats})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--out", default="bench/results/media.json")
    args = parser.parse_args()
    rows = run(args.runs)
    print(f"{'episode':<26} {'source':<27} {'cpu ms':>8} {'wall ms':>8} {'p90 ms':>8}")
    for r in rows:
        print(f"{r['episode']:<26} {r['source']:<27} {r['cpu_ms_median']:8.2f} "
              f"{r['wall_ms_median']:8.2f} {r['wall_ms_p90']:8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "media", "python": platform.python_version(),
                               "machine": platform.machine(), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
