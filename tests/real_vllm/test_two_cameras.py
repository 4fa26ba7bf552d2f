"""Two cameras on the real server: what each placement of a second view costs in vision tokens.

One LIBERO-sized episode (16 frames of 256x256, the agent view and a wrist view) is scored three
ways on the Qwen replicas: one camera (qwen_one_ask), the wrist view as a second video
(qwen_two_videos), and the two views side by side in each frame at half the pixel budget each
(qwen_side_by_side). For each, usage.prompt_tokens from vLLM must equal the template's text tokens
(POST /tokenize of the same messages without media) plus the Qwen2.5-VL rule over what the proxy
reports it sent: both cameras counted. The costs go to `<run dir>/two_cameras.json`.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from tests.fakes.episodes import episode_frames, npy_b64
from tests.real_vllm.stack import (
    QWEN,
    QWEN_MODEL,
    QWEN_ONE_ASK,
    QWEN_SIDE_BY_SIDE,
    QWEN_TWO_VIDEOS,
    TASK,
    RealStack,
    say,
    text_only_messages,
)
from vlm_protocol.frames import vision_tokens

pytestmark = pytest.mark.real_vllm

COUNT, SIZE = 16, 256  # LIBERO's agentview and wrist cameras are 256x256 (RLinf's LiberoEnv)


def _wrist() -> np.ndarray:
    frames = np.zeros((COUNT, SIZE, SIZE, 3), dtype=np.uint8)
    frames[..., 2] = np.linspace(230, 30, COUNT, dtype=np.uint8)[:, None, None]
    return frames


def test_each_placement_costs_what_the_proxy_says_on_the_real_server(real_stack: RealStack) -> None:
    main = npy_b64(episode_frames(COUNT, SIZE, SIZE))
    with httpx.Client(timeout=120, trust_env=False) as http:
        tokenized = http.post(f"{real_stack.server_url('qwen_r0')}/tokenize",
                              json={"model": QWEN_MODEL, "messages": text_only_messages(QWEN)})
        assert tokenized.status_code == 200, tokenized.text
        text = tokenized.json()["count"]
    rows = {}
    with httpx.Client(base_url=real_stack.proxy_url, timeout=600, trust_env=False) as http:
        for backend in (QWEN_ONE_ASK, QWEN_TWO_VIDEOS, QWEN_SIDE_BY_SIDE):
            run = f"two-cameras-{backend}"
            body = {"task_text": TASK, "backend": backend, "frames_npy": main, "metadata": {"run": run}}
            if backend != QWEN_ONE_ASK:
                body["extra_view"] = {"frames_npy": npy_b64(_wrist())}
            answer = http.post("/score", json=body)
            assert answer.status_code in (200, 502), answer.text  # random weights: a score or unparseable
            record = real_stack.audit.one(run)
            frames, usage = record["frames"], record["usage"]
            width, height = frames["size"]
            video = vision_tokens(height, width, frames["count"], video=True)
            extra = frames.get("extra_view")
            if backend == QWEN_TWO_VIDEOS:
                ew, eh = extra["size"]
                assert (ew, eh) == (width, height) and len(extra["sha256"]) == frames["count"]
                expected_vision = video + vision_tokens(eh, ew, frames["count"], video=True)
            else:
                expected_vision = video
            if backend == QWEN_SIDE_BY_SIDE:
                (mw, mh), (ew, eh) = extra["main_size"], extra["size"]
                assert mh == eh == height and mw + ew == width, frames
            assert frames["vision_tokens"] == expected_vision, (backend, frames)
            assert usage["prompt_tokens"] == text + expected_vision, (backend, usage, text, expected_vision)
            rows[backend] = {"size": f"{width}x{height}", "frames": frames["count"], "text_tokens": text,
                             "vision_tokens": expected_vision, "prompt_tokens": usage["prompt_tokens"],
                             "upstream_ms": record["timings_ms"]["upstream"] if "timings_ms" in record else None}
    one = rows[QWEN_ONE_ASK]["vision_tokens"]
    for row in rows.values():
        row["vision_vs_one_camera"] = round(row["vision_tokens"] / one, 3)
    assert rows[QWEN_TWO_VIDEOS]["vision_vs_one_camera"] == 2.0
    assert rows[QWEN_SIDE_BY_SIDE]["vision_vs_one_camera"] < 1.5  # half the budget per view
    say("two cameras, vision tokens per 16-frame 256x256 episode: " + json.dumps(rows))
    (real_stack.run_dir / "two_cameras.json").write_text(json.dumps(rows, indent=1))
