"""frame_encoding: auto — the client sends its picked frames as JPEGs already at the size the proxy
sends them (and PRIMO-R1's two stills), made by the proxy's own rules (GET /frame-rules), and the
proxy forwards them untouched. Against the real proxy and fake vLLMs: vLLM receives exactly the bytes
the raw path makes; frames encoded for rules the proxy no longer has are refused (409) and the
client sends that episode raw, never a frame of another size; an older proxy, no OpenCV, or an
answer it cannot read all mean raw frames. One proxy and two fakes serve the module (the fakes are
reset between tests); the tests that need another proxy configuration say so.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import logging
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from proxy.config import settings_from_dict
from rlinf_client import AsyncRewardClient, Episode, RewardClient
from rlinf_client import _frame_rules as frame_rules_module
from tests.client._support import FakeProxy, score_body
from tests.conftest import PRIMO_MODEL, QWEN_MODEL, libero_settings_dict
from tests.fakes.episodes import episode_frames, images_b64
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread, decode_video_part
from tests.fakes.proxy_server import ProxyServerThread
from tests.helpers import PRIMO_REPLY, QWEN_REPLY
from vlm_protocol.frame_rules import FrameRules

QWEN, PRIMO = "qwen2_5_vl_vllm", "PRIMO-R1"
TASK = "put the black bowl on the plate"


@dataclasses.dataclass
class Stack:
    proxy: ProxyServerThread
    fakes: dict[str, FakeVLLMThread]
    http: httpx.Client

    def cfg(self, backend: str, **overrides) -> dict:
        return {"enable": True, "endpoint": f"{self.proxy.url}/score", "backend": backend, "timeout": 30,
                "batch": "never", **overrides}

    def upstream(self, backend: str) -> list[dict]:
        return self.fakes[backend].chat_requests


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    media = tmp_path_factory.mktemp("media")
    fakes = {QWEN: FakeVLLMThread(FakeConfig(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY)).start(),
             PRIMO: FakeVLLMThread(FakeConfig(served_model_name=PRIMO_MODEL, default_text=PRIMO_REPLY)).start()}
    proxy = ProxyServerThread(settings_from_dict(libero_settings_dict(
        [fakes[QWEN].base_url], [fakes[PRIMO].base_url], media))).start()
    http = httpx.Client(base_url=proxy.url, timeout=30, trust_env=False)
    try:
        yield Stack(proxy, fakes, http)
    finally:
        http.close()
        proxy.stop()
        for fake in fakes.values():
            fake.stop()


@pytest.fixture(autouse=True)
def _fresh_fakes(stack: Stack) -> None:
    for fake in stack.fakes.values():
        fake.fake.reset()


def images_sent(body: dict) -> tuple[list[bytes], list[bytes]]:
    """(the video's frames, the still images) of one upstream chat request, as bytes."""
    frames, stills = [], []
    for message in body["messages"]:
        for part in message["content"] if isinstance(message["content"], list) else []:
            if part.get("type") == "video_url":
                frames = decode_video_part(part["video_url"]["url"], num_frames=-1)
            elif part.get("type") == "image_url":
                stills.append(base64.b64decode(part["image_url"]["url"].partition(";base64,")[2]))
    return frames, stills


def score(stack: Stack, backend: str, frames: np.ndarray, **overrides) -> dict:
    with RewardClient(stack.cfg(backend, **overrides)) as client:
        result = client.score_episode(frames, TASK)
    assert result.ok, result.error
    return result.response


# -- the same pixels, without the proxy's media work ---------------------------------------------
@pytest.mark.parametrize("backend", [QWEN, PRIMO])
@pytest.mark.parametrize("transport", ["binary", "inline"])
@pytest.mark.parametrize("shape", [(256, 256), (200, 320), (480, 640)], ids=["libero", "upscaled", "downscaled"])
def test_vllm_gets_the_bytes_the_raw_path_makes_and_the_proxy_decodes_nothing(stack, backend, transport, shape):
    frames = episode_frames(90, *shape)
    raw = score(stack, backend, frames, transport=transport, frame_encoding="raw")
    [raw_body] = stack.upstream(backend)
    stack.fakes[backend].fake.reset()
    ready = score(stack, backend, frames, transport=transport)
    [ready_body] = stack.upstream(backend)
    assert images_sent(ready_body) == images_sent(raw_body)  # byte for byte: the same JPEGs
    assert ready_body["messages"] == raw_body["messages"]  # and the same prompt around them
    stills = 2 if backend == PRIMO else 0
    assert raw["frames"]["forwarded"] == 0
    assert ready["frames"]["forwarded"] == ready["frames"]["count"] + stills == 16 + stills
    for key in ("count", "indices", "source_count", "size", "still_size", "sha256", "still_sha256", "fps",
                "sampled_fps", "vision_tokens"):
        assert ready["frames"][key] == raw["frames"][key], key


def test_frame_rules_name_every_chat_backend_with_the_labels_a_request_may_use(stack):
    answer = stack.http.get("/frame-rules")
    assert answer.status_code == 200
    body = answer.json()
    assert body["default"] == QWEN and set(body["backends"]) == {QWEN, PRIMO}
    primo = body["backends"][PRIMO]
    assert {PRIMO, PRIMO_MODEL, "primo_r1_vllm"} <= set(primo["labels"])
    rules = FrameRules.from_dict(primo)
    assert (rules.stills, rules.nframes, rules.max_pixels, rules.jpeg_quality) == (True, 16, 200704, 90)
    assert FrameRules.from_dict(body["backends"][QWEN]).stills is False
    # the id covers every setting that changes a sent frame
    for change in ({"max_pixels": 100352}, {"jpeg_quality": 80}, {"stills": False}, {"max_nframes": 22}):
        assert dataclasses.replace(rules, **change).rules_id != rules.rules_id, change
    with pytest.raises(ValueError, match="id does not match"):
        FrameRules.from_dict({**primo, "jpeg_quality": 50})


def test_an_alias_finds_its_backends_rules(stack):
    """The client's `backend` may be an alias or the served model name: the rules are that backend's."""
    response = score(stack, "primo_r1_vllm", episode_frames(40, 256, 256))
    assert response["backend"] == PRIMO and response["frames"]["forwarded"] == 18


# -- the proxy still checks ----------------------------------------------------------------------
def _ready_request(stack: Stack, backend: str, **fields) -> dict:
    rules = FrameRules.from_dict(stack.http.get("/frame-rules").json()["backends"][backend])
    frames = episode_frames(16, 336, 336)
    return {"task_text": TASK, "backend": backend, "frames": images_b64(frames, ".jpg"),
            "frame_rules": rules.rules_id, **fields}


def test_frames_encoded_for_other_rules_are_refused_naming_the_current_ones(stack):
    request = _ready_request(stack, QWEN)
    current = request["frame_rules"]
    answer = stack.http.post("/score", json={**request, "frame_rules": "0123456789abcdef"})
    assert answer.status_code == 409
    error = answer.json()["error"]
    assert (error["code"], error["retryable"], error["current"], error["field"]) == (
        "frame_rules_changed", False, current, "frame_rules")
    assert stack.upstream(QWEN) == []  # nothing was scored
    assert stack.http.post("/score", json=request).status_code == 200


@pytest.mark.parametrize("backend, fields, words", [
    (QWEN, {}, "sends no still images"),
    (PRIMO, {"prefix_end": 5}, "cannot go with prefix_end"),
])
def test_stills_where_they_cannot_apply_are_a_clear_422(stack, backend, fields, words):
    stills = images_b64(episode_frames(2, 252, 252), ".jpg")
    answer = stack.http.post("/score", json={**_ready_request(stack, backend), "stills": stills, **fields})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["field"] == "stills" and words in answer.json()["error"]["message"]


@pytest.mark.parametrize("source", ["video_path", "frames_npy"])
def test_stills_come_only_with_frames(stack, source):
    request = {"task_text": TASK, "backend": PRIMO, source: "x", "stills": images_b64(episode_frames(2, 8, 8), ".png")}
    answer = stack.http.post("/score", json=request)
    assert answer.status_code == 422 and "stills come with frames" in answer.text


def test_frames_for_a_stills_layout_come_with_their_stills(stack):
    """Without them the proxy would make stills from the 336x336 frames: 336x336 instead of the raw
    path's 252x252 — refused instead."""
    answer = stack.http.post("/score", json=_ready_request(stack, PRIMO))
    assert answer.status_code == 422 and answer.json()["error"]["field"] == "stills", answer.text
    assert stack.upstream(PRIMO) == []


def test_frames_said_to_be_ready_that_need_a_resize_are_refused_not_resized_twice(stack):
    frames = images_b64(episode_frames(16, 256, 256), ".jpg")  # LIBERO's raw size, not the rule's 336x336
    answer = stack.http.post("/score", json={**_ready_request(stack, QWEN), "frames": frames})
    assert answer.status_code == 422 and answer.json()["error"]["field"] == "frames", answer.text
    assert "16 were not" in answer.json()["error"]["message"] and stack.upstream(QWEN) == []


@pytest.mark.parametrize("backend", [QWEN, PRIMO])
def test_a_budget_below_the_video_floor_goes_raw(stack, backend):
    """max_pixels 50000 sizes 256x256 frames to 196x196, which the proxy's rule would size again (to the
    floor): the client sends raw frames, and vLLM gets what the raw path makes."""
    frames = episode_frames(40, 256, 256)
    raw = score(stack, backend, frames, frame_encoding="raw", max_pixels=50000)
    ready = score(stack, backend, frames, max_pixels=50000)
    assert ready["frames"]["forwarded"] == 0
    assert [ready["frames"][k] for k in ("size", "still_size", "sha256")] == [
        raw["frames"][k] for k in ("size", "still_size", "sha256")]


def test_dense_curves_take_no_stills(stack):
    answer = stack.http.post("/score/dense", json={**_ready_request(stack, PRIMO), "points": 2,
                                                    "stills": images_b64(episode_frames(2, 252, 252), ".jpg")})
    assert answer.status_code == 422 and "send no stills" in answer.text


def test_stills_off_the_image_rule_are_brought_to_it_never_forwarded_at_another_size(stack):
    """A caller's stills at 400x400 (the image rule gives 392x392 under max_pixels), sent without
    frame_rules: decoded and resized here, so vLLM gets a size the rule makes; the frames, at their
    rule's size, still go as sent. With frame_rules the same request is refused (the caller's bug)."""
    stills = images_b64(episode_frames(2, 400, 400), ".jpg")
    request = {**_ready_request(stack, PRIMO), "stills": stills}
    del request["frame_rules"]  # a caller that does not claim its frames ready (with the claim: a 422)
    answer = stack.http.post("/score", json=request)
    assert answer.status_code == 200, answer.text
    frames = answer.json()["frames"]
    assert frames["still_size"] == [392, 392] and frames["forwarded"] == 16
    _, sent = images_sent(stack.upstream(PRIMO)[-1])
    assert [hashlib.sha256(s).hexdigest() for s in sent] == frames["still_sha256"]
    assert all(s != base64.b64decode(b) for s, b in zip(sent, stills, strict=True))
    claimed = stack.http.post("/score", json={**request, "frame_rules": _ready_request(stack, PRIMO)["frame_rules"]})
    assert claimed.status_code == 422 and "2 were not" in claimed.json()["error"]["message"]


def test_stills_of_two_sizes_are_refused(stack):
    stills = [*images_b64(episode_frames(1, 252, 252), ".jpg"), *images_b64(episode_frames(1, 224, 224), ".jpg")]
    answer = stack.http.post("/score", json={**_ready_request(stack, PRIMO), "stills": stills})
    assert answer.status_code == 422 and answer.json()["error"]["field"] == "stills"


# -- when the rules change, or cannot be had -----------------------------------------------------
@pytest.mark.parametrize("batch", ["never", "auto"])
async def test_after_the_rules_change_the_episode_goes_again_raw_and_the_rules_are_fetched_again(
        stack, batch, caplog):
    """The client holds rules the proxy no longer has (as after a proxy restart with another
    max_pixels): the proxy refuses those frames with 409 before any vLLM call, the client sends the
    same episodes as raw frames (their scores count, nothing falls back), and asks for the rules again."""
    episodes = [Episode(episode_frames(40 + i, 256, 256), f"{TASK} {i}", 0.0) for i in range(3)]
    async with AsyncRewardClient(stack.cfg(PRIMO, batch=batch)) as client:
        cache = client._scheduler.frame_rules
        held = await cache.get()
        cache.rules = dataclasses.replace(held, jpeg_quality=held.jpeg_quality - 10)  # the proxy's old rules
        with caplog.at_level(logging.WARNING, "rlinf_client"):
            first = await client.score_episodes(episodes)
        assert all(r.ok for r in first), [r.error for r in first]
        forwarded = [r.response["frames"]["forwarded"] for r in first]
        # raw (made by the proxy) for what was built under the old rules, the first episode at least;
        # an episode built after the refusal may have the current rules already
        assert forwarded[0] == 0 and set(forwarded) <= {0, 18}, forwarded
        assert cache.rules in (None, held)
        assert "frame rules for backend PRIMO-R1 changed" in caplog.text
        again = await client.score_episodes(episodes[:1])
        assert again[0].response["frames"]["forwarded"] == 18 and cache.rules == held
    # the episodes sent again raw picked the frames the refused bodies picked (a reward never depends
    # on whether its body met a 409): the same source indices as the ready body of the same episode
    assert first[0].response["frames"]["indices"] == again[0].response["frames"]["indices"]
    assert len(stack.upstream(PRIMO)) == 4  # each episode scored once: the refusals cost no vLLM call


def test_a_proxy_without_the_route_gets_raw_frames(caplog):
    fake = FakeProxy(score_fn=lambda body, frames: 0.7)
    with caplog.at_level(logging.INFO, "rlinf_client"), \
            RewardClient(endpoint="http://proxy.test/score", http_transport=fake.transport()) as client:
        results = client.score_episodes([(episode_frames(20, 64, 64), "t")] * 3)
    assert [r.value for r in results] == [0.7] * 3
    assert all("frames_npy" in body and "frames" not in body for body in fake.score_requests)
    assert fake.frame_rules_asked == 1  # asked once for the client's life
    assert "has no /frame-rules" in caplog.text


@pytest.mark.parametrize("answer", [{"default": "a", "backends": {"a": {"format": 99}}}, {"unexpected": True}],
                         ids=["another-format", "another-shape"])
def test_rules_it_cannot_read_mean_raw_frames(answer, caplog):
    fake = FakeProxy(score_fn=lambda body, frames: 0.7, frame_rules=answer)
    with caplog.at_level(logging.INFO, "rlinf_client"), \
            RewardClient(endpoint="http://proxy.test/score", http_transport=fake.transport()) as client:
        result = client.score_episode(episode_frames(20, 64, 64), "t")
    assert result.ok and "frames_npy" in fake.score_requests[0]
    assert "frame rules" in caplog.text


def test_without_opencv_the_client_sends_raw_frames(stack, monkeypatch):
    monkeypatch.setattr(frame_rules_module.frame_codec, "available", lambda: False)
    response = score(stack, QWEN, episode_frames(30, 256, 256))
    assert response["frames"]["forwarded"] == 0


@pytest.mark.parametrize("overrides", [{"frame_encoding": "raw"}, {"client_sampling": False},
                                       {"transport": "path"}, {"dense_points": 3, "binary_reward": False}],
                         ids=["raw", "proxy-sampling", "path", "dense"])
def test_what_the_proxy_must_pick_or_read_itself_goes_raw(overrides, tmp_path):
    """A curve's prefixes and proxy-side sampling pick frames there; a path is an MP4: none asks for rules."""
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/score/dense":
            return httpx.Response(200, json={**score_body(0.5), "source_count": 16, "curve": [
                {"frame_index": 8, "score": 0.2, "raw_score": 20}, {"frame_index": 15, "score": 0.5, "raw_score": 50}]})
        return httpx.Response(200, json=score_body(0.5))

    cfg = {"temp_video_dir": str(tmp_path), "buffer_frames": 0, **overrides}
    with RewardClient(endpoint="http://proxy.test/score", http_transport=httpx.MockTransport(handle),
                      **cfg) as client:
        assert client.score_episode(episode_frames(16, 64, 64), "t").ok
    assert "/frame-rules" not in seen

