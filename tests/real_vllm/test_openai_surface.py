"""The proxy's OpenAI surface on real servers, through the official `openai` client (no retries of
its own): /v1/models lists every backend name, served name and alias; /v1/chat/completions is
routed by `model` (an alias is rewritten to the served name) and streams chunk by chunk; the
streamed text equals the non-streamed reply at temperature 0 with the same seed."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import cv2
import httpx
import openai
import pytest

from tests.fakes.episodes import episode_frames
from tests.real_vllm.stack import PRIMO, PRIMO_MODEL, QWEN, QWEN_MODEL, RealStack, say

pytestmark = pytest.mark.real_vllm

NFRAMES = 8


@pytest.fixture
def client(real_stack: RealStack) -> Iterator[openai.OpenAI]:
    with httpx.Client(trust_env=False, timeout=120) as http, \
            openai.OpenAI(base_url=f"{real_stack.proxy_url}/v1", api_key="unused", max_retries=0,
                          http_client=http) as oai:
        yield oai


def _request(model: str) -> dict:
    jpegs = [base64.b64encode(cv2.imencode(".jpg", cv2.cvtColor(f, cv2.COLOR_RGB2BGR))[1].tobytes()).decode()
             for f in episode_frames(NFRAMES, 224, 224)]
    content = [{"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + ",".join(jpegs)}},
               {"type": "text", "text": "How far along is the task, in percent?"}]
    # Every sampling field explicit (the checkpoint's generation_config.json fills omitted ones).
    return {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0.0,
            "top_p": 1.0, "seed": 0, "max_tokens": 24, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "extra_body": {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                           "media_io_kwargs": {"video": {"num_frames": NFRAMES, "fps": 4.0}}}}


def test_models_lists_every_name(client: openai.OpenAI) -> None:
    ids = {m.id for m in client.models.list().data}
    assert {QWEN, QWEN_MODEL, PRIMO, PRIMO_MODEL, "primo_r1_vllm"} <= ids, ids


@pytest.mark.parametrize("model", [QWEN_MODEL, "primo_r1_vllm"])
def test_stream_equals_the_whole_reply(client: openai.OpenAI, model: str) -> None:
    request = _request(model)
    whole = client.chat.completions.create(**request)
    served = PRIMO_MODEL if model == "primo_r1_vllm" else model
    assert whole.model == served, whole.model
    text = whole.choices[0].message.content
    assert text, whole
    assert whole.usage.prompt_tokens > NFRAMES // 2 * 64, whole.usage  # the video reached the model

    chunks = []
    with client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request) as stream:
        for chunk in stream:
            chunks.append(chunk)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    pieces = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    say(f"{model}: {len(chunks)} chunks ({pieces} with text); whole {text[:50]!r}; streamed {streamed[:50]!r}")
    # A stream of events (role, text, finish, usage), relayed as they come; how many TEXT pieces
    # there are is timing: vLLM coalesces tokens when it runs ahead of the reader (seen: 1 to 23
    # pieces for the same 24-token reply), so only "more than one event" is asserted.
    assert len(chunks) > 1 and pieces >= 1, f"{len(chunks)} event(s), {pieces} with text"
    assert streamed == text
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason], finish
