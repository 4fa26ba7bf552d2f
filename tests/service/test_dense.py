"""POST /score/dense (a progress curve) and /score's prefix_end, through the real proxy against the
fake vLLM. The fake answers the progress its input shows (the grey level of the last frame it
receives), so the curve can be checked against the episode itself, frame by frame."""

from __future__ import annotations

import json

import httpx
import pytest

from proxy.config import settings_from_dict
from tests.conftest import libero_settings_dict
from tests.fakes.episodes import decode_jpeg_b64, episode_frames, frame_level, npy_b64, write_mp4
from vlm_protocol.frames import sample_indices

COUNT = 40
EPISODE = episode_frames(COUNT, 64, 64)
TASK = "put the bowl on the plate"


def _progress(level: float) -> int:
    """The progress a frame of `episode_frames` shows, 0-100 (its grey level runs 20 → 235)."""
    return round((level - 20) / 215 * 100)


def _video(body: dict) -> list[str]:
    part = next(p for p in body["messages"][-1]["content"] if p["type"] == "video_url")
    return part["video_url"]["url"].partition(";base64,")[2].split(",")


def _images(body: dict) -> list[str]:
    return [p["image_url"]["url"].partition(";base64,")[2]
            for p in body["messages"][-1]["content"] if p["type"] == "image_url"]


def _reads_the_last_video_frame(tag: str):
    return lambda body: f"<{tag}>{_progress(frame_level(decode_jpeg_b64(_video(body)[-1])))}</{tag}>"


@pytest.fixture
def audit_proxy(proxy_factory, fake_qwen, fake_primo, media_root, tmp_path):
    audit = tmp_path / "audit.jsonl"
    server = proxy_factory(settings_from_dict(libero_settings_dict(
        [fake_qwen.base_url], [fake_primo.base_url], media_root, audit_log=str(audit), max_batch_items=6)))
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as http:
        http.flush_audit = server.flush_audit  # type: ignore[attr-defined]
        yield http, audit


def test_the_curve_is_the_progress_each_prefix_shows(client, fake_qwen):
    fake_qwen.fake.state.reply_fn = _reads_the_last_video_frame("score")
    response = client.post("/score/dense", json={"task_text": TASK, "frames_npy": npy_b64(EPISODE), "points": 4})
    assert response.status_code == 200, response.text
    result = response.json()
    ends = sample_indices(COUNT, 5)[1:]  # 4 prefixes after the first frame's, the last the whole episode
    assert [p["frame_index"] for p in result["curve"]] == ends and ends[-1] == COUNT - 1
    expected = [_progress(frame_level(EPISODE[end])) / 100 for end in ends]
    assert [p["score"] for p in result["curve"]] == pytest.approx(expected, abs=0.011)  # JPEG: within a point
    assert result["source_count"] == COUNT and result["attempts"] == 4 == len(fake_qwen.chat_requests)
    # Each call saw exactly its prefix: first frame, the prefix's end, evenly between (nframes 16).
    sent = sorted((len(_video(b)), _progress(frame_level(decode_jpeg_b64(_video(b)[-1]))))
                  for b in fake_qwen.chat_requests)
    assert sent == sorted((min(16, end + 1), _progress(frame_level(EPISODE[end]))) for end in ends)
    for point, end in zip(result["points"], ends, strict=True):
        assert point["frames"]["indices"] == sample_indices(end + 1, 16)
    assert result["usage"]["prompt_tokens"] == sum(p["usage"]["prompt_tokens"] for p in result["points"])


def test_a_primo_prefix_is_first_frame_video_and_the_prefix_end_as_current_frame(client, fake_primo):
    fake_primo.fake.state.reply_fn = lambda body: (
        f"<think>t</think><answer>{_progress(frame_level(decode_jpeg_b64(_images(body)[-1])))}</answer>")
    response = client.post("/score/dense", json={"task_text": TASK, "frames_npy": npy_b64(EPISODE),
                                                 "prefix_ends": [9, 19, 39], "backend": "PRIMO-R1"})
    assert response.status_code == 200, response.text
    assert [p["frame_index"] for p in response.json()["curve"]] == [9, 19, 39]
    for body in fake_primo.chat_requests:
        first, current = (frame_level(decode_jpeg_b64(image)) for image in _images(body))
        video = [frame_level(decode_jpeg_b64(frame)) for frame in _video(body)]
        assert first == pytest.approx(frame_level(EPISODE[0]), abs=1.5)
        assert current == pytest.approx(video[-1], abs=1.5)  # the current frame is the prefix's last
    currents = sorted(_progress(frame_level(decode_jpeg_b64(_images(b)[-1]))) for b in fake_primo.chat_requests)
    assert currents == [_progress(frame_level(EPISODE[end])) for end in (9, 19, 39)]


def test_a_video_file_is_decoded_once_and_each_point_leaves_a_dense_audit_line(audit_proxy, fake_qwen, media_root):
    http, audit = audit_proxy
    fake_qwen.fake.state.reply_fn = _reads_the_last_video_frame("score")
    path = write_mp4(media_root / "episode.mp4", EPISODE)
    result = http.post("/score/dense", json={"task_text": TASK, "video_path": str(path), "points": 3,
                                             "metadata": {"episode_id": "e1"}}).json()
    ends = sample_indices(COUNT, 4)[1:]
    assert [p["frame_index"] for p in result["curve"]] == ends
    assert [p["score"] for p in result["curve"]] == sorted(p["score"] for p in result["curve"])  # progress rises
    http.flush_audit()
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    lines.sort(key=lambda line: line["dense"]["point"])
    assert [(line["kind"], line["dense"]["point"], line["asked"]["prefix_end"]) for line in lines] == [
        ("dense_point", i, e) for i, e in enumerate(ends)]
    assert all(line["dense"]["points"] == 3 and line["metadata"]["episode_id"] == "e1" for line in lines)


def test_a_point_that_fails_fails_the_curve_and_says_which(client, fake_qwen):
    # The shortest prefix gets a reply without a score, every time it is asked.
    fake_qwen.fake.state.reply_fn = lambda body: ("I cannot tell" if len(_video(body)) < 16
                                                  else _reads_the_last_video_frame("score")(body))
    response = client.post("/score/dense", json={"task_text": TASK, "frames_npy": npy_b64(EPISODE),
                                                 "prefix_ends": [5, 20, 39]})
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "unparseable_score"
    assert error["message"].startswith("point 1 of 3 (prefix ending at frame 5): ")
    assert "score" not in response.json() and "curve" not in response.json()


@pytest.mark.parametrize(("extra", "field"), [
    ({"prefix_ends": [5, 40]}, "prefix_ends"),  # past the last frame (39)
    ({"prefix_ends": [9, 5]}, "prefix_ends"),  # not increasing
    ({"points": 2, "prefix_ends": [5, 9]}, None),  # two ways at once
    ({"points": 3, "prefix_end": 9}, None),  # prefix_end is per point here
    ({"points": 7}, "points"),  # over proxy.max_batch_items (6 here): k points are k calls
    ({"points": 1}, "points"),
])
def test_bad_dense_requests_are_422_before_any_call(audit_proxy, fake_qwen, extra, field):
    http, _ = audit_proxy
    response = http.post("/score/dense", json={"task_text": TASK, "frames_npy": npy_b64(EPISODE), **extra})
    assert response.status_code == 422, response.text
    if field:
        assert response.json()["error"]["field"] == field
    assert fake_qwen.chat_requests == []


def test_more_points_than_the_episode_has_prefixes_is_422(client, fake_qwen):
    response = client.post("/score/dense", json={"task_text": TASK, "frames_npy": npy_b64(EPISODE[:4]), "points": 4})
    assert response.status_code == 422 and response.json()["error"]["field"] == "points"
    assert "3 prefixes" in response.json()["error"]["message"] and fake_qwen.chat_requests == []


def test_score_with_prefix_end_scores_the_episode_as_if_it_ended_there(client, fake_qwen):
    fake_qwen.fake.state.reply_fn = _reads_the_last_video_frame("score")
    result = client.post("/score", json={"task_text": TASK, "frames_npy": npy_b64(EPISODE), "prefix_end": 9}).json()
    assert result["frames"]["indices"] == list(range(10)) and result["frames"]["source_count"] == COUNT
    assert result["frames"]["sampled_fps"] == 4.0  # 10 frames sent of a 10-frame prefix, at 4 fps
    assert result["score"] == pytest.approx(_progress(frame_level(EPISODE[9])) / 100, abs=0.011)
    past = client.post("/score", json={"task_text": TASK, "frames_npy": npy_b64(EPISODE), "prefix_end": COUNT})
    assert past.status_code == 422 and past.json()["error"]["field"] == "prefix_end"
