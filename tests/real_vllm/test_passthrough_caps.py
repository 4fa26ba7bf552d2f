"""Issue 39, item 4 on the real vLLM: a hostile pass-through request costs at most the backend's cap
or is refused before vLLM. The tier's servers run with the launchers' `--media-io-kwargs
'{"video": {"num_frames": -1}}' --trust-request-mm-kwargs`, and the tiny checkpoint's processors
size a frame up to 12,845,056 pixels (Qwen2.5-VL's own default).

- Four 4096² frames as a `data:` video with no sizes: sent straight to the replica they cost far
  over the cap (here: over the 8192-token context, so vLLM refuses them after decoding); through
  the proxy they go with the cap (`mm_processor_kwargs.max_pixels` = min(proxy.max_pixels_limit,
  frames.video_max_pixels), said in `x-vlm-proxy-bound`) and cost at most ceil(4/2) × cap/784
  vision tokens more than the same text alone (`usage.prompt_tokens`).
- Processor sizes asking for 4096² frames, a frame count of -1, and a frame list longer than the
  frame cap are 422s naming the field; the replicas' prompt-token counters do not move.
"""

from __future__ import annotations

import base64
import math
import re

import cv2
import httpx
import numpy as np
import pytest

from tests.real_vllm.stack import QWEN_MODEL, RealStack, say

pytestmark = pytest.mark.real_vllm

TEXT = "How far along is the task, in percent?"
PIXEL_CAP = 602_112  # min(proxy.max_pixels_limit 1,605,632, frames.video_max_pixels 602,112): the stack's defaults
FRAME_CAP = 128  # proxy.nframes_limit (the Qwen backend has no frames.clamp_nframes_to)
HUGE = 4096


def _jpeg(size: int, level: int) -> str:
    frame = np.full((size, size, 3), level, dtype=np.uint8)
    frame[: size // 2] = 255 - level  # two halves: something to see
    return base64.b64encode(cv2.imencode(".jpg", frame)[1].tobytes()).decode()


def _body(*parts: dict, **fields) -> dict:
    return {"model": QWEN_MODEL, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": TEXT}]}],
            "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "seed": 0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "max_tokens": 2, **fields}


def _video(jpegs: list[str]) -> dict:
    return {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + ",".join(jpegs)}}


def _prompt_tokens_served(stack: RealStack) -> float:
    """Every Qwen replica's vllm:prompt_tokens_total: what vLLM processed, whoever asked."""
    total = 0.0
    for key in ("qwen_r0", "qwen_r1"):
        text = httpx.get(stack.server_url(key) + "/metrics", timeout=30, trust_env=False).text
        total += sum(float(v) for v in re.findall(r"^vllm:prompt_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M))
    return total


def test_a_hostile_pass_through_costs_at_most_the_cap_or_is_refused(real_stack: RealStack) -> None:
    huge = _video([_jpeg(HUGE, level) for level in (40, 80, 120, 160)])
    with httpx.Client(base_url=real_stack.proxy_url, timeout=600, trust_env=False) as proxy:
        text_only = proxy.post("/v1/chat/completions", json=_body())
        assert text_only.status_code == 200, text_only.text
        text_tokens = text_only.json()["usage"]["prompt_tokens"]

        direct = httpx.post(real_stack.server_url("qwen_r0") + "/v1/chat/completions", json=_body(huge),
                            timeout=600, trust_env=False)
        vision_cap = math.ceil(4 / 2) * PIXEL_CAP // 784 + 2  # the frames' tokens and the vision start/end
        say(f"straight to vLLM: {direct.status_code} {direct.text[:200]}")
        assert direct.status_code == 400 or direct.json()["usage"]["prompt_tokens"] - text_tokens > vision_cap

        bounded = proxy.post("/v1/chat/completions", json=_body(huge))
        assert bounded.status_code == 200, bounded.text
        assert bounded.headers["x-vlm-proxy-bound"] == f"mm_processor_kwargs.max_pixels={PIXEL_CAP}"
        cost = bounded.json()["usage"]["prompt_tokens"] - text_tokens
        say(f"through the proxy: {cost} vision tokens (cap {vision_cap})")
        assert 0 < cost <= vision_cap

        served = _prompt_tokens_served(real_stack)
        for body, field in (
                (_body(huge, mm_processor_kwargs={"min_pixels": HUGE * HUGE, "max_pixels": HUGE * HUGE}),
                 "mm_processor_kwargs.min_pixels"),
                (_body(huge, media_io_kwargs={"video": {"num_frames": -1}}), "media_io_kwargs.video.num_frames"),
                (_body(_video([_jpeg(28, 9)] * (FRAME_CAP + 1))), "messages.0.content.0.video_url.url")):
            refused = proxy.post("/v1/chat/completions", json=body)
            assert refused.status_code == 422 and refused.json()["error"]["field"] == field, refused.text
        assert _prompt_tokens_served(real_stack) == served
