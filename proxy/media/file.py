"""A `video_path` opened once, checked as opened, and decoded only from that descriptor.

The path is checked against the roots (symlinks resolved), then opened without following a last
symlink and without blocking (a FIFO never hangs the proxy); the *opened* file is checked again —
a regular file whose real name, read back from /proc/self/fd, is the name that was checked — and
FFmpeg reads `/proc/self/fd/N`, the open file itself: a name swapped after the check redirects
nothing. Its first bytes must be a container the API documents (MP4/MOV, AVI, MKV/WebM); a
playlist, a concat list or anything else is refused before a demuxer sees it, and FFmpeg itself is
pinned to the file protocol and those demuxers (no HLS, concat, image2; no MOV data references).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from proxy.errors import ConfigError, InvalidRequest, MediaForbidden, MediaFormatRefused, MediaNotFound

__all__ = ["FFMPEG_CAPTURE_OPTIONS", "OpenedVideo", "checked_path", "describe_bytes", "open_video",
           "prepare_media_roots", "sniff_container", "sniff_image"]

# OpenCV hands these to avformat_open_input on every capture it opens (it reads the variable then):
# only the file protocol, only the documented demuxers (mov = MP4/MOV, avi, matroska = MKV/WebM),
# and no MOV external data references (FFmpeg's default, made explicit). Set here, once, on import:
# every capture the proxy opens is opened after `open_video` was imported.
FFMPEG_CAPTURE_OPTIONS = "protocol_whitelist;file|format_whitelist;mov,avi,matroska|enable_drefs;0"
os.environ["OPENCV_FFMPEG_CAPTURE_OPTIONS"] = FFMPEG_CAPTURE_OPTIONS

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_SNIFF_BYTES = 64
# First ISO-BMFF / QuickTime box types a MOV or MP4 starts with.
_MOV_BOXES = {b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot"}
_REFUSED_SIGNATURES = (  # what a refused file is, for the error message
    (b"#EXTM3U", "HLS playlist"), (b"ffconcat", "ffconcat list"), (b"\xff\xd8\xff", "JPEG image"),
    (b"\x89PNG\r\n\x1a\n", "PNG image"), (b"GIF8", "GIF image"), (b"BM", "BMP image"),
    (b"\x93NUMPY", "npy array"), (b"PK\x03\x04", "ZIP archive"), (b"\x7fELF", "ELF executable"),
    (b"<?xml", "XML (e.g. a DASH manifest)"), (b"OggS", "Ogg"), (b"\x00\x00\x01\xba", "MPEG-PS"),
)


def sniff_container(head: bytes) -> tuple[str | None, str]:
    """(the accepted container, or None; what the bytes are) from a file's first bytes."""
    if len(head) >= 8 and head[4:8] in _MOV_BOXES:
        return "MP4/MOV", "MP4/MOV"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "AVI", "AVI"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "MKV/WebM", "MKV/WebM"
    return None, describe_bytes(head)


def sniff_image(head: bytes) -> str | None:
    """'JPEG' or 'PNG' (the inline image formats the API documents), else None."""
    if head[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    return None


def describe_bytes(head: bytes) -> str:
    """What a refused file or image is, by its first bytes (for the error message)."""
    if not head:
        return "empty file"
    if head[:4] == b"RIFF":
        return "RIFF (not AVI)"
    for signature, name in _REFUSED_SIGNATURES:
        if head.startswith(signature):
            return name
    return "text" if all(32 <= b < 127 or b in b"\t\r\n" for b in head) else "unknown"


@dataclass
class OpenedVideo:
    """A checked `video_path`: its descriptor, the name FFmpeg decodes (that descriptor) and the
    container its first bytes show. A context manager: the descriptor is closed on exit."""

    fd: int
    name: str  # the file's base name, for messages (never the path: it says nothing of the disk)
    container: str
    size: int

    @property
    def decode_path(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OpenedVideo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def checked_path(video_path: str, allowed_roots: list[Path]) -> Path:
    """The real file behind `video_path`, only if it lies under an allowed root (symlinks resolved)."""
    if not allowed_roots:
        raise MediaForbidden("video_path is disabled: proxy.allowed_media_roots is empty", field="video_path")
    if "\x00" in video_path:
        raise InvalidRequest("video_path holds a NUL character", field="video_path")
    raw = Path(video_path)
    if not raw.is_absolute():
        raise InvalidRequest("video_path must be an absolute path", field="video_path")
    try:
        resolved = raw.resolve()
    except (OSError, RuntimeError) as err:  # symlink loop, name too long, ...
        raise MediaNotFound(f"video_path cannot be resolved: {type(err).__name__}", field="video_path") from err
    if not _under_a_root(resolved, allowed_roots):
        # The roots are named (a caller who may score is told where to write); whether the file
        # exists is not (that would leak the filesystem).
        roots = ", ".join(str(root) for root in allowed_roots)
        raise MediaForbidden(f"video_path is outside proxy.allowed_media_roots ({roots}): write the episode "
                             "under one of them", field="video_path")
    return resolved


def open_video(video_path: str, allowed_roots: list[Path]) -> OpenedVideo:
    """Check, open once, check the opened file, sniff its container (blocking: call off the loop)."""
    resolved = checked_path(video_path, allowed_roots)
    not_a_file = MediaNotFound(f"video_path {video_path!r} does not exist or is not a file", field="video_path")
    try:
        if not stat.S_ISREG(os.stat(resolved).st_mode):  # never open a FIFO or a device at all
            raise not_a_file
        fd = os.open(resolved, _OPEN_FLAGS)
    except OSError as err:  # gone, a name too long, or replaced by a symlink since it was resolved
        raise not_a_file from err
    opened = OpenedVideo(fd, resolved.name, "", 0)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise not_a_file
        real = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if real != resolved or not _under_a_root(real, allowed_roots):
            # A directory on the way was swapped between the check and the open: what was opened is
            # not what was checked. Refuse rather than decode it.
            raise MediaForbidden("video_path changed while it was opened; it is refused",
                                 field="video_path")
        container, detected = sniff_container(os.pread(fd, _SNIFF_BYTES, 0))
        if container is None:
            raise MediaFormatRefused("video_path is not a documented video container (MP4/MOV, AVI, MKV/WebM): "
                                     f"its content is {detected}", field="video_path", detected=detected)
        opened.container, opened.size = container, info.st_size
        return opened
    except BaseException:
        opened.close()
        raise


def _under_a_root(path: Path, allowed_roots: list[Path]) -> bool:
    # The roots are real paths fixed at start-up (prepare_media_roots), never resolved again: a root
    # replaced by a symlink while the proxy runs moves nothing. And the root is still one this
    # user trusts: removed (a tmp cleaner) and made again by another user, or opened to every
    # user, it serves nothing until it is put right.
    return any(path.is_relative_to(root) and _distrust(root) is None for root in allowed_roots)


def _distrust(directory: Path) -> str | None:
    """Why this user cannot trust `directory` (its real path) as a media root, or None: the one
    rule, at start-up and on every read."""
    try:
        info = directory.lstat()
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_mode & stat.S_IWOTH:
        return ("is writable by every local user; use a dedicated directory (e.g. /tmp/vlm-reward-media, "
                "created 0700) instead")
    if info.st_uid not in (os.getuid(), 0):
        return f"is owned by another user (uid {info.st_uid}); use a directory this user (or root) owns"
    return None


def prepare_media_roots(allowed_roots: list[Path]) -> list[Path]:
    """At start-up: create a missing root owner-only (0700); refuse a root any local user may write
    to (world-writable, like /tmp itself), one another user owns (a squatted /tmp/<name>), or one
    reached through a symlink another user owns (/tmp/<name> -> /): whoever can write under a root,
    or choose where it points, chooses what the proxy decodes. Returns the roots' real paths, which
    the proxy checks every video_path against from then on."""
    real_roots = []
    for root in allowed_roots:
        if not root.exists() and not root.is_symlink():
            try:
                root.mkdir(mode=0o700, parents=True)
            except OSError as err:
                raise ConfigError(f"proxy.allowed_media_roots: cannot create {root}: {err.strerror}") from err
        for step in (root, *root.parents):
            if step.is_symlink() and (owner := step.lstat().st_uid) not in (os.getuid(), 0):
                raise ConfigError(f"proxy.allowed_media_roots: {root} goes through {step}, a symbolic link "
                                  f"another user owns (uid {owner}); name the directory itself")
        try:
            real = root.resolve(strict=True)
        except (OSError, RuntimeError) as err:
            raise ConfigError(f"proxy.allowed_media_roots: {root} cannot be resolved: {type(err).__name__}") from err
        why = _distrust(real)
        if why is not None:
            raise ConfigError(f"proxy.allowed_media_roots: {root} {why}")
        real_roots.append(real)
    return real_roots
