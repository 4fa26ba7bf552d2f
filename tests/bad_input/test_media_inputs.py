"""Bad media: 0- and 1-frame episodes, files that are not videos, truncated MP4s, and every way
of pointing video_path outside proxy.allowed_media_roots. Each is a 4xx naming the problem
(a 1-frame episode is a valid episode and is scored), and no file outside the roots is opened:
the escape targets are FIFOs, which would block the proxy if it opened one, and after each
request a non-blocking open for writing proves no reader holds them."""

from __future__ import annotations

import io
import os
import random
import struct
import zipfile
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests.bad_input.common import expect
from tests.fakes.episodes import episode_frames, images_b64, npy_b64, write_mp4
from tests.helpers import assert_unopened


def _score(env, path, **extra):
    return env.post(json={"task_text": "t", "video_path": str(path), **extra},
                    label=f"video_path {Path(str(path)).name[:40]!r}")


@pytest.fixture(scope="module")
def mp4(env) -> bytes:
    return write_mp4(env.media / "full.mp4", episode_frames(40, 64, 64)).read_bytes()


def test_zero_frame_video(env):
    path = env.media / "zero.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 20, (64, 64))
    writer.release()  # a container with no frames
    expect(_score(env, path), 422, "media_decode_error", "video_path")


@pytest.mark.parametrize("source", ["mp4", "frames", "frames_npy"])
@pytest.mark.parametrize("backend", ["qwen2_5_vl_vllm", "PRIMO-R1"])
def test_one_frame_episode_is_scored_with_its_one_frame(env, allow_upstream, source, backend):
    one = episode_frames(1, 64, 64)
    if source == "mp4":
        body = {"video_path": str(write_mp4(env.media / "one.mp4", one))}
    elif source == "frames":
        body = {"frames": images_b64(one)}
    else:
        body = {"frames_npy": npy_b64(one)}
    response = env.post(json={"task_text": "t", "backend": backend, **body}, label=f"one frame {source}")
    assert response.status_code == 200, response.text
    frames = response.json()["frames"]
    assert frames["count"] == 1 and frames["indices"] == [0] and frames["source_count"] == 1
    assert response.json()["score"] in (0.75, 0.6)


@pytest.mark.parametrize(("source", "field"), [("frames", "frames"), ("frames_npy", "frames_npy")])
def test_zero_inline_frames(env, source, field):
    empty = [] if source == "frames" else npy_b64(np.zeros((0, 64, 64, 3), np.uint8))
    error = expect(env.post(json={"task_text": "t", source: empty}), 422, "invalid_request", field)
    # The list form is refused by the schema, the npy form when decoded; both name the emptiness.
    assert "no frames" in error["message"] or "at least 1 item" in error["message"]


def _png() -> bytes:
    return cv2.imencode(".png", np.zeros((64, 64, 3), np.uint8))[1].tobytes()


def _zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("episode.mp4", b"\x00" * 1000)
    return buf.getvalue()


def _npy_file() -> bytes:
    buf = io.BytesIO()
    np.save(buf, episode_frames(4, 32, 32))
    return buf.getvalue()


NOT_VIDEOS = {
    "empty": lambda: b"",
    "text": lambda: b"put the bowl on the plate\n" * 200,
    "json": lambda: b'{"frames": [1, 2, 3]}',
    "html": lambda: b"<!doctype html><html><body>404</body></html>",
    "random bytes": lambda: random.Random(6).randbytes(200_000),
    "zeros": lambda: b"\x00" * 100_000,
    "zip": _zip,
    "npy": _npy_file,
    "ftyp header only": lambda: b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom" + b"\x00" * 64,
    "elf": lambda: Path("/bin/sh").resolve().read_bytes()[:65536],
}


# What the content check names each (None: it starts as an MP4 does, and the decoder refuses it).
DETECTED = {"empty": "empty file", "text": "text", "json": "text", "html": "text", "random bytes": "unknown",
            "zeros": "unknown", "zip": "ZIP archive", "npy": "npy array", "ftyp header only": None,
            "elf": "ELF executable"}


@pytest.mark.parametrize("name", list(NOT_VIDEOS))
def test_files_that_are_not_videos(env, name):
    """Refused by content before a demuxer sees them (the name says .mp4), naming what they are."""
    path = env.media / f"not_video_{name.replace(' ', '_')}.mp4"
    path.write_bytes(NOT_VIDEOS[name]())
    if DETECTED[name] is None:
        expect(_score(env, path), 422, "media_decode_error", "video_path")
    else:
        error = expect(_score(env, path), 422, "media_format_refused", "video_path", mentions=DETECTED[name])
        assert error["detected"] == DETECTED[name]


@pytest.mark.parametrize(("ext", "detected"), [(".png", "PNG image"), (".jpg", "JPEG image")])
def test_a_still_image_at_video_path(env, ext, detected):
    """A still image is not a video container: refused by content (FFmpeg's image2 demuxer, which
    would open it, also reads numbered sequences and globs of other files)."""
    path = env.media / f"still{ext}.mp4"
    path.write_bytes(cv2.imencode(ext, episode_frames(1, 64, 64)[0])[1].tobytes())
    error = expect(_score(env, path), 422, "media_format_refused", "video_path", mentions=detected)
    assert error["detected"] == detected


def test_huge_sparse_file(env):
    path = env.media / "sparse.mp4"
    with path.open("wb") as fh:
        fh.truncate(2**30)  # 1 GiB of holes: nothing to decode, must not be read through
    expect(_score(env, path), 422, "media_format_refused", "video_path", mentions="unknown")


@pytest.mark.parametrize("cut", [64, 1024, 0.25, 0.5, 0.9, -1])
def test_truncated_mp4(env, allow_upstream, mp4, cut):
    size = cut if isinstance(cut, int) and cut > 0 else (len(mp4) + cut if isinstance(cut, int)
                                                          else int(len(mp4) * cut))
    path = env.media / f"cut_{size}.mp4"
    path.write_bytes(mp4[:size])
    response = _score(env, path)
    if response.status_code == 200:  # whatever frames survive are scored, and say so
        frames = response.json()["frames"]
        assert 1 <= frames["count"] <= frames["source_count"] <= 40
    else:
        expect(response, 422, "media_decode_error", "video_path")


def _boxes(data: bytes):
    at = 0
    while at < len(data):
        size, kind = struct.unpack(">I4s", data[at:at + 8])
        yield kind, data[at:at + size]
        at += size


def _faststart(data: bytes) -> bytes:
    """Move OpenCV's trailing moov box in front of mdat (shifting the stco chunk offsets), as
    `ffmpeg -movflags faststart` does: then a cut file still has an index that promises every frame."""
    top = list(_boxes(data))
    moov = bytearray(next(box for kind, box in top if kind == b"moov"))
    at = moov.find(b"stco")
    while at != -1:
        (count,) = struct.unpack(">I", moov[at + 8:at + 12])
        for j in range(count):
            slot = at + 12 + 4 * j
            moov[slot:slot + 4] = struct.pack(">I", struct.unpack(">I", moov[slot:slot + 4])[0] + len(moov))
        at = moov.find(b"stco", at + 4)
    return b"".join((bytes(moov) + box if kind == b"mdat" else box) for kind, box in top if kind != b"moov")


def test_truncated_faststart_mp4_is_scored_over_the_frames_that_exist(env, allow_upstream, mp4):
    """The index says 40 frames, half the payload is gone: sample over what decodes, and say so."""
    whole = _faststart(mp4)
    path = env.media / "faststart.mp4"
    path.write_bytes(whole)
    full = _score(env, path)
    assert full.status_code == 200 and full.json()["frames"]["source_count"] == 40, full.text
    path.write_bytes(whole[: len(whole) // 2])
    response = _score(env, path)
    assert response.status_code == 200, response.text
    frames = response.json()["frames"]
    assert 1 <= frames["source_count"] < 40
    assert frames["indices"][-1] == frames["source_count"] - 1  # the last frame that exists is kept
    assert frames["count"] == min(16, frames["source_count"])


def test_mp4_with_corrupted_payload(env, allow_upstream, mp4):
    data = bytearray(mp4)
    rng = random.Random(3)
    for i in rng.sample(range(200, len(data) - 200), 400):
        data[i] = rng.randrange(256)
    path = env.media / "corrupt.mp4"
    path.write_bytes(bytes(data))
    response = _score(env, path)
    assert response.status_code in (200, 422), response.text
    if response.status_code == 422:
        expect(response, 422, "media_decode_error", "video_path")


def test_directory_and_fifo_inside_the_root_are_not_found(env):
    (env.media / "a_dir.mp4").mkdir(exist_ok=True)
    fifo = env.media / "pipe.mp4"
    if not fifo.exists():
        os.mkfifo(fifo)
    for path in (env.media / "a_dir.mp4", fifo, env.media / "absent.mp4", env.media):
        expect(_score(env, path), 422, "media_not_found", "video_path")
    assert_unopened(fifo)


# -- escapes: every target is a FIFO outside the root ------------------------------------------------


@pytest.fixture(scope="module")
def escapes(env) -> dict[str, Path]:
    secret_dir = env.outside / "secret"
    secret_dir.mkdir()
    fifo = secret_dir / "episode.mp4"
    os.mkfifo(fifo)
    (env.media / "link_to_file.mp4").symlink_to(fifo)
    (env.media / "link_to_dir").symlink_to(secret_dir, target_is_directory=True)
    (env.media / "sub").mkdir()
    (env.media / "sub" / "up.mp4").symlink_to(Path("..") / ".." / "outside" / "secret" / "episode.mp4")
    (env.media / "link_to_dev_zero.mp4").symlink_to("/dev/zero")
    return {"fifo": fifo}


def _escape_paths(env) -> dict[str, str]:
    media, rel_fifo = str(env.media), "outside/secret/episode.mp4"
    return {
        "dotdot": f"{media}/../{rel_fifo}",
        "dotdot deep": f"{media}/sub/../../{rel_fifo}",
        "dotdot in a prefix-sharing sibling": f"{media}/../{env.media.name}_evil/x.mp4",
        "absolute elsewhere": str(env.outside / "secret" / "episode.mp4"),
        "double slash": "/" + str(env.outside / "secret" / "episode.mp4"),
        "symlink to a file outside": f"{media}/link_to_file.mp4",
        "symlink to a dir outside": f"{media}/link_to_dir/episode.mp4",
        "relative symlink climbing out": f"{media}/sub/up.mp4",
        "symlink to /dev/zero": f"{media}/link_to_dev_zero.mp4",
        "/etc/passwd": "/etc/passwd",
        "/proc/self/environ": "/proc/self/environ",
        "/dev/zero": "/dev/zero",
    }


@pytest.mark.parametrize("name", ["dotdot", "dotdot deep", "dotdot in a prefix-sharing sibling",
                                  "absolute elsewhere", "double slash", "symlink to a file outside",
                                  "symlink to a dir outside", "relative symlink climbing out",
                                  "symlink to /dev/zero", "/etc/passwd", "/proc/self/environ", "/dev/zero"])
def test_path_escapes_are_403_and_open_nothing(env, escapes, name):
    error = expect(_score(env, _escape_paths(env)[name]), 403, "media_forbidden", "video_path")
    assert "allowed_media_roots" in error["message"]
    assert "secret" not in error["message"]  # says nothing about the target
    assert_unopened(escapes["fifo"])


@pytest.mark.parametrize("path", ["episode.mp4", "./episode.mp4", "~/episode.mp4", "file:///etc/passwd",
                                  "", " /etc/passwd", "../outside/secret/episode.mp4"])
def test_relative_paths_are_refused(env, escapes, path):
    expect(_score(env, path), 422, "invalid_request", "video_path", mentions="absolute")
    assert_unopened(escapes["fifo"])


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_nul_byte_in_video_path(env, where):
    root = env.media if where == "inside" else env.outside
    response = _score(env, f"{root}/a\x00b.mp4")
    assert response.status_code in (403, 422), response.text
    assert response.json()["error"]["field"] == "video_path"


def test_overlong_file_name_in_video_path(env):
    expect(_score(env, f"{env.media}/{'x' * 300}.mp4"), 422, "media_not_found", "video_path")


def test_symlink_loop_in_video_path(env):
    loop = env.media / "loop.mp4"
    if not loop.is_symlink():
        loop.symlink_to(loop.name)
    response = _score(env, loop)
    assert response.status_code in (403, 422), response.text
    assert response.json()["error"]["field"] == "video_path"
