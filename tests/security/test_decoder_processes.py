"""Video files are decoded in supervised worker processes (issue 40): a decoder that crashes, runs
out of its memory limit or hangs costs the one request whose file did it — a 422
`media_decoder_failed` naming the file and the cause, not retried — while requests on the other
processes answer as usual and the proxy stays healthy.

The proxy runs as its own process (tests/security/_media_stack.py) with the test-only crash hook
in its environment (proxy/media/decoder_process.py: CRASH_HOOK_ENV): a file named `crash*` makes its
decoder wait on a FIFO mid-decode, then SIGSEGV; `segv*` crashes at once. The hook is read only
from the environment of a proxy that a test started for it.
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import os
import re
import tomllib
from collections.abc import Iterator

import cv2
import psutil
import pytest

from proxy.media.decoder_process import CRASH_HOOK_ENV
from tests.fakes.episodes import episode_frames, write_mp4
from tests.fakes.media_corpus import large_mp4, oversized_frame_avi
from tests.helpers import HANG_S, REPO
from tests.security._media_stack import MediaStack, media_stack, refusal

WORKERS = 2
# The first opencv-python(-headless) release that bundles FFmpeg 8.1.2 (CVE-2026-40962 fixed in
# 8.1): OpenCV's build information names FFmpeg's library versions, which point releases keep.
OPENCV_FLOOR = (4, 14, 0, 94)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[MediaStack]:
    base = tmp_path_factory.mktemp("decoders")
    fifo = base / "crash.fifo"
    os.mkfifo(fifo)
    with media_stack(base, env={CRASH_HOOK_ENV: str(fifo)}, media_workers=WORKERS) as s:
        yield s


def _failed(response, name: str, cause: str) -> dict:
    error = refusal(response, 422, "media_decoder_failed")
    assert error["cause"] == cause and name in error["message"] and error["retryable"] is False, error
    return error


def test_a_decoder_killed_mid_decode_fails_its_request_only(stack):
    episodes = [write_mp4(stack.media / f"ep{i}.mp4", episode_frames(20 + i, 64, 64)) for i in range(4)]
    expected = {path: stack.score(path).json()["frames"]["sha256"] for path in episodes}
    crash = write_mp4(stack.media / "crash.mp4", episode_frames(40, 64, 64))
    fifo = stack.media.parent / "crash.fifo"
    with concurrent.futures.ThreadPoolExecutor(len(episodes) + 2) as pool:
        crashing = pool.submit(stack.score, crash)
        # Opening the FIFO returns once the crashing decoder has opened it: it is mid-decode.
        writer = pool.submit(os.open, fifo, os.O_WRONLY).result(timeout=HANG_S)
        others = {path: pool.submit(stack.score, path) for path in episodes}
        os.close(writer)  # the decoder reads end-of-file, and kills itself
        error = _failed(crashing.result(timeout=HANG_S), "crash.mp4", "signal")
        assert "SIGSEGV" in error["message"]
        for path, answer in others.items():
            response = answer.result(timeout=HANG_S)
            assert response.status_code == 200, response.text
            assert response.json()["frames"]["sha256"] == expected[path]
    assert stack.score(episodes[0]).status_code == 200
    assert stack.client.get("/health").json()["status"] == "ok"


def test_every_route_that_reads_a_video_file_decodes_it_in_a_decoder_process(stack):
    segv = write_mp4(stack.media / "segv.mp4", episode_frames(20, 64, 64))
    good = write_mp4(stack.media / "good.mp4", episode_frames(20, 64, 64))
    _failed(stack.score(segv), "segv.mp4", "signal")
    _failed(stack.client.post("/score/dense", json={"task_text": "t", "video_path": str(segv), "points": 2}),
            "segv.mp4", "signal")
    _failed(stack.client.post("/compare", json={"task_text": "t", "episodes": [
        {"video_path": str(good)}, {"video_path": str(segv)}]}), "segv.mp4", "signal")
    batch = stack.client.post("/score/batch", json={"items": [{"task_text": "t", "video_path": str(good)},
                                                              {"task_text": "t", "video_path": str(segv)}]})
    first, second = batch.json()["results"]
    assert first["ok"] and second["status"] == 422 and second["error"]["code"] == "media_decoder_failed"
    assert stack.client.get("/health").json()["status"] == "ok"


def test_the_oversized_frame_file_is_refused_and_a_4096_square_video_decodes(stack):
    # An MJPEG AVI stating 64x64 with one 12000x12000 frame: FFmpeg allocates 216 MiB for it before
    # OpenCV scales it; the decoder's limit for a 64x64 video is far below that.
    liar = oversized_frame_avi(stack.media / "liar.avi")
    before = stack.chat_count()
    error = _failed(stack.score(liar), "liar.avi", "memory")
    assert "memory limit" in error["message"]
    assert stack.chat_count() == before
    big = large_mp4(stack.media / "big.mp4", 4096, 3)
    response = stack.score(big, nframes=3)
    assert response.status_code == 200, response.text
    assert response.json()["frames"]["source_count"] == 3


def test_the_bundled_ffmpeg_is_a_known_one():
    """pip's version of the OpenCV wheel is the only name of its FFmpeg point release."""
    installed = importlib.metadata.version("opencv-python-headless")
    assert tuple(int(part) for part in installed.split(".")[:4]) >= OPENCV_FLOOR, installed
    avformat = re.search(r"avformat:\s+YES \((\d+)\.(\d+)", cv2.getBuildInformation())
    assert avformat is not None and int(avformat.group(1)) >= 62  # FFmpeg 8's libavformat
    pinned = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["server"]
    assert any(req.startswith("opencv-python-headless>=" + ".".join(map(str, OPENCV_FLOOR))) for req in pinned)


def test_a_decoder_that_died_while_idle_is_replaced_not_blamed_on_the_next_file(stack):
    """An idle decoder killed from outside (the kernel's out-of-memory killer, an operator): the next
    video is decoded by a fresh process and answers 200; its file is not refused."""
    episode = write_mp4(stack.media / "after-idle-death.mp4", episode_frames(12, 64, 64))
    assert stack.score(episode).status_code == 200  # a decoder is started and left idle
    # The decoders are the forkserver's children (the forkserver itself must live on to fork more).
    servers = [p for p in psutil.Process(stack.proxy.proc.pid).children(recursive=True)
               if "forkserver" in " ".join(p.cmdline())]
    decoders = [child for server in servers for child in server.children()]
    assert decoders, "no decoder process was left idle"
    for decoder in decoders:
        decoder.kill()
    psutil.wait_procs(decoders, timeout=HANG_S)
    for _ in range(WORKERS + 1):  # whichever idle process each request would have taken
        response = stack.score(episode)
        assert response.status_code == 200, response.text
