"""Issue 39, item 4: a pass-through request stays within the backend's caps. vLLM decodes a `data:`
video whole (the launchers' `--media-io-kwargs num_frames -1`) and takes per-request processor sizes
(`--trust-request-mm-kwargs`), so a relayed body with a longer frame list than the backend's frame
cap, a video container, or sizes and frame counts past the caps is a 422 naming the field before any
replica sees it; a body with media and no `max_pixels` is sent with the cap added, and the answer
says so. The real vLLM's token counts are tests/real_vllm/test_passthrough_caps.py."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import pytest

from proxy.config import settings_from_dict
from tests.conftest import PRIMO_MODEL, QWEN_MODEL, libero_settings_dict
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread
from tests.fakes.proxy_server import ProxyServerThread
from tests.helpers import PRIMO_REPLY, QWEN_REPLY

FRAME_CAP, PIXEL_CAP = 8, 200_704  # the test's proxy.nframes_limit; frames.video_max_pixels below the pixel limit
JPEG = base64.b64encode(b"\xff\xd8\xff\xe0 a frame").decode()
IMAGE = "data:image/jpeg;base64," + JPEG


def _video(frames: int, kind: str = "video/jpeg") -> dict:
    return {"type": "video_url", "video_url": {"url": f"data:{kind};base64," + ",".join([JPEG] * frames)}}


def _chat(*parts: dict, **fields) -> dict:
    return {"model": QWEN_MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "how far along?"}]}], **fields}


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[tuple[ProxyServerThread, FakeVLLMThread]]:
    qwen = FakeVLLMThread(FakeConfig(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY)).start()
    primo = FakeVLLMThread(FakeConfig(served_model_name=PRIMO_MODEL, default_text=PRIMO_REPLY)).start()
    data = libero_settings_dict([qwen.base_url], [primo.base_url], tmp_path_factory.mktemp("media"),
                                nframes_limit=FRAME_CAP)
    data["backends"]["qwen2_5_vl_vllm"]["frames"]["video_max_pixels"] = PIXEL_CAP
    proxy = ProxyServerThread(settings_from_dict(data)).start()
    try:
        yield proxy, qwen
    finally:
        proxy.stop()
        qwen.stop()
        primo.stop()


def _post(proxy: ProxyServerThread, body: dict) -> httpx.Response:
    return httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30, trust_env=False)


@pytest.mark.parametrize(("body", "field", "says"), [
    (_chat(_video(FRAME_CAP + 1)), "messages.0.content.0.video_url.url", f"over the backend's cap of {FRAME_CAP}"),
    (_chat({"type": "video_url", "video_url": "data:video/jpeg;base64," + ",".join([JPEG] * 40)}),
     "messages.0.content.0.video_url", "40 frames"),
    (_chat(_video(2, "video/mp4")), "messages.0.content.0.video_url.url", "frame list"),
    (_chat(_video(2, "image/jpeg")), "messages.0.content.0.video_url.url", "frame list"),  # decoded as a container
    (_chat(_video(2), mm_processor_kwargs={"min_pixels": 4096 * 4096, "max_pixels": 4096 * 4096}),
     "mm_processor_kwargs.min_pixels", f"cap of {PIXEL_CAP}"),
    (_chat(_video(2), mm_processor_kwargs={"size": {"longest_edge": 4096 * 4096}}), "mm_processor_kwargs.size",
     "only max_pixels"),
    (_chat(_video(2), mm_processor_kwargs={"min_pixels": 784}), "mm_processor_kwargs.max_pixels", "required"),
    (_chat(_video(2), mm_processor_kwargs={"max_pixels": True}), "mm_processor_kwargs.max_pixels", "integer"),
    (_chat(_video(2), mm_processor_kwargs=None), "mm_processor_kwargs", "object"),
    (_chat(_video(2), media_io_kwargs={"video": {"num_frames": -1}}), "media_io_kwargs.video.num_frames",
     f"cap of {FRAME_CAP}"),
    (_chat(_video(2), media_io_kwargs={"video": {"num_frames": 2, "fps": 0}}), "media_io_kwargs.video.fps",
     "positive"),
    (_chat(_video(2), media_io_kwargs={"video": {"frames_indices": [0, 1]}}),
     "media_io_kwargs.video.frames_indices", "only num_frames"),
    (_chat(_video(2), media_io_kwargs={"image": {}}), "media_io_kwargs.image", "only media_io_kwargs.video"),
])
def test_a_request_past_the_caps_is_refused_before_any_replica(stack, body, field, says):
    proxy, qwen = stack
    qwen.fake.reset()
    answer = _post(proxy, body)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["field"] == field and says in error["message"], error
    assert qwen.fake.chat_requests == []


def test_media_without_a_size_is_sent_with_the_cap_and_the_answer_says_so(stack):
    proxy, qwen = stack
    qwen.fake.reset()
    for body in (_chat(_video(FRAME_CAP)), _chat({"type": "image_url", "image_url": {"url": IMAGE}})):
        answer = _post(proxy, body)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-vlm-proxy-bound"] == f"mm_processor_kwargs.max_pixels={PIXEL_CAP}"
    assert [r["mm_processor_kwargs"] for r in qwen.fake.chat_requests] == [{"max_pixels": PIXEL_CAP}] * 2
    assert 'vlm_proxy_relay_bounded_total{backend="qwen2_5_vl_vllm"} 2.0' in httpx.get(
        proxy.url + "/metrics", trust_env=False).text


def test_requests_within_the_caps_go_as_they_were(stack):
    proxy, qwen = stack
    qwen.fake.reset()
    within = _chat(_video(FRAME_CAP), mm_processor_kwargs={"max_pixels": PIXEL_CAP, "min_pixels": 784},
                   media_io_kwargs={"video": {"num_frames": FRAME_CAP, "fps": 4}})
    text_only = {"model": QWEN_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}
    for body in (within, text_only):
        answer = _post(proxy, body)
        assert answer.status_code == 200 and "x-vlm-proxy-bound" not in answer.headers
    assert qwen.fake.chat_requests == [within, text_only]
