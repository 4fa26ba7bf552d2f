"""Media reads cannot leave the root (issue 24, item 2): a video_path is opened once, checked as
opened and decoded from that descriptor; only the documented containers are read, by content;
FFmpeg is pinned to the one file. Every escape is a 4xx before anything reaches vLLM, and no frame
from outside a root is decoded: the outside targets are FIFOs (an open would be seen) or videos
whose frames would reach the fake vLLM (which must receive nothing)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import cv2
import httpx
import pytest
import yaml

from proxy.config import load_settings, settings_from_dict
from proxy.errors import ConfigError, MediaFormatRefused
from proxy.media.budget import DecodeBudget
from proxy.media.decode import FrameLimits
from proxy.media.file import FFMPEG_CAPTURE_OPTIONS, open_video, prepare_media_roots
from proxy.media.video import read_video
from tests.conftest import libero_settings_dict
from tests.fakes.episodes import _write_video, episode_frames, write_lossless_video, write_mp4
from tests.helpers import REPO, assert_unopened
from tests.security._media_stack import MediaStack, media_stack, refusal

LIMITS = FrameLimits(nframes=4, max_pixels=200_704, min_pixels=100_352, video_max_pixels=602_112,
                     total_pixels=90_316_800, image_min_pixels=3136, stills=False, jpeg_quality=90,
                     default_source_fps=4.0, max_inline_frames=2048, max_source_pixels=4096 * 4096)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[MediaStack]:
    with media_stack(tmp_path_factory.mktemp("media_root")) as s:
        yield s


@pytest.fixture(scope="module")
def outside_targets(stack) -> dict[str, Path]:
    """A real video and a FIFO, both outside every root."""
    fifo = stack.outside / "pipe.mp4"
    os.mkfifo(fifo)
    return {"video": write_mp4(stack.outside / "secret.mp4", episode_frames(12, 64, 64)), "fifo": fifo}


def _playlist(target: Path) -> str:
    return (f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXT-X-MEDIA-SEQUENCE:0\n#EXTINF:10.0,\n{target}\n"
            "#EXT-X-ENDLIST\n")


@pytest.mark.parametrize("name", ["ep.m3u8", "ep.mp4"])
@pytest.mark.parametrize("target", ["video", "fifo"])
def test_a_playlist_naming_an_outside_file_is_refused_by_content(stack, outside_targets, name, target):
    path = stack.media / f"{target}_{name}"
    path.write_text(_playlist(outside_targets[target]))
    before = stack.chat_count()
    error = refusal(stack.score(path), 422, "media_format_refused")
    assert error["detected"] == "HLS playlist" and error["field"] == "video_path"
    assert stack.chat_count() == before  # no frame of the outside video went anywhere
    assert_unopened(outside_targets["fifo"])
    assert stack.client.get("/health").status_code == 200


def test_an_ffconcat_list_is_refused(stack, outside_targets):
    path = stack.media / "list.mp4"
    path.write_text(f"ffconcat version 1.0\nfile {outside_targets['video']}\nfile {outside_targets['fifo']}\n")
    before = stack.chat_count()
    assert refusal(stack.score(path), 422, "media_format_refused")["detected"] == "ffconcat list"
    assert stack.chat_count() == before
    assert_unopened(outside_targets["fifo"])


def test_a_playlist_behind_an_mp4_box_never_reaches_the_hls_demuxer(stack, outside_targets):
    """Passes the content check (it starts with an `ftyp` box) but FFmpeg may only use the MOV, AVI
    and Matroska demuxers on the file protocol: at most a decode error, never the outside frames."""
    path = stack.media / "disguised.mp4"
    path.write_bytes(b"\x00\x00\x00\x10ftypisom\x00\x00\x00\x00" + _playlist(outside_targets["fifo"]).encode())
    before = stack.chat_count()
    refusal(stack.score(path), 422, "media_decode_error")
    assert stack.chat_count() == before
    assert_unopened(outside_targets["fifo"])


@pytest.mark.parametrize(("name", "write"), [
    ("ep.avi", lambda p, f: write_lossless_video(p, f)), ("ep.mkv", lambda p, f: _write_video(p, f, 20, "MJPG")),
    ("ep.mov", lambda p, f: write_mp4(p, f)),
    ("no_extension", lambda p, f: write_mp4(p.with_suffix(".mp4"), f).rename(p))])
def test_the_documented_containers_are_scored_whatever_the_name(stack, name, write):
    path = write(stack.media / name, episode_frames(10, 64, 64))
    response = stack.score(path)
    assert response.status_code == 200, response.text
    assert response.json()["frames"]["source_count"] == 10


def test_ffmpeg_is_pinned_to_the_file_protocol_and_the_documented_demuxers(tmp_path):
    """Set once on import of proxy.media.file (read by OpenCV at every open): even by name, a
    playlist that FFmpeg would follow out of the directory does not open."""
    assert os.environ["OPENCV_FFMPEG_CAPTURE_OPTIONS"] == FFMPEG_CAPTURE_OPTIONS
    secret = write_mp4(tmp_path / "secret.mp4", episode_frames(4, 32, 32))
    playlist = tmp_path / "ep.m3u8"
    playlist.write_text(_playlist(secret))
    capture = cv2.VideoCapture(str(playlist), cv2.CAP_FFMPEG)
    try:
        assert not capture.isOpened()
    finally:
        capture.release()


def test_the_decode_reads_the_opened_file_not_the_name(tmp_path):
    """A name swapped after the check (another file renamed over it, or a symlink to a file outside)
    changes nothing: FFmpeg reads /proc/self/fd/N, the file that was checked."""
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    checked = write_mp4(root / "ep.mp4", episode_frames(10, 64, 64))
    decoys = [write_mp4(root / "other.mp4", episode_frames(20, 64, 64)),
              write_mp4(elsewhere / "secret.mp4", episode_frames(30, 64, 64))]
    for swap in ("rename", "symlink"):
        with open_video(str(checked), [root]) as video:
            assert video.decode_path == f"/proc/self/fd/{video.fd}"
            assert os.readlink(video.decode_path) == str(checked)
            if swap == "rename":
                os.replace(decoys[0], checked)
            else:
                checked.unlink()
                checked.symlink_to(decoys[1])
            decoded = read_video(video, LIMITS, lambda count: [list(range(min(count, 4)))],
                                 DecodeBudget.unbounded())
        assert decoded.count == 10  # the checked file's frames, not the decoy's 20 or 30
        checked.unlink()
        write_mp4(checked, episode_frames(10, 64, 64))


def test_a_file_replaced_by_a_symlink_is_not_followed(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    secret = write_mp4(tmp_path / "secret.mp4", episode_frames(4, 32, 32))
    (root / "ep.mp4").symlink_to(secret)
    with pytest.raises(Exception) as refused:
        open_video(str(root / "ep.mp4"), [root])
    assert refused.value.code == "media_forbidden"


def test_content_sniffing_names_what_it_refuses(tmp_path):
    root = tmp_path
    for name, content, detected in [("a.mp4", b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "PNG image"),
                                    ("b.mp4", b"<?xml version='1.0'?><MPD/>", "XML (e.g. a DASH manifest)"),
                                    ("c.avi", b"RIFF\x00\x00\x00\x00WAVEfmt ", "RIFF (not AVI)")]:
        (root / name).write_bytes(content)
        with pytest.raises(MediaFormatRefused) as refused:
            open_video(str(root / name), [root])
        assert refused.value.details["detected"] == detected


def test_a_missing_media_root_is_created_owner_only(tmp_path):
    root = tmp_path / "run" / "media"
    prepare_media_roots([root])
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_a_world_writable_media_root_is_refused_at_start_up(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp itself
    with pytest.raises(ConfigError, match="writable by every local user"):
        prepare_media_roots([shared])
    with pytest.raises(ConfigError, match="writable by every local user"):
        prepare_media_roots([Path("/tmp")])


def test_a_root_through_another_users_symlink_is_refused_at_start_up(tmp_path):
    # /tmp/<name> -> / planted by another local user: / is root's and not world-writable, so only
    # the link itself says who chose the root.
    if os.geteuid() != 0:
        pytest.skip("only root can make a link another user owns (CI runs as root)")
    planted = tmp_path / "vlm-reward-media"
    planted.symlink_to("/")
    os.lchown(planted, 54321, 54321)
    with pytest.raises(ConfigError, match="symbolic link another user owns"):
        prepare_media_roots([planted])
    with pytest.raises(ConfigError, match="symbolic link another user owns"):
        prepare_media_roots([planted / "tmp"])  # a link on the way counts as much as the last one


def test_a_root_through_ones_own_symlink_is_its_real_directory(tmp_path):
    real = tmp_path / "disk" / "media"
    real.mkdir(parents=True, mode=0o700)
    (tmp_path / "media").symlink_to(real)
    assert prepare_media_roots([tmp_path / "media"]) == [real]


def test_a_root_replaced_by_a_symlink_while_the_proxy_runs_moves_nothing(
        tmp_path, proxy_factory, fake_qwen, fake_primo):
    # A proxy of its own: the test replaces its media root (a tmp cleaner removed the idle
    # directory, someone put a link to another tree in its place). Runs as root in CI (chown).
    root, elsewhere = tmp_path / "media", tmp_path / "elsewhere"
    root.mkdir(mode=0o700)
    elsewhere.mkdir()
    inside = write_mp4(root / "ep.mp4", episode_frames(12, 64, 64))
    secret = write_mp4(elsewhere / "secret.mp4", episode_frames(12, 64, 64))
    server = proxy_factory(settings_from_dict(libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], root)))
    with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as http:
        score = lambda path: http.post("/score", json={"task_text": "t", "video_path": str(path)})  # noqa: E731
        assert score(inside).status_code == 200
        root.rename(tmp_path / "media.old")
        root.symlink_to(elsewhere)
        before = len(fake_qwen.chat_requests)
        for path in (root / "secret.mp4", secret):
            refusal(score(path), 403, "media_forbidden")
        # made again as a plain directory, by another user (review of this stop's fix: the real
        # path is the same string, so only who owns it tells)
        if os.geteuid() != 0:
            pytest.skip("only root can give a directory to another user (CI runs as root)")
        root.unlink()
        root.mkdir()
        write_mp4(root / "planted.mp4", episode_frames(12, 64, 64))
        os.chown(root, 54321, 54321)
        refusal(score(root / "planted.mp4"), 403, "media_forbidden")
        os.chown(root, os.getuid(), os.getgid())  # put right: served again
        assert score(root / "planted.mp4").status_code == 200
        assert len(fake_qwen.chat_requests) == before + 1


@pytest.mark.parametrize("config", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_use_a_dedicated_media_directory(config):
    if "allowed_media_roots" not in (yaml.safe_load(config.read_text()).get("proxy") or {}):
        pytest.skip("no media roots in this config")
    roots = load_settings(config).proxy.allowed_media_roots
    assert roots and all(root.resolve() != Path("/tmp") and root != Path("/tmp") for root in roots)
