"""Inline JPEGs already at the final size are forwarded to vLLM as they came (issue 16): the real
server takes them at the same token cost as the proxy's own JPEGs, and a damaged one is an
explicit answer for that request, never a replica taken out of rotation."""

from __future__ import annotations

import base64
import hashlib

import cv2
import numpy as np
import pytest

from tests.fakes.episodes import episode_frames, images_b64
from tests.real_vllm.stack import QWEN_ONE_ASK, TASK, RealStack, say

pytestmark = pytest.mark.real_vllm


def _final_size_jpegs(count: int) -> list[str]:
    """Frames at 336x336: what the proxy sends for LIBERO-like 224x224 (the video floor)."""
    return images_b64(np.stack([cv2.resize(f, (336, 336)) for f in episode_frames(count, 224, 224)]), ".jpg")


def test_forwarded_jpegs_cost_what_the_proxys_own_cost(real_stack: RealStack, http) -> None:
    jpegs = _final_size_jpegs(8)
    forwarded = http.post("/score", json={"task_text": TASK, "backend": QWEN_ONE_ASK, "frames": jpegs})
    assert forwarded.status_code == 200, forwarded.text
    result = forwarded.json()
    assert result["frames"]["sha256"] == [hashlib.sha256(base64.b64decode(j)).hexdigest() for j in jpegs]
    as_png = http.post("/score", json={"task_text": TASK, "backend": QWEN_ONE_ASK,
                                       "frames": images_b64(np.stack([cv2.resize(f, (336, 336)) for f in
                                                                      episode_frames(8, 224, 224)]), ".png")})
    assert as_png.status_code == 200, as_png.text  # PNGs are decoded and encoded: the old path
    assert result["usage"]["prompt_tokens"] == as_png.json()["usage"]["prompt_tokens"]
    say(f"forwarded JPEGs: {result['usage']['prompt_tokens']} prompt tokens, as the proxy's own JPEGs")


def test_a_damaged_forwarded_jpeg_is_this_requests_answer(real_stack: RealStack, http) -> None:
    jpegs = _final_size_jpegs(4)
    raw = bytearray(base64.b64decode(jpegs[1]))
    middle = len(raw) // 2
    raw[middle:middle + 64] = bytes(64)  # entropy-coded data damaged; the end-of-image marker kept
    jpegs[1] = base64.b64encode(bytes(raw)).decode()
    answer = http.post("/score", json={"task_text": TASK, "backend": QWEN_ONE_ASK, "frames": jpegs})
    say(f"damaged forwarded JPEG: {answer.status_code} {answer.text[:200]}")
    if answer.status_code != 200:  # decoded anyway (libjpeg warns and fills) is the other outcome
        assert answer.status_code == 502 and answer.json()["error"]["code"] == "upstream_rejected", answer.text
    health = http.get("/health").json()["backends"][QWEN_ONE_ASK]
    assert health["ready"] and all(e["circuit"] == "closed" for e in health["endpoints"]), health
    good = http.post("/score", json={"task_text": TASK, "backend": QWEN_ONE_ASK, "frames": _final_size_jpegs(4)})
    assert good.status_code == 200, good.text
