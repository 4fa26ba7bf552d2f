"""A memory budget per request (issue 24, item 3): decoded frames a request holds at once (one
source frame plus every frame at its sent size) against proxy.max_decoded_mb, and a frame-count
and duration cap on video files, each a 413 `media_budget_exceeded` naming the cap and what the
request would need, before any upstream call. The budgets are set low here to prove the rule on
small files; bench/bench_media_budget.py measures the proxy's memory under the default caps."""

from __future__ import annotations

import asyncio
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import cv2
import pytest

from proxy.errors import MediaBudgetExceeded
from proxy.media.budget import DecodeBudget, DecodeCancelled, MediaCaps
from proxy.media.decode import FrameLimits
from proxy.media.encode import prefix_indices, prepare_frames
from proxy.media.executor import MediaExecutor
from proxy.media.file import open_video
from proxy.media.frame_plan import planned_bytes, target_sizes
from proxy.media.mp4_index import IndexTooLarge, claimed_samples
from proxy.media.video import read_video
from tests.fakes.episodes import _write_video, episode_frames, images_b64, write_mp4
from tests.fakes.mp4_boxes import index_bomb, track_tables, with_fragment_runs, with_tracks
from tests.security._media_stack import MediaStack, media_stack, refusal

BUDGET_MB = 8  # 16 frames at the video floor (~300 KB each) fit; 32 do not
LIMITS = FrameLimits(nframes=16, max_pixels=200_704, min_pixels=100_352, video_max_pixels=602_112,
                     total_pixels=90_316_800, image_min_pixels=3136, stills=True, jpeg_quality=90,
                     default_source_fps=4.0, max_inline_frames=2048, max_source_pixels=4096 * 4096)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[MediaStack]:
    with media_stack(tmp_path_factory.mktemp("media_budget"), max_decoded_mb=BUDGET_MB, max_video_frames=60,
                     max_video_seconds=10) as s:
        yield s


@pytest.fixture(scope="module")
def episode(stack) -> Path:
    return write_mp4(stack.media / "forty.mp4", episode_frames(40, 64, 64))


def _over_budget(stack, response, limit: str) -> dict:
    error = refusal(response, 413, "media_budget_exceeded")
    assert error["limit"] == limit and limit in error["message"], error
    return error


def test_score_within_the_budget_is_scored_and_over_it_is_413_before_upstream(stack, episode):
    assert stack.score(episode).status_code == 200
    before = stack.chat_count()
    error = _over_budget(stack, stack.score(episode, nframes=32), "proxy.max_decoded_mb")
    assert error["needed"] > BUDGET_MB and f"{error['needed']:.1f} MiB" in error["message"]
    assert stack.chat_count() == before


def test_inline_frames_are_held_to_the_same_budget(stack):
    frames = images_b64(episode_frames(40, 64, 64))
    ok = stack.client.post("/score", json={"task_text": "t", "frames": frames})
    assert ok.status_code == 200, ok.text
    before = stack.chat_count()
    _over_budget(stack, stack.client.post("/score", json={"task_text": "t", "frames": frames, "nframes": 32}),
                 "proxy.max_decoded_mb")
    assert stack.chat_count() == before


def test_dense_keeps_sent_size_frames_within_one_budget(stack, episode):
    ok = stack.client.post("/score/dense", json={"task_text": "t", "video_path": str(episode), "points": 2,
                                                 "nframes": 4})
    assert ok.status_code == 200, ok.text
    before = stack.chat_count()
    _over_budget(stack, stack.client.post("/score/dense", json={"task_text": "t", "video_path": str(episode),
                                                                "points": 8}), "proxy.max_decoded_mb")
    assert stack.chat_count() == before


def test_batch_items_each_have_the_budget(stack, episode):
    items = [{"task_text": "t", "video_path": str(episode)}, {"task_text": "t", "video_path": str(episode),
                                                               "nframes": 32}]
    response = stack.client.post("/score/batch", json={"items": items})
    assert response.status_code == 200, response.text
    first, second = response.json()["results"]
    assert first["ok"] and not second["ok"]
    assert second["status"] == 413 and second["error"]["code"] == "media_budget_exceeded"


def test_a_video_claiming_more_frames_than_the_cap_is_413(stack):
    path = write_mp4(stack.media / "eighty.mp4", episode_frames(80, 32, 32))
    before = stack.chat_count()
    error = _over_budget(stack, stack.score(path), "proxy.max_video_frames")
    assert error["needed"] == 80 and "claims" in error["message"]
    assert stack.chat_count() == before


def test_a_video_found_longer_than_its_container_says_stops_at_the_cap(stack):
    """An AVI whose headers claim 10 frames and that holds 80: found while decoding, refused at 61."""
    path = _write_video(stack.media / "liar.avi", episode_frames(80, 32, 32), 20, "MJPG")
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, data.find(b"avih") + 8 + 16, 10)  # dwTotalFrames
    struct.pack_into("<I", data, data.find(b"strh") + 8 + 32, 10)  # dwLength
    path.write_bytes(bytes(data))
    error = _over_budget(stack, stack.score(path), "proxy.max_video_frames")
    assert error["needed"] == 61 and "has at least" in error["message"]


def test_a_video_longer_than_the_duration_cap_is_413(stack):
    path = write_mp4(stack.media / "slow.mp4", episode_frames(30, 32, 32), fps=2)  # 15 s
    _over_budget(stack, stack.score(path), "proxy.max_video_seconds")
    assert stack.client.get("/health").status_code == 200


def test_an_mp4_whose_index_claims_millions_of_samples_is_refused_before_ffmpeg_opens_it(stack):
    # 1 KB on disk; FFmpeg's MOV demuxer built an entry per claimed sample while opening it: 3 GB
    # of memory in cv2.VideoCapture() before the frame cap could be checked (found by review).
    bomb = index_bomb(write_mp4(stack.outside / "small.mp4", episode_frames(12, 32, 32)),
                      stack.media / "bomb.mp4", 85_000_000)
    assert bomb.stat().st_size < 4096
    before = stack.chat_count()
    error = _over_budget(stack, stack.score(bomb), "proxy.max_video_frames")
    assert error["needed"] == 85_000_000 and "refused before it is opened" in error["message"], error
    assert stack.chat_count() == before
    assert stack.score(write_mp4(stack.media / "twelve.mp4", episode_frames(12, 32, 32))).status_code == 200


def test_the_index_is_counted_from_the_boxes_and_ffmpeg_never_sees_a_lying_one(tmp_path, monkeypatch):
    real = write_mp4(tmp_path / "twelve.mp4", episode_frames(12, 32, 32))
    fragmented = with_fragment_runs(real, tmp_path / "fragmented.mp4", 5_000_000)
    bomb = index_bomb(real, tmp_path / "bomb.mp4", 85_000_000)
    for path, claimed in ((real, 12), (fragmented, 12 + 5_000_000), (bomb, 85_000_000)):
        fd = os.open(path, os.O_RDONLY)
        try:
            assert claimed_samples(fd, path.stat().st_size) == claimed
        finally:
            os.close(fd)

    def no_open(*args, **kwargs):
        raise AssertionError("FFmpeg was given a file whose index claims millions of samples")

    monkeypatch.setattr(cv2, "VideoCapture", no_open)
    for path in (fragmented, bomb):
        with open_video(str(path), [tmp_path]) as video, pytest.raises(MediaBudgetExceeded, match="index claims"):
            read_video(video, LIMITS, lambda count: [prefix_indices(count, 16, None)], DecodeBudget(MediaCaps(
                2**40, 4096, 600)))


def _claimed(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return claimed_samples(fd, path.stat().st_size)
    finally:
        os.close(fd)


def test_every_tracks_index_counts_and_uncompressed_audio_counts_by_chunk(tmp_path):
    # found by review of the first version: it took the largest track (50 tracks of 65,536 samples
    # each passed, 123 MB at open), refused a MOV with 10 s of PCM audio (480,000 samples, which
    # FFmpeg indexes per chunk), and never read a compressed header
    real = write_mp4(tmp_path / "twelve.mp4", episode_frames(12, 32, 32))
    many = with_tracks(real, tmp_path / "many.mp4", [track_tables(b"vide", 65_536, 100, 65_536, 1)] * 50)
    assert _claimed(many) == 12 + 50 * 65_536
    pcm = with_tracks(real, tmp_path / "pcm.mov", [track_tables(b"soun", 480_000, 2, 4800, 100)])
    assert _claimed(pcm) == 12 + 100 * 5  # 100 chunks of 4800 samples: 5 entries each
    audio_bomb = with_tracks(real, tmp_path / "audio.mov", [track_tables(b"soun", 10, 2, 4_000_000_000, 10)])
    assert _claimed(audio_bomb) == 12 + 10 * 3_906_250
    compressed = with_tracks(real, tmp_path / "cmov.mov", [], extra_moov=struct.pack(">I4s", 16, b"cmov") + b"\0" * 8)
    with pytest.raises(IndexTooLarge, match="cmov"):
        _claimed(compressed)
    caps = MediaCaps(2**40, 4096, 600)  # the index allows 16 x 4096 = 65,536 entries
    for path, ok in ((pcm, True), (many, False), (audio_bomb, False), (compressed, False)):
        with open_video(str(path), [tmp_path]) as video:
            if ok:
                read_video(video, LIMITS, lambda count: [prefix_indices(count, 16, None)], DecodeBudget(caps))
            else:
                with pytest.raises(MediaBudgetExceeded, match="index"):
                    read_video(video, LIMITS, lambda count: [prefix_indices(count, 16, None)], DecodeBudget(caps))


def test_frames_are_brought_to_their_sent_size_as_they_are_decoded(tmp_path):
    """A request holds its sent-size frames plus one source frame: the peak is exactly the plan,
    a fraction of the 16 source frames the old decode kept."""
    path = write_mp4(tmp_path / "big.mp4", episode_frames(40, 720, 1280))
    budget = DecodeBudget(MediaCaps(2**40, 4096, 600))
    encoded = prepare_frames(LIMITS, budget, video_path=path, media_roots=[tmp_path])
    targets = target_sizes(LIMITS, [prefix_indices(40, 16, None)], 720, 1280, "video_path")
    assert budget.peak_bytes == planned_bytes(targets, 720, 1280)
    assert budget.peak_bytes * 3 < 16 * 720 * 1280 * 3  # the old decode held 16 source frames (44 MB)
    assert (encoded.height, encoded.width) in targets[0] and len(encoded.jpegs) == 16


def test_the_container_plan_is_refused_before_the_first_frame(tmp_path):
    path = write_mp4(tmp_path / "big.mp4", episode_frames(20, 720, 1280))
    budget = DecodeBudget(MediaCaps(2 * 2**20, 4096, 600))  # less than one source frame and its sizes
    with open_video(str(path), [tmp_path]) as video, pytest.raises(MediaBudgetExceeded) as refused:
        read_video(video, LIMITS, lambda count: [prefix_indices(count, 16, None)], budget)
    assert budget.peak_bytes == 0  # nothing was decoded
    assert refused.value.details["limit"] == "proxy.max_decoded_mb"


async def test_a_cancelled_request_stops_decoding_and_the_workers_run_one_opencv_thread(tmp_path):
    executor = MediaExecutor(1, MediaCaps(2**40, 10**6, 10**6))
    started, finished, seen = threading.Event(), threading.Event(), []

    def decode_until_cancelled(budget: DecodeBudget) -> None:
        seen.append(cv2.getNumThreads())
        started.set()
        try:
            while True:  # a decode loop's checkpoint between frames
                budget.checkpoint()
                finished.wait(0.01)
        except DecodeCancelled:
            seen.append("cancelled")
        finally:
            finished.set()

    try:
        task = asyncio.ensure_future(executor.run(decode_until_cancelled))
        assert await asyncio.to_thread(started.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(finished.wait, 10)
        assert seen == [1, "cancelled"]
    finally:
        executor.close()
