"""What the proxy sends to `vllm serve` for each backend: parts, order, frames, kwargs, sampling."""

import base64
import hashlib

import httpx
import pytest

from proxy.config import settings_from_dict
from tests.conftest import QWEN_MODEL, libero_settings_dict
from tests.fakes.episodes import (
    decode_jpeg_b64,
    episode_frames,
    frame_level,
    images_b64,
    npy_b64,
    write_mp4,
)
from tests.fakes.fake_vllm import decode_video_part

SAMPLING_KEYS = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "max_tokens", "seed"}


def _video_frames(part, num_frames):
    return [decode_jpeg_b64(__import__("base64").b64encode(j).decode()) for j in
            decode_video_part(part["video_url"]["url"], num_frames)]


def test_qwen_request_is_video_then_text_with_every_frame_and_timing(client, fake_qwen):
    response = client.post("/score", json={"task_text": "put the bowl on the plate",
                                           "frames_npy": npy_b64(episode_frames(40, 256, 256)), "fps": 20})
    assert response.status_code == 200, response.text
    body = fake_qwen.chat_requests[-1]
    assert body["model"] == QWEN_MODEL
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    parts = body["messages"][-1]["content"]
    assert [p["type"] for p in parts] == ["video_url", "text"]
    assert "put the bowl on the plate" in parts[1]["text"]
    # vLLM keeps num_frames pieces; the proxy says exactly how many it sent, and the seed's rate
    video = body["media_io_kwargs"]["video"]
    assert video["num_frames"] == 16
    assert video["fps"] == 4.0  # presentation_fps "seed": the request gave no video_fps, so 4
    frames = _video_frames(parts[0], video["num_frames"])
    assert len(frames) == 16
    levels = [frame_level(f) for f in frames]
    assert levels == sorted(levels) and levels[0] < 25 and levels[-1] > 230  # first..last, in order
    assert all(f.shape == (336, 336, 3) for f in frames)  # qwen-vl-utils' video floor: 256 → 336
    assert frames[0][5, 5].tolist()[0] > 200 and frames[0][5, 5].tolist()[2] < 60  # RGB kept
    assert set(body) >= SAMPLING_KEYS and body["n"] == 1 and body["stream"] is False
    result = response.json()
    assert result["frames"]["indices"][0] == 0 and result["frames"]["indices"][-1] == 39
    assert result["frames"]["size"] == [336, 336] and result["frames"]["sampled_fps"] == pytest.approx(8.0)
    assert result["score"] == pytest.approx(0.75) and result["parse"]["source"] == "score_tag"


def test_primo_request_is_system_image_video_image_text(client, fake_primo):
    response = client.post("/score", json={"task_text": "open the drawer", "backend": "primo_r1_vllm",
                                           "frames": images_b64(episode_frames(30, 128, 160))})
    assert response.status_code == 200, response.text
    body = fake_primo.chat_requests[-1]
    assert body["messages"][0]["role"] == "system" and "<answer>" in body["messages"][0]["content"]
    parts = body["messages"][1]["content"]
    assert [p["type"] for p in parts] == ["image_url", "video_url", "image_url", "text"]
    video = _video_frames(parts[1], body["media_io_kwargs"]["video"]["num_frames"])
    first = decode_jpeg_b64(parts[0]["image_url"]["url"].split(",", 1)[1])
    last = decode_jpeg_b64(parts[2]["image_url"]["url"].split(",", 1)[1])
    assert len(video) == 16
    assert frame_level(first) == pytest.approx(frame_level(video[0]), abs=2)
    assert frame_level(last) == pytest.approx(frame_level(video[-1]), abs=2)
    assert frame_level(last) > frame_level(first) + 150
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.01, 0.001, 1024)
    result = response.json()
    assert result["backend"] == "PRIMO-R1" and result["score"] == pytest.approx(0.6)
    assert result["prompt"]["name"] == "primo_r1"


def test_frames_are_resized_within_the_requested_budget(client, fake_qwen):
    response = client.post("/score", json={"task_text": "t", "max_pixels": 50176, "nframes": 8,
                                           "frames_npy": npy_b64(episode_frames(20, 480, 640))})
    assert response.status_code == 200, response.text
    width, height = response.json()["frames"]["size"]
    assert width % 28 == 0 and height % 28 == 0 and width * height <= 50176
    body = fake_qwen.chat_requests[-1]
    assert len(_video_frames(body["messages"][-1]["content"][0], -1)) == 8


def test_long_episode_keeps_all_sampled_frames_past_vllms_default_32(proxy_factory, fake_qwen, fake_primo, media_root):
    settings = settings_from_dict(libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root))
    server = proxy_factory(settings)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post("/score", json={"task_text": "t", "nframes": 40,
                                             "frames_npy": npy_b64(episode_frames(100, 112, 112))})
    assert response.status_code == 200, response.text
    body = fake_qwen.chat_requests[-1]
    assert body["media_io_kwargs"]["video"]["num_frames"] == 40
    # what vLLM keeps with the request's num_frames: all 40, the last one included
    kept = _video_frames(body["messages"][-1]["content"][0], body["media_io_kwargs"]["video"]["num_frames"])
    assert len(kept) == 40 and frame_level(kept[-1]) > 230


def test_mp4_and_inline_frames_give_the_same_sampling(client, fake_qwen, media_root):
    frames = episode_frames(50, 128, 128)
    path = write_mp4(media_root / "episode.mp4", frames, fps=20)
    by_path = client.post("/score", json={"task_text": "t", "video_path": str(path)}).json()
    inline = client.post("/score", json={"task_text": "t", "frames_npy": npy_b64(frames), "fps": 20}).json()
    assert by_path["frames"]["indices"] == inline["frames"]["indices"]
    assert by_path["frames"]["sampled_fps"] == pytest.approx(inline["frames"]["sampled_fps"])
    assert by_path["frames"]["source_count"] == 50


def test_images_layout_sends_separate_image_parts(proxy_factory, fake_vllm_factory, media_root):
    fake = fake_vllm_factory(served_model_name="plain-vlm", default_text="<score>0.4</score>")
    data = libero_settings_dict([fake.base_url], [fake.base_url], media_root)
    data["backends"] = {"plain": {**data["backends"]["qwen2_5_vl_vllm"], "model": "plain-vlm",
                                  "layout": "images", "score_mode": "unit",
                                  "frames": {"nframes": 4, "max_pixels": 50176}}}
    server = proxy_factory(settings_from_dict(data))
    with httpx.Client(base_url=server.url, timeout=30) as http:
        result = http.post("/score", json={"task_text": "t", "frames_npy": npy_b64(episode_frames(9, 64, 64))})
    assert result.status_code == 200, result.text
    body = fake.chat_requests[-1]
    assert [p["type"] for p in body["messages"][-1]["content"]] == ["image_url"] * 4 + ["text"]
    images = body["messages"][-1]["content"][:4]  # each named (media_uuids) by the sha256 of the JPEG it carries
    assert [p["uuid"] for p in images] == result.json()["frames"]["sha256"] == [
        hashlib.sha256(base64.b64decode(p["image_url"]["url"].partition(",")[2])).hexdigest() for p in images]
    assert "media_io_kwargs" not in body  # no video part, nothing to tell the video loader
    assert result.json()["score"] == pytest.approx(0.4)
    with httpx.Client(base_url=server.url, timeout=30) as http:  # more images than the server's limit
        over = http.post("/score", json={"task_text": "t", "nframes": 6,
                                         "frames_npy": npy_b64(episode_frames(9, 64, 64))})
    assert over.status_code == 422 and over.json()["error"]["field"] == "nframes"
    assert len(fake.chat_requests) == 1


def test_backend_kwargs_override_sampling_and_score_mode(client, fake_qwen):
    fake_qwen.script({"reply": "<score>0.3</score>"})
    response = client.post("/score", json={
        "task_text": "t", "frames_npy": npy_b64(episode_frames(4, 64, 64)),
        "backend_kwargs": {"temperature": 0.5, "max_tokens": 128, "score_mode": "unit"}})
    assert response.status_code == 200, response.text
    body = fake_qwen.chat_requests[-1]
    assert (body["temperature"], body["max_tokens"]) == (0.5, 128)
    assert response.json()["score"] == pytest.approx(0.3) and response.json()["parse"]["mode"] == "unit"


def test_api_key_is_sent_as_bearer_token(proxy_factory, fake_qwen, fake_primo, media_root, monkeypatch):
    monkeypatch.setenv("QWEN_KEY", "s3cret")
    data = libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root)
    data["backends"]["qwen2_5_vl_vllm"]["api_key_env"] = "QWEN_KEY"
    server = proxy_factory(settings_from_dict(data))
    with httpx.Client(base_url=server.url, timeout=30) as http:
        episode = {"task_text": "t", "frames_npy": npy_b64(episode_frames(3, 64, 64))}
        assert http.post("/score", json=episode).status_code == 200
    headers = fake_qwen.fake.state.requests[-1].headers
    assert headers["authorization"] == "Bearer s3cret"
