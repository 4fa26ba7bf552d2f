"""The binary body (multipart/form-data with raw parts) through the real proxy against the fake vLLM:
the same answer and the same frames upstream as the JSON body, for every route that takes frames;
malformed bodies and dangling part names are clear 422s."""

from __future__ import annotations

import base64
import hashlib
import io
import json

import cv2
import numpy as np
import pytest

from rlinf_client._frames import encode_npy
from tests.fakes.episodes import episode_frames, images_b64, npy_b64
from vlm_protocol.multipart import encode_form

FRAMES = episode_frames(12, 64, 64)
TASK = "put the bowl on the plate"


def _post_form(client, path: str, request: dict, parts: dict[str, tuple[str, bytes]]):
    content_type, body = encode_form(json.dumps(request).encode(), parts)
    return client.post(path, content=body, headers={"content-type": content_type})


def _upstream_video(fake) -> str:
    content = fake.chat_requests[-1]["messages"][-1]["content"]
    return next(p["video_url"]["url"] for p in content if p["type"] == "video_url")


def test_an_npy_part_scores_like_inline_base64(client, fake_qwen):
    inline = client.post("/score", json={"task_text": TASK, "frames_npy": npy_b64(FRAMES)})
    sent_inline = _upstream_video(fake_qwen)
    binary = _post_form(client, "/score", {"task_text": TASK, "frames_npy": "part:episode"},
                        {"episode": ("application/x-npy", encode_npy(FRAMES))})
    assert binary.status_code == 200, binary.text
    assert _upstream_video(fake_qwen) == sent_inline
    for key in ("score", "frames"):
        assert binary.json()[key] == inline.json()[key]


def test_image_parts_in_a_batch_each_item_reading_its_own(client, fake_qwen):
    jpegs = [base64.b64decode(f) for f in images_b64(FRAMES, ".jpg")]
    items = [{"task_text": TASK, "frames": [f"part:item{i}-frame{j}" for j in range(len(jpegs))]} for i in range(2)]
    items.append({"task_text": TASK, "frames_npy": "part:missing"})  # names a part the body lacks
    parts = {f"item{i}-frame{j}": ("image/jpeg", jpeg) for i in range(2) for j, jpeg in enumerate(jpegs)}
    answer = _post_form(client, "/score/batch", {"items": items}, parts)
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert [r["ok"] for r in results] == [True, True, False]
    assert results[0]["result"]["frames"]["sha256"] == results[1]["result"]["frames"]["sha256"]
    assert results[2]["status"] == 422 and results[2]["error"]["field"] == "frames_npy"
    assert "part 'missing'" in results[2]["error"]["message"]


def test_a_final_size_jpeg_is_forwarded_as_is(client, fake_qwen):
    """Frames already at the size the backend sends (336x336 here: the video floor) are not
    decoded and encoded again: vLLM gets the caller's bytes, and the hashes are theirs."""
    frames = np.stack([cv2.resize(f, (336, 336)) for f in episode_frames(4, 64, 64)])
    jpegs = [base64.b64decode(f) for f in images_b64(frames, ".jpg")]
    answer = client.post("/score", json={"task_text": TASK, "frames": images_b64(frames, ".jpg")})
    assert answer.status_code == 200, answer.text
    sent = _upstream_video(fake_qwen).partition(";base64,")[2].split(",")
    assert [base64.b64decode(piece) for piece in sent] == jpegs
    assert answer.json()["frames"]["sha256"] == [hashlib.sha256(j).hexdigest() for j in jpegs]


def test_a_rotated_jpeg_is_decoded_as_opencv_sees_it_not_forwarded(client, fake_qwen):
    """EXIF orientation: PIL (and vLLM) would show the stored pixels, OpenCV the rotated ones —
    such a frame is decoded here, never forwarded with a meaning that depends on the reader."""
    from PIL import Image

    frames = np.stack([cv2.resize(f, (336, 336)) for f in episode_frames(2, 64, 64)])
    rotated = []
    for frame in frames:
        buffer, exif = io.BytesIO(), Image.Exif()
        exif[0x0112] = 6  # rotate 90 degrees on display
        Image.fromarray(frame).save(buffer, "JPEG", exif=exif)
        rotated.append(buffer.getvalue())
    answer = client.post("/score", json={"task_text": TASK, "frames": [base64.b64encode(j).decode() for j in rotated]})
    assert answer.status_code == 200, answer.text
    sent = [base64.b64decode(p) for p in _upstream_video(fake_qwen).partition(";base64,")[2].split(",")]
    assert sent != rotated and len(sent) == 2


def test_a_json_request_cannot_name_a_part(client, fake_qwen):
    answer = client.post("/score", json={"task_text": TASK, "frames_npy": "part:episode"})
    assert answer.status_code == 422 and answer.json()["error"]["field"] == "frames_npy"
    assert fake_qwen.chat_requests == []


@pytest.mark.parametrize("body", [
    b"garbage",  # no boundary at the start
    b"--B\r\nContent-Disposition: form-data; name=\"episode\"\r\n\r\nxx\r\n--B--\r\n",  # no request part
    b"--B\r\nContent-Disposition: form-data; name=\"request\"\r\n\r\n{}",  # cut short
])
def test_a_malformed_multipart_body_is_a_422_on_body(client, fake_qwen, body):
    answer = client.post("/score", content=body, headers={"content-type": "multipart/form-data; boundary=B"})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["field"] == "body" and "multipart" in answer.json()["error"]["message"]
    assert fake_qwen.chat_requests == []
