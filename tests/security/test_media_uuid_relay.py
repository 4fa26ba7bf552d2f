"""A scoring-key holder cannot choose what another request's frames mean to the model (issue 28,
review of item 4): vLLM takes a media part's `uuid` as the identity of its features without checking
the data (vllm#55547), and the proxy's own uuids are the JPEGs' sha256 — so the pass-through refuses
any `uuid` in a relayed chat body, however it is spelled, before any replica sees it. A body that
only mentions the word is relayed as before. One proxy and its fakes serve the module."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from proxy.config import settings_from_dict
from tests.conftest import PRIMO_MODEL, QWEN_MODEL, libero_settings_dict
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread
from tests.fakes.proxy_server import ProxyServerThread
from tests.helpers import PRIMO_REPLY, QWEN_REPLY

IMAGE = "data:image/jpeg;base64,/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAEBAQ=="


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[tuple[ProxyServerThread, FakeVLLMThread]]:
    qwen = FakeVLLMThread(FakeConfig(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY)).start()
    primo = FakeVLLMThread(FakeConfig(served_model_name=PRIMO_MODEL, default_text=PRIMO_REPLY)).start()
    proxy = ProxyServerThread(settings_from_dict(libero_settings_dict(
        [qwen.base_url], [primo.base_url], tmp_path_factory.mktemp("media")))).start()
    try:
        yield proxy, qwen
    finally:
        proxy.stop()
        qwen.stop()
        primo.stop()


def _chat(part: dict, text: str = "how far along?") -> dict:
    return {"model": QWEN_MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": text}]}]}


@pytest.mark.parametrize("spelling", ["plain", "escaped", "nested", "null", "deep", "duplicate-key"])
def test_a_media_uuid_is_refused_before_any_replica_sees_it(stack, spelling):
    proxy, qwen = stack
    qwen.fake.reset()
    part = {"type": "image_url", "image_url": {"url": IMAGE}, "uuid": "0" * 64}
    if spelling == "nested":
        part = {"type": "image_url", "image_url": {"url": IMAGE, "uuid": "x"}}
    if spelling == "null":  # no data at all: the cached features of whatever had that uuid
        part = {"type": "image_url", "image_url": None, "uuid": "0" * 64}
    body = json.dumps(_chat(part))
    if spelling == "deep":  # past a JSON parser's nesting limit: refused unread, never relayed unchecked
        body = body[:-1] + ',"extra":' + "[" * 5000 + "]" * 5000 + "}"
    if spelling == "duplicate-key":  # the last of two keys wins, in vLLM's parser too
        body = body.replace('"uuid": "' + "0" * 64 + '"', '"uuid": null, "uuid": "' + "0" * 64 + '"')
    if spelling == "escaped":  # JSON lets a key be written with escapes; vLLM reads it as "uuid"
        body = body.replace('"uuid"', '"\\u0075uid"')
        assert "uuid" not in body
    answer = httpx.post(f"{proxy.url}/v1/chat/completions", content=body,
                        headers={"content-type": "application/json"}, timeout=30, trust_env=False)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["field"] == "messages" if spelling == "deep" else (
        error["field"].startswith("messages.0.content.0") and error["field"].endswith(".uuid"))
    assert "vllm#55547" in error["message"] or "uuids" in error["message"]
    assert qwen.chat_requests == []


def test_the_official_client_gets_the_refusal_and_the_word_alone_goes_through(stack):
    proxy, qwen = stack
    qwen.fake.reset()
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.UnprocessableEntityError):
            client.chat.completions.create(**_chat({"type": "image_url", "image_url": {"url": IMAGE},
                                                    "uuid": "a" * 64}))
        mentioned = client.chat.completions.create(**_chat({"type": "image_url", "image_url": {"url": IMAGE}},
                                                           text='what is a "uuid"? \u00e9'))
    assert mentioned.choices[0].message.content == QWEN_REPLY
    assert len(qwen.chat_requests) == 1


@pytest.mark.parametrize(("part", "field"), [
    ({"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data/"}}, "image_url.url"),
    ({"type": "video_url", "video_url": {"url": "file:///etc/shadow"}}, "video_url.url"),
    ({"type": "image_url", "image_url": "https://internal.example/frame.jpg"}, "image_url"),  # the string form
    ({"type": "image_url", "image_url": {"url": " HTTP://10.0.0.1/x.png"}}, "image_url.url"),
    ({"type": "image_url", "image_url": {"url": "file:/etc/passwd"}}, "image_url.url"),  # no "//" (review)
    ({"type": "image", "image": {"url": "https://internal.example/x.png"}}, "image.url"),  # any part's url
])
def test_a_media_url_vllm_would_fetch_is_refused_before_any_replica_sees_it(stack, part, field):
    # found by review (stop 36): vLLM fetches http(s) media itself, so a scoring key could make the
    # model's hosts request any address they reach; only data: URLs (the media inline) are relayed
    proxy, qwen = stack
    qwen.fake.reset()
    plain = json.dumps(_chat(part))
    # as written, with a \u escape, and with JSON's \/ escape (the fast path saw no "://" in it)
    for body in (plain, plain.replace("://", "\\u003a//"), plain.replace("/", "\\/")):
        answer = httpx.post(f"{proxy.url}/v1/chat/completions", content=body,
                            headers={"content-type": "application/json"}, timeout=30, trust_env=False)
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["field"] == f"messages.0.content.0.{field}" and "only data: URLs" in error["message"], error
    assert qwen.chat_requests == []


def test_a_url_in_the_text_is_relayed_with_inline_media(stack):
    proxy, qwen = stack
    qwen.fake.reset()
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0) as client:
        answer = client.chat.completions.create(**_chat({"type": "image_url", "image_url": {"url": IMAGE}},
                                                        text="as on https://libero-project.github.io, how far?"))
    assert answer.choices[0].message.content == QWEN_REPLY and len(qwen.chat_requests) == 1
