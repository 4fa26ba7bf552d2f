"""A fake reward model that is right most of the time, for reward-quality tests.

An episode's outcome is painted into its last frame: a green square for a success, a blue one
for a failure (the rest of the frame is the usual grey ramp, so sampling still has content). The
grader reads the last video frame vLLM would receive, sees the colour, and answers a score drawn
around 80 (success) or 25 (failure) with seeded noise, so the report's agreement numbers are
high but not perfect. Everything about the noise is a pure function of the frame content and
the seed: a test recomputes every score it expects on its own."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

from tests.fakes.episodes import decode_jpeg_b64, episode_frames

SUCCESS_RGB, FAILURE_RGB = (0, 200, 0), (0, 0, 200)


def outcome_episode(success: bool, episode_id: int, count: int = 24, size: int = 64) -> np.ndarray:
    """A synthetic episode whose last frame says how it ended, distinct per episode_id."""
    frames = episode_frames(count, size, size)
    frames[:, size // 2:, : size // 4] = episode_id % 251  # bottom-left strip: makes each episode unique
    frames[-1, size // 4: 3 * size // 4, size // 4: 3 * size // 4] = SUCCESS_RGB if success else FAILURE_RGB
    return frames


def seen_success(rgb: np.ndarray) -> bool:
    """What the grader sees in a decoded last frame: green centre = success."""
    h, w = rgb.shape[:2]
    centre = rgb[3 * h // 8: 5 * h // 8, 3 * w // 8: 5 * w // 8].reshape(-1, 3).mean(axis=0)
    return bool(centre[1] > centre[2])


def grader_score(success: bool, episode_key: str, seed: int = 0, noise: float = 18.0) -> int:
    """The 0-100 score the grader gives: around 80 or 25, noise seeded by the episode's key."""
    rng = random.Random(f"{seed}:{episode_key}")
    centre = 80.0 if success else 25.0
    return int(min(100, max(0, round(rng.gauss(centre, noise)))))


def last_video_frame(body: dict) -> np.ndarray:
    for part in reversed(body["messages"][-1]["content"]):
        if part["type"] == "video_url":
            return decode_jpeg_b64(part["video_url"]["url"].partition(";base64,")[2].split(",")[-1])
    raise AssertionError("no video in the request")


def grader(answer: Callable[[int], str], seed: int = 0, noise: float = 18.0) -> Callable[[dict], str]:
    """A fake vLLM reply_fn. `answer` writes the score in the backend's declared format, e.g.
    `lambda s: f"<score>{s}</score>"`. The task text keys the noise, so tests give each episode
    its own task text (e.g. "put the bowl on the plate #17")."""
    def reply(body: dict) -> str:
        text = next(p["text"] for p in body["messages"][-1]["content"] if p["type"] == "text")
        return answer(grader_score(seen_success(last_video_frame(body)), _episode_key(text), seed, noise))
    return reply


def _episode_key(prompt_text: str) -> str:
    """The '#<n>' the test put in the task text, found in the rendered prompt."""
    marker = prompt_text.rfind("#")
    return prompt_text[marker:].split()[0].strip(".,:;\"'") if marker >= 0 else prompt_text
