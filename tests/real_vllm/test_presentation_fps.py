"""The presentation fps reaches the model. The shipped backends present the clip at the request's
`video_fps` (frames.presentation_fps "seed"), which the proxy sends as media_io_kwargs.video.fps;
Qwen2.5-VL places the video's frames in time with it (temporal position ids, and with them every
later position). So the same episode at two rates gives two replies with the same prompt token
count, and the same rate gives the same reply again (temperature 0, a fixed seed).

The tiny model is a weak sensor: its random weights give almost uniform next-token distributions
(top logprob ~ -6.05 of a 768-token vocabulary), and a rate changes the logits by ~1e-3, so the
greedy reply only parts after ~160 tokens (measured here: at character 507 of 810 at 256 tokens).
Hence:
* /score through `qwen_one_ask` (the shipped Qwen backend with one ask, so the audit line holds
  the temperature-0 reply) with backend_kwargs max_tokens 512;
* the same video through the proxy's /v1/chat/completions with logprobs: the first token's
  logprobs move with the rate, and repeat (to float noise) at the same rate.
The shipped Qwen backend constrains its reply to the 0-100 scale (a few tokens whatever the
rate): the token count and the fps the proxy reports are checked for it, not the text.
Requests run one at a time (no batching between them).
"""

from __future__ import annotations

import base64

import cv2
import pytest

from tests.fakes.episodes import episode_frames
from tests.real_vllm.stack import QWEN, QWEN_MODEL, QWEN_ONE_ASK, TASK, RealStack, episode_source, say

pytestmark = pytest.mark.real_vllm

SLOW, FAST = 1.0, 8.0
MAX_TOKENS = 512


def _score_runs(stack: RealStack, http, backend: str, backend_kwargs: dict) -> dict[str, dict]:
    source = episode_source("npy", 16, 224, 224, stack.media_root)
    records = {}
    for label, fps in (("slow", SLOW), ("fast", FAST), ("slow-again", SLOW)):
        run = f"fps-{backend}-{label}"
        answer = http.post("/score", json={"task_text": TASK, "backend": backend, "nframes": 16, "video_fps": fps,
                                           "backend_kwargs": backend_kwargs, "metadata": {"run": run}, **source})
        assert answer.status_code in (200, 502), answer.text
        if answer.status_code == 502:
            assert answer.json()["error"]["code"] == "unparseable_score", answer.text
        records[label] = stack.audit.one(run)
    for label, record in records.items():
        say(f"{backend} {label}: fps {record['frames']['fps']}, prompt_tokens {record['usage']['prompt_tokens']}, "
            f"completion_tokens {record['usage']['completion_tokens']}, T={record['sampling']['temperature']} "
            f"seed={record['sampling']['seed']}, reply[:40] {record['output_text'][:40]!r}")
    assert [r["frames"]["fps"] for r in records.values()] == [SLOW, FAST, SLOW]
    tokens = {label: r["usage"]["prompt_tokens"] for label, r in records.items()}
    assert len(set(tokens.values())) == 1, f"fps changed the token count: {tokens}"
    return records


def test_score_reply_follows_video_fps_at_temperature_0(real_stack: RealStack, http) -> None:
    # unconstrained: the shipped constraint holds the reply to 0-100, too short to part at this scale
    records = _score_runs(real_stack, http, QWEN_ONE_ASK, {"max_tokens": MAX_TOKENS, "constrain": False})
    assert {(r["sampling"]["temperature"], r["sampling"]["seed"], r["asks"]) for r in records.values()} == {(0.0, 0, 1)}
    slow, fast, again = (records[k]["output_text"] for k in ("slow", "fast", "slow-again"))
    parted = next((i for i, (a, b) in enumerate(zip(slow, fast, strict=False)) if a != b), None)
    say(f"greedy replies at fps {SLOW} and {FAST} part at character {parted} of {len(slow)}")
    assert slow == again, "the same request (same fps) gave two greedy replies"
    assert slow != fast, f"video_fps {SLOW} and {FAST} gave the same {len(slow)}-character greedy reply"


def test_shipped_backend_reports_the_rate_with_one_token_count(real_stack: RealStack, http) -> None:
    records = _score_runs(real_stack, http, QWEN, {})
    assert records["slow"]["output_text"] == records["slow-again"]["output_text"]


def test_logprobs_move_with_the_rate_through_the_proxy(real_stack: RealStack, http) -> None:
    jpegs = [base64.b64encode(cv2.imencode(".jpg", cv2.cvtColor(f, cv2.COLOR_RGB2BGR))[1].tobytes()).decode()
             for f in episode_frames(16, 336, 336)]
    content = [{"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + ",".join(jpegs)}},
               {"type": "text", "text": "How far along is the task, in percent?"}]

    def first_token_logprobs(fps: float) -> dict[str, float]:
        answer = http.post("/v1/chat/completions", json={
            "model": QWEN_MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1,
            "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "seed": 0,
            "logprobs": True, "top_logprobs": 5, "media_io_kwargs": {"video": {"num_frames": 16, "fps": fps}}})
        assert answer.status_code == 200, answer.text
        top = answer.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        return {t["token"]: t["logprob"] for t in top}

    slow, fast, again = first_token_logprobs(SLOW), first_token_logprobs(FAST), first_token_logprobs(SLOW)
    shared = sorted(set(slow) & set(fast) & set(again))
    moved = max(abs(slow[t] - fast[t]) for t in shared)
    noise = max(abs(slow[t] - again[t]) for t in shared)
    say(f"first-token logprobs: fps {SLOW} vs {FAST} differ by up to {moved:.2e}; "
        f"fps {SLOW} twice by up to {noise:.2e} (tokens {shared})")
    assert shared, (slow, fast)
    assert moved > 1e-4 and moved > 20 * noise, (slow, fast, again)
