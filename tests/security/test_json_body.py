"""A JSON body cannot hold the event loop (issue 24, item 5): the routes parse with pydantic-core
and refuse, before parsing, a body with more values than any valid request could hold.

On main a 64 MiB array of small numbers was parsed whole with json.loads on the loop (~4 s,
bench/bench_json_body.py) before validation refused it. One proxy serves the module: nothing here
changes its state (each test checks the fakes got nothing)."""

from __future__ import annotations

import base64

import httpx
import pytest

from proxy.config import settings_from_dict
from proxy.http.json_body import max_json_values
from tests.conftest import libero_settings_dict
from tests.fakes.episodes import episode_frames, images_b64

INLINE_FRAMES, BATCH_ITEMS = 8, 2
CAP = max_json_values(INLINE_FRAMES, BATCH_ITEMS)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread
    from tests.fakes.proxy_server import ProxyServerThread

    qwen = FakeVLLMThread(FakeConfig(served_model_name="Qwen2.5-VL-7B-Instruct",
                                     default_text="<score>75</score>")).start()
    primo = FakeVLLMThread(FakeConfig(served_model_name="PRIMO-R1-7B",
                                      default_text="<think>t</think><answer>60</answer>")).start()
    root = tmp_path_factory.mktemp("json-body") / "media"
    settings = settings_from_dict(libero_settings_dict([qwen.base_url], [primo.base_url], root,
                                                       max_inline_frames=INLINE_FRAMES,
                                                       max_batch_items=BATCH_ITEMS, health_interval_s=30))
    proxy = ProxyServerThread(settings).start()
    try:
        with httpx.Client(base_url=proxy.url, timeout=60, trust_env=False) as http:
            yield http, qwen, primo
    finally:
        proxy.stop()
        qwen.stop()
        primo.stop()


def _sent_upstream(qwen, primo) -> int:
    return len(qwen.chat_requests) + len(primo.chat_requests)


def test_a_body_of_more_values_than_any_request_is_refused_before_it_is_parsed(stack):
    http, qwen, primo = stack
    values = 600_000  # ~1.2 MB of "0,", far over the cap of this config
    assert values > CAP
    before = _sent_upstream(qwen, primo)
    body = b'{"task_text": "t", "frames": [' + b"0," * values + b'0]}'
    answer = http.post("/score", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 413, answer.text
    error = answer.json()["error"]
    assert error["code"] == "payload_too_large"
    assert str(CAP) in error["message"]
    assert _sent_upstream(qwen, primo) == before
    assert http.get("/health").status_code == 200


def test_a_body_under_the_value_cap_is_parsed_and_validated_as_before(stack):
    http, qwen, primo = stack
    frames = images_b64(episode_frames(4, 28, 28))
    padding = base64.b64encode(b"x" * 1_200_000).decode()  # over 1 MiB: the value count is taken
    answer = http.post("/score", json={"task_text": "t", "frames": frames, "nframes": 4,
                                       "metadata": {"note": padding}})
    # metadata values are capped in length by the schema: a field error, not a body-size one.
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "invalid_request"
    answer = http.post("/score", json={"task_text": "t", "frames": frames, "nframes": 4})
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize(("body", "what"), [
    (b'{"task_text": "t", "frames": ["\xff"]}', "invalid UTF-8"),
    (b'{"task_text": "t", "frames": [', "cut JSON"),
    (b"not json", "not JSON"),
])
def test_bad_json_is_a_422_naming_the_body(stack, body, what):
    http, qwen, primo = stack
    before = _sent_upstream(qwen, primo)
    answer = http.post("/score", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 422, (what, answer.text)
    assert answer.json()["error"]["code"] == "invalid_request", what
    assert _sent_upstream(qwen, primo) == before


def test_a_utf8_bom_is_read_as_json_loads_reads_it(stack):
    http, _, _ = stack
    frames = images_b64(episode_frames(2, 28, 28))
    body = b"\xef\xbb\xbf" + httpx.Request("POST", "/", json={"task_text": "t", "frames": frames}).content
    answer = http.post("/score", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 200, answer.text
