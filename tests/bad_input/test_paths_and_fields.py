"""Bad paths and fields against a proxy built per test (for settings the shared one lacks): a clear
4xx naming the problem; nothing outside the media roots is read."""

import os
from pathlib import Path

import httpx
import pytest

from proxy.config import settings_from_dict
from tests.bad_input.common import SMALL, expect
from tests.conftest import libero_settings_dict
from tests.fakes.episodes import episode_frames, images_b64, npy_b64, write_mp4


def test_missing_file(client, media_root, fake_qwen):
    expect(client.post("/score", json={"task_text": "t", "video_path": str(media_root / "nope.mp4")}),
           422, "media_not_found", "video_path")
    assert fake_qwen.chat_requests == []


def test_path_outside_roots_is_forbidden_without_saying_if_it_exists(client, tmp_path):
    outside = tmp_path / "secret.mp4"
    write_mp4(outside, episode_frames(5, 32, 32))
    a = expect(client.post("/score", json={"task_text": "t", "video_path": str(outside)}), 403, "media_forbidden")
    b = expect(client.post("/score", json={"task_text": "t", "video_path": str(tmp_path / "absent.mp4")}),
               403, "media_forbidden")
    assert a["message"] == b["message"]


def test_dotdot_and_symlink_escapes_are_forbidden(client, media_root, tmp_path):
    outside = write_mp4(tmp_path / "outside.mp4", episode_frames(5, 32, 32))
    expect(client.post("/score", json={"task_text": "t", "video_path": f"{media_root}/../outside.mp4"}),
           403, "media_forbidden")
    link = media_root / "link.mp4"
    os.symlink(outside, link)
    expect(client.post("/score", json={"task_text": "t", "video_path": str(link)}), 403, "media_forbidden")


def test_relative_path_is_refused(client):
    expect(client.post("/score", json={"task_text": "t", "video_path": "episode.mp4"}), 422, field="video_path")


@pytest.mark.parametrize(("content", "code"), [
    (b"", "media_format_refused"), (b"not a video at all" * 100, "media_format_refused"),  # by content
    (b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 500, "media_decode_error")])  # looks like an MP4, does not decode
def test_corrupt_or_empty_video(client, media_root, content, code):
    path = media_root / "broken.mp4"
    path.write_bytes(content)
    expect(client.post("/score", json={"task_text": "t", "video_path": str(path)}), 422, code, "video_path")


def test_truncated_mp4_scores_what_it_holds_or_fails_clearly(client, media_root):
    full = write_mp4(media_root / "full.mp4", episode_frames(40, 64, 64)).read_bytes()
    cut = media_root / "cut.mp4"
    cut.write_bytes(full[: len(full) // 2])
    response = client.post("/score", json={"task_text": "t", "video_path": str(cut)})
    assert response.status_code in (200, 422), response.text
    if response.status_code == 422:
        assert response.json()["error"]["code"] == "media_decode_error"


@pytest.mark.parametrize(("payload", "field"), [
    ({"task_text": "t", "frames": []}, "frames"),
    ({"task_text": "t", "frames": ["not base64!!"]}, "frames[0]"),
    ({"task_text": "t", "frames": ["aGVsbG8="]}, "frames[0]"),  # base64 of "hello": not an image
    ({"task_text": "t", "frames_npy": "aGVsbG8="}, "frames_npy"),
    ({"task_text": "t", "frames_npy": npy_b64(episode_frames(2, 8, 8)[..., 0])}, "frames_npy"),
    ({"task_text": "t", "frames_npy": SMALL, "nframes": 0}, "nframes"),
    ({"task_text": "t", "frames_npy": SMALL, "nframes": 100000}, "nframes"),
    ({"task_text": "t", "frames_npy": SMALL, "max_pixels": 10**9}, "max_pixels"),
    ({"task_text": "t", "frames_npy": SMALL, "max_pixels": 100}, "max_pixels"),
    ({"task_text": "", "frames_npy": SMALL}, "task_text"),
    ({"frames_npy": SMALL}, "task_text"),
    ({"task_text": 5, "frames_npy": SMALL}, "task_text"),
    ({"task_text": "t", "frames_npy": SMALL, "nframes": "many"}, "nframes"),
    ({"task_text": "t", "frames_npy": SMALL, "backend_kwargs": {"temperature": 9}}, "backend_kwargs.temperature"),
    ({"task_text": "t", "frames_npy": SMALL, "backend_kwargs": {"max_tokens": 10**6}}, "backend_kwargs.max_tokens"),
    ({"task_text": "t", "frames_npy": SMALL, "backend_kwargs": {"guided_regex": "x"}}, "backend_kwargs.guided_regex"),
    ({"task_text": "t", "frames_npy": SMALL, "backend_kwargs": {"score_mode": "logit"}}, "backend_kwargs.score_mode"),
    ({"task_text": "t", "frames_npy": SMALL, "surprise": 1}, "surprise"),
])
def test_bad_fields_are_422_naming_the_field(client, fake_qwen, payload, field):
    expect(client.post("/score", json=payload), 422, field=field)
    assert fake_qwen.chat_requests == []


def test_two_sources_at_once_is_refused(client):
    error = expect(client.post("/score", json={"task_text": "t", "frames_npy": SMALL, "video_path": "/tmp/x.mp4"}), 422)
    assert "exactly one" in error["message"]


def test_unknown_backend_is_404_listing_known_ones(client):
    error = expect(client.post("/score", json={"task_text": "t", "frames_npy": SMALL, "backend": "gpt-9"}),
                   404, "unknown_backend", "backend")
    assert "qwen2_5_vl_vllm" in error["message"] and "primo_r1_vllm" in error["message"]


def test_too_many_inline_frames(client):
    frames = images_b64(episode_frames(1, 8, 8)) * 3000
    expect(client.post("/score", json={"task_text": "t", "frames": frames}), 422, field="frames")


def test_frames_of_different_sizes_are_refused(client):
    frames = images_b64(episode_frames(2, 32, 32)) + images_b64(episode_frames(2, 64, 64))
    expect(client.post("/score", json={"task_text": "t", "frames": frames, "nframes": 4}), 422, "media_decode_error")


def test_oversize_body_is_413_before_it_is_read(proxy_factory, fake_qwen, fake_primo, media_root):
    settings = settings_from_dict(libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root,
                                                       max_body_mb=0.5))
    server = proxy_factory(settings)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post("/score", content=b"{" + b" " * 600_000 + b"}",
                             headers={"content-type": "application/json"})
    expect(response, 413, "payload_too_large")


def test_token_budget_is_checked_before_sending(proxy_factory, fake_qwen, fake_primo, media_root):
    data = libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root)
    data["backends"]["qwen2_5_vl_vllm"]["max_model_len"] = 2048
    server = proxy_factory(settings_from_dict(data))
    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post("/score", json={"task_text": "t", "nframes": 64,
                                             "frames_npy": npy_b64(episode_frames(64, 448, 448)),
                                             "max_pixels": 401408})
    error = expect(response, 422, "token_budget", "nframes")
    assert "max_model_len 2048" in error["message"]
    assert fake_qwen.chat_requests == []


def test_missing_template_variable_is_422(proxy_factory, fake_qwen, fake_primo, media_root, tmp_path):
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "scene.yaml").write_text(
        "variables: {task_text: {}, scene: {}}\nuser: 'In ${scene}: ${task_text}. <score>?</score>'\n"
        "answer: {tags: [score], scale: {min: 0, max: 100}}\n")
    for name in ("primo_r1",):
        (prompts / f"{name}.yaml").write_text((Path(__file__).parents[2] / "prompts" / f"{name}.yaml").read_text())
    data = libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root,
                                prompts_dir=str(prompts))
    data["backends"]["qwen2_5_vl_vllm"]["prompt"] = "scene"
    server = proxy_factory(settings_from_dict(data))
    with httpx.Client(base_url=server.url, timeout=30) as http:
        missing = http.post("/score", json={"task_text": "t", "frames_npy": SMALL})
        given = http.post("/score", json={"task_text": "t", "frames_npy": SMALL,
                                          "backend_kwargs": {"scene": "a kitchen"}})
    expect(missing, 422, "template_variable", "backend_kwargs.scene")
    assert given.status_code == 200, given.text
    assert "In a kitchen: t." in fake_qwen.chat_requests[-1]["messages"][-1]["content"][-1]["text"]


def test_unicode_task_text_round_trips(client, fake_qwen):
    task = "把碗放在盘子上 — déposer le bol 🍜"
    assert client.post("/score", json={"task_text": task, "frames_npy": SMALL}).status_code == 200
    assert task in fake_qwen.chat_requests[-1]["messages"][-1]["content"][-1]["text"]
