"""Self-check of the vLLM contract oracle with hand-made requests (no proxy code involved).

Pins the vLLM 0.32.0 behaviour the proxy depends on: the 32-frame default cap on
``data:video/jpeg`` videos, per-request ``media_io_kwargs`` lifting it, the fps/num_frames
cross-wipe in ``VideoMediaIO.merge_kwargs``, and the 400 a stock server answers to per-request
kwargs without ``--trust-request-mm-kwargs``.
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
from typing import Any

import pytest
from PIL import Image

from tests.reference.oracle import (
    LAUNCHER_SERVER,
    ORACLE_SCRIPT,
    image_parts,
    only_video,
    reference_python,
    run_oracle,
)

pytestmark = pytest.mark.reference

N_FRAMES = 40


def _jpeg_b64(gray: int, size: tuple[int, int] = (64, 48)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, (gray, gray, gray)).save(buf, "JPEG", quality=95)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# Frame i is a flat gray of level 5 + 6*i: decoded means must come back increasing, in order.
LEVELS = [5 + 6 * i for i in range(N_FRAMES)]
VIDEO_URL = "data:video/jpeg;base64," + ",".join(_jpeg_b64(v) for v in LEVELS)
IMAGE_URL = "data:image/jpeg;base64," + _jpeg_b64(200, (32, 24))


def _request(media_io_kwargs: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "Qwen2.5-VL-7B-Instruct",
        "messages": [
            {"role": "system", "content": "You are a reward model."},
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": IMAGE_URL}},
                {"type": "video_url", "video_url": {"url": VIDEO_URL}},
                {"type": "text", "text": "How far along is the task?"},
            ]},
        ],
        "temperature": 0.01, "top_p": 0.001, "max_completion_tokens": 64, "seed": 0,
    }
    if media_io_kwargs is not None:
        body["media_io_kwargs"] = media_io_kwargs
    body.update(fields)
    return body


NO_FLAGS_TRUSTED = {"trust_request_mm_kwargs": True}  # no --media-io-kwargs
STOCK = {"trust_request_mm_kwargs": False}

CASES: dict[str, dict[str, Any]] = {
    # (a) per-request num_frames + fps: all 40 frames, the sent fps
    "a_per_request_40": {"request": _request({"video": {"num_frames": N_FRAMES, "fps": 2.0}}),
                         "server": NO_FLAGS_TRUSTED},
    # (b) nothing per request, no --media-io-kwargs: the default cap keeps the first 32
    "b_server_default": {"request": _request(), "server": NO_FLAGS_TRUSTED},
    # (c) stock server (no --trust-request-mm-kwargs) + per-request kwargs: 400 on media_io_kwargs
    "c_untrusted": {"request": _request({"video": {"num_frames": N_FRAMES, "fps": 2.0}}), "server": STOCK},
    # server --media-io-kwargs num_frames=-1, request sends fps alone: the server's num_frames is
    # wiped by VideoMediaIO.merge_kwargs, so the 32 cap comes back
    "d_fps_only_wipes_server_num_frames": {"request": _request({"video": {"fps": 2.0}}),
                                           "server": LAUNCHER_SERVER},
    # what the proxy sends to our launchers: both keys, all frames kept, fps honoured
    "e_launcher_both_keys": {"request": _request({"video": {"num_frames": -1, "fps": 2.0}}),
                             "server": LAUNCHER_SERVER},
    # safety net alone: no per-request kwargs, server num_frames=-1 keeps all 40 (fps defaults to 1)
    "f_launcher_no_kwargs": {"request": _request(), "server": LAUNCHER_SERVER},
    # stock server, no per-request kwargs: accepted, but silently truncated to 32
    "g_stock_no_kwargs": {"request": _request(), "server": STOCK},
}


@pytest.fixture(scope="module")
def reports() -> dict[str, dict[str, Any]]:
    names = list(CASES)
    return dict(zip(names, run_oracle([CASES[n] for n in names]), strict=True))



def _assert_first_frames_in_order(video: dict[str, Any], n: int) -> None:
    means = video["frame_means"]
    assert len(means) == n
    for got, want in zip(means, LEVELS[:n], strict=True):
        assert abs(got - want) <= 2.0, (means, LEVELS[:n])


def test_a_per_request_kwargs_keep_all_40_frames(reports):
    r = reports["a_per_request_40"]
    assert r["request_valid"] and r["mm_kwargs_check"]["ok"] and r["decode_ok"] and r["would_accept"], r
    assert r["media_io_kwargs"]["merged"] == {"video": {"num_frames": N_FRAMES, "fps": 2.0}}
    video = only_video(r)
    assert video["num_frames"] == N_FRAMES
    assert (video["width"], video["height"], video["frame_sizes_distinct"]) == (64, 48, 1)
    _assert_first_frames_in_order(video, N_FRAMES)
    md = video["metadata"]
    assert md["fps"] == 2.0
    assert md["total_num_frames"] == N_FRAMES
    assert md["duration"] == pytest.approx(N_FRAMES / 2.0)
    assert md["frames_indices"] == list(range(N_FRAMES))
    assert md["do_sample_frames"] is False


def test_b_server_default_keeps_only_first_32(reports):
    r = reports["b_server_default"]
    assert r["would_accept"], r  # accepted with 200: the truncation is silent
    video = only_video(r)
    assert video["num_frames"] == 32
    _assert_first_frames_in_order(video, 32)  # the END of the episode is what gets dropped
    assert video["metadata"]["fps"] == 1.0
    assert video["metadata"]["total_num_frames"] == 32


def test_c_untrusted_server_rejects_per_request_media_io_kwargs(reports):
    r = reports["c_untrusted"]
    assert r["request_valid"]
    check = r["mm_kwargs_check"]
    assert check["ok"] is False
    assert check["param"] == "media_io_kwargs"
    assert "--trust-request-mm-kwargs" in check["message"]
    assert r["would_accept"] is False
    err = r["error_response"]["error"]
    assert (err["code"], err["param"], err["type"]) == (400, "media_io_kwargs", "BadRequestError")


def test_fps_alone_drops_server_num_frames(reports):
    r = reports["d_fps_only_wipes_server_num_frames"]
    assert r["media_io_kwargs"]["merged"] == {"video": {"fps": 2.0}}
    video = only_video(r)
    assert video["num_frames"] == 32
    assert video["metadata"]["fps"] == 2.0


def test_launcher_with_both_keys_keeps_everything(reports):
    r = reports["e_launcher_both_keys"]
    assert r["would_accept"], r
    video = only_video(r)
    assert video["num_frames"] == N_FRAMES
    _assert_first_frames_in_order(video, N_FRAMES)
    assert video["metadata"]["fps"] == 2.0
    assert video["metadata"]["duration"] == pytest.approx(20.0)


def test_launcher_safety_net_without_request_kwargs(reports):
    r = reports["f_launcher_no_kwargs"]
    assert r["media_io_kwargs"]["merged"] == {"video": {"num_frames": -1}}
    video = only_video(r)
    assert video["num_frames"] == N_FRAMES
    assert video["metadata"]["fps"] == 1.0


def test_stock_server_without_kwargs_accepts_but_truncates(reports):
    r = reports["g_stock_no_kwargs"]
    assert r["mm_kwargs_check"]["ok"] and r["would_accept"], r
    assert only_video(r)["num_frames"] == 32


def test_image_part_and_message_order(reports):
    r = reports["a_per_request_40"]
    assert [m["role"] for m in r["messages"]] == ["system", "user"]
    assert [p["type"] for p in r["messages"][1]["parts"]] == ["image_url", "video_url", "text"]
    (img,) = image_parts(r)
    assert img["image"] == {"width": 32, "height": 24, "mode": "RGB"}
    assert r["sampling"]["ok"] and r["sampling"]["params"]["temperature"] == pytest.approx(0.01)
    assert r["ignored_fields"] == []


def test_single_document_answers_single_report():
    """A non-list stdin document gets a single JSON object back (not a list)."""
    python = reference_python()
    doc = {"request": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2,
                       "temperature": 0.0},
           "server": {"trust_request_mm_kwargs": False}}
    proc = subprocess.run([python, str(ORACLE_SCRIPT)], input=json.dumps(doc), capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert isinstance(report, dict)
    assert report["request_valid"] and report["decode_ok"]
    assert report["messages"] == [{"role": "user", "parts": [{"type": "text", "text": "hi"}]}]
    # greedy (temperature 0) with n > 1 is a 400 from SamplingParams
    assert report["sampling"]["ok"] is False and report["would_accept"] is False
    assert report["error_response"]["error"]["code"] == 400
