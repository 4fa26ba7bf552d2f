"""Frame sizes equal what qwen-vl-utils (the seed's and PRIMO-R1's input pipeline) picks, asked of
the package itself in the reference env: smart_resize on a grid and on random sizes, and the
per-frame size of a video of N frames of HxW under a max_pixels, through its own fetch_video."""

from __future__ import annotations

import itertools
import random

import cv2
import numpy as np
import pytest

from tests.reference.oracle import run_qwen_vl_utils
from vlm_protocol.frames import smart_resize, video_frame_size

pytestmark = pytest.mark.reference

SIDES = [1, 27, 28, 29, 55, 56, 100, 128, 224, 255, 256, 257, 333, 448, 480, 512, 640, 720, 1080, 1920, 3000]
BUDGETS = [(3136, 12544), (3136, 50176), (3136, 200704), (3136, 401408), (12544, 802816), (200704, 200704),
           (100352, 200704), (100352, 602112)]


def _ours(h, w, lo, hi):
    try:
        return list(smart_resize(h, w, min_pixels=lo, max_pixels=hi))
    except ValueError:
        return None


def test_smart_resize_on_a_grid_and_on_random_sizes():
    rng = random.Random(0)
    cases = [[h, w, lo, hi] for (h, w), (lo, hi) in itertools.product(itertools.product(SIDES, SIDES), BUDGETS)]
    cases += [[rng.randint(1, 5000), rng.randint(1, 5000), 3136, rng.randint(3136, 3_000_000)] for _ in range(2000)]
    reference = run_qwen_vl_utils({"smart_resize": cases})["smart_resize"]
    mismatches = [(case, expected, _ours(*case)) for case, expected in zip(cases, reference, strict=True)
                  if _ours(*case) != expected]  # None on both sides: both refuse (a 0 side, a sliver)
    assert mismatches == [], mismatches[:10]
    assert sum(e is not None for e in reference) > 4000


def _write_video(path, height, width, frames=40, fps=20.0):
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    for i in range(frames):
        writer.write(np.full((height, width, 3), (i * 6) % 256, np.uint8))
    writer.release()
    return str(path)


SIZES = [(256, 256), (224, 224), (128, 128), (480, 640), (720, 1280), (96, 512), (360, 640)]
NFRAMES = [2, 8, 16, 22, 32]
MAX_PIXELS = [None, 200704, 401408, 602112, 1_003_520]  # not below 1.05 x the video floor: 0.0.14 asserts


def test_video_frame_sizes_on_a_grid_of_sizes_frame_counts_and_budgets(tmp_path):
    cases = []
    for height, width in SIZES:
        path = _write_video(tmp_path / f"{height}x{width}.mp4", height, width)
        cases += [{"path": path, "nframes": n, "max_pixels": m, "size": (height, width)}
                  for n, m in itertools.product(NFRAMES, MAX_PIXELS)]
    answer = run_qwen_vl_utils({"videos": [{k: v for k, v in c.items() if k != "size"} for c in cases]})
    table = []
    for case, got in zip(cases, answer["videos"], strict=True):
        assert "error" not in got, (case, got)
        ours = video_frame_size(*case["size"], got["frames"], max_pixels=case["max_pixels"])
        table.append((case["size"], got["frames"], case["max_pixels"], (got["height"], got["width"]), ours))
    mismatches = [row for row in table if row[3] != row[4]]
    assert mismatches == [], mismatches
    assert len(table) == len(SIZES) * len(NFRAMES) * len(MAX_PIXELS)
    print(f"qwen-vl-utils {answer['version']}: {len(table)} video cases equal")
