"""Each image and video part the proxy sends carries vLLM's `uuid` (backend key `media_uuids`,
on by default): an image's is the sha256 of exactly the JPEG in its data URL, a video's the sha256
over its frames' sha256s in order and the media_io_kwargs.video sent with it. Checked on the bodies
the fake vLLM recorded: a GRPO group's shared first frame gets one uuid, its members' videos each
their own, and one pixel changes the uuid."""

from __future__ import annotations

import base64
import hashlib

import httpx
import numpy as np
import pytest

from proxy.config import settings_from_dict
from proxy.prompting.layouts import video_uuid
from tests.conftest import libero_settings_dict
from tests.fakes.episodes import episode_frames, npy_b64


def _sha256_of_data_url(url: str) -> str:
    return hashlib.sha256(base64.b64decode(url.split(",", 1)[1], validate=True)).hexdigest()


def _frame_sha256s(video_url: str) -> list[str]:
    _, _, payload = video_url.partition(";base64,")
    return [hashlib.sha256(base64.b64decode(piece, validate=True)).hexdigest() for piece in payload.split(",")]


def _check_uuids_are_the_bytes_sent(body: dict) -> list[dict]:
    """Every media part's uuid is the hash of what that part carries; the media parts."""
    media = [p for m in body["messages"] if isinstance(m["content"], list) for p in m["content"]
             if p["type"] in ("image_url", "video_url")]
    assert media
    for part in media:
        if part["type"] == "image_url":
            assert part["uuid"] == _sha256_of_data_url(part["image_url"]["url"])
        else:
            video_io = (body.get("media_io_kwargs") or {}).get("video")
            assert part["uuid"] == video_uuid(_frame_sha256s(part["video_url"]["url"]), video_io)
    return media


def _group(members: int, first: np.ndarray | None = None) -> list[np.ndarray]:
    """GRPO-shaped: one first frame for every member, then each member's own frames."""
    base = episode_frames(12, 112, 112)
    if first is not None:
        base[0] = first
    out = []
    for member in range(members):
        episode = base.copy()
        episode[1:, -8:, -8:] = (member * 37) % 256  # each member's own frames after the first
        out.append(episode)
    return out


def _primo(client: httpx.Client, frames: np.ndarray, **extra) -> dict:
    answer = client.post("/score", json={"task_text": "open the drawer", "backend": "PRIMO-R1",
                                         "frames_npy": npy_b64(frames), **extra})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_groups_shared_first_frame_is_one_uuid_and_each_video_its_own(client, fake_primo):
    results = [_primo(client, episode) for episode in _group(3)]
    bodies = fake_primo.chat_requests[-3:]
    parts = [_check_uuids_are_the_bytes_sent(body) for body in bodies]
    assert all([p["type"] for p in media] == ["image_url", "video_url", "image_url"] for media in parts)
    firsts = {media[0]["uuid"] for media in parts}
    videos = {media[1]["uuid"] for media in parts}
    assert len(firsts) == 1 and len(videos) == 3
    for media, result in zip(parts, results, strict=True):  # the provenance names the same bytes
        assert [media[0]["uuid"], media[2]["uuid"]] == result["frames"]["still_sha256"]
        assert media[1]["uuid"] == video_uuid(result["frames"]["sha256"], bodies[0]["media_io_kwargs"]["video"])


def test_one_pixel_changes_the_uuids(client, fake_primo):
    first = episode_frames(12, 112, 112)[0]
    moved = first.copy()
    moved[60, 60] = 255 - moved[60, 60]  # one pixel of the first frame
    a, b = (_primo(client, _group(1, f)[0]) for f in (first, moved))
    (one, two) = (_check_uuids_are_the_bytes_sent(body) for body in fake_primo.chat_requests[-2:])
    assert a["frames"]["still_sha256"][0] != b["frames"]["still_sha256"][0]  # the JPEGs differ
    assert one[0]["uuid"] != two[0]["uuid"] and one[1]["uuid"] != two[1]["uuid"]
    assert one[2]["uuid"] == two[2]["uuid"]  # the last frame is the same picture


def test_the_video_uuid_changes_with_the_timing_it_is_sent_with(client, fake_qwen):
    frames = npy_b64(episode_frames(8, 64, 64))
    for video_fps in (4.0, 8.0):
        answer = client.post("/score", json={"task_text": "t", "frames_npy": frames, "video_fps": video_fps})
        assert answer.status_code == 200, answer.text
    slow, fast = fake_qwen.chat_requests[-2:]
    assert (slow["media_io_kwargs"]["video"]["fps"], fast["media_io_kwargs"]["video"]["fps"]) == (4.0, 8.0)
    (slow_video,), (fast_video,) = (_check_uuids_are_the_bytes_sent(b) for b in (slow, fast))
    assert slow_video["video_url"] == fast_video["video_url"] and slow_video["uuid"] != fast_video["uuid"]


@pytest.mark.parametrize("backend", ["qwen2_5_vl_vllm", "PRIMO-R1"])
def test_media_uuids_off_sends_the_parts_as_before(proxy_factory, fake_qwen, fake_primo, media_root, backend):
    data = libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root)
    data["backends"][backend]["media_uuids"] = False
    server = proxy_factory(settings_from_dict(data))
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as http:
        answer = http.post("/score", json={"task_text": "t", "backend": backend,
                                           "frames_npy": npy_b64(episode_frames(6, 64, 64))})
    assert answer.status_code == 200, answer.text
    body = (fake_qwen if backend == "qwen2_5_vl_vllm" else fake_primo).chat_requests[-1]
    assert not [p for p in body["messages"][-1]["content"] if "uuid" in p]
