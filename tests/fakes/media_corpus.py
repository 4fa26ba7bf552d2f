"""Hostile video files, made here from small valid ones: what an attacker with write access to a
media root could place there (tests/security/test_decoder_processes.py, tests/bad_input/test_video_fuzz.py,
bench/bench_video_fuzz.py).

`oversized_frame_avi`: an MJPEG AVI whose headers state 64x64 and whose last frame is a
12000x12000 JPEG (2.2 MB: every block a flat grey), which FFmpeg decodes at its real size (216 MiB
of YUV) before OpenCV scales it to the stated one. `mutants`: seeded mutations of valid MP4, AVI
and MKV files — bit flips, truncation, box/chunk/element sizes rewritten, index tables inflated.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np

from tests.fakes.episodes import _write_video, episode_frames

__all__ = ["MUTATIONS", "flat_jpeg", "large_mp4", "mutants", "oversized_frame_avi", "seed_videos"]

MUTATIONS = ("bit_flips", "truncate", "size_rewrite", "index_inflate")
_MP4_CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts", b"dinf", b"udta"}
_AVI_CHUNKS = (b"RIFF", b"LIST", b"avih", b"strh", b"strf", b"idx1", b"00dc", b"JUNK", b"indx", b"odml")
_MKV_IDS = (b"\x18\x53\x80\x67", b"\x1f\x43\xb6\x75", b"\x16\x54\xae\x6b", b"\x1c\x53\xbb\x6b", b"\xae", b"\xa3",
            b"\x15\x49\xa9\x66", b"\xe0", b"\x63\xa2")  # Segment, Cluster, Tracks, Cues, TrackEntry, ...


def flat_jpeg(side: int) -> bytes:
    """A side x side baseline JPEG (4:2:0) whose every block is flat grey, ~4 bytes per 16x16 block:
    OpenCV's headers and Huffman tables (the standard ones) from a 16x16 image, the size patched, and
    a scan in which each block is DC difference 0 ('00') then end-of-block ('1010' luma, '00' chroma)."""
    ok, small = cv2.imencode(".jpg", np.full((16, 16, 3), 128, np.uint8))
    assert ok
    data = bytes(small)
    sof = data.find(b"\xff\xc0")
    data = data[:sof + 5] + struct.pack(">HH", side, side) + data[sof + 9:]
    sos = data.find(b"\xff\xda")
    scan = sos + 2 + struct.unpack(">H", data[sos + 2:sos + 4])[0]
    blocks = ((side + 15) // 16) ** 2
    return data[:scan] + b"\x28\xa2\x8a\x00" * blocks + b"\xff\xd9"  # 4 luma + 2 chroma blocks: 32 bits


def oversized_frame_avi(path: Path, side: int = 12000) -> Path:
    """A 3-frame MJPEG AVI stating 64x64 whose last frame is a side x side JPEG."""
    small = _write_video(path, episode_frames(3, 64, 64), 4, "MJPG")
    data = bytearray(small.read_bytes())
    big = flat_jpeg(side)
    padded = big + b"\0" * (len(big) & 1)
    last = data.rfind(b"00dc", 0, data.find(b"idx1"))
    size = struct.unpack_from("<I", data, last + 4)[0]
    end = last + 8 + size + (size & 1)
    grow = len(padded) - (end - last - 8)
    data = data[:last + 4] + struct.pack("<I", len(big)) + padded + data[end:]
    movi = data.find(b"movi") - 8
    for at in (4, movi + 4):  # the RIFF and the movi list grow by the difference
        struct.pack_into("<I", data, at, struct.unpack_from("<I", data, at)[0] + grow)
    index = data.find(b"idx1")
    entries = struct.unpack_from("<I", data, index + 4)[0] // 16
    struct.pack_into("<I", data, index + 8 + (entries - 1) * 16 + 12, len(big))  # the last entry's size
    path.write_bytes(bytes(data))
    return path


def large_mp4(path: Path, side: int, count: int) -> Path:
    """`count` frames of side x side (MPEG-4), written one at a time: the test holds one frame, not all."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 4, (side, side))
    try:
        for i in range(count):
            writer.write(np.full((side, side, 3), 40 + 60 * i, np.uint8))
    finally:
        writer.release()
    return path


def seed_videos(folder: Path, frames: int = 8, side: int = 32) -> dict[str, bytes]:
    """Valid small files of each container the proxy reads: name → bytes."""
    episode = episode_frames(frames, side, side)
    made = {"seed.mp4": _write_video(folder / "seed.mp4", episode, 8, "mp4v"),
            "seed.avi": _write_video(folder / "seed.avi", episode, 8, "MJPG"),
            "seed.mkv": _write_video(folder / "seed.mkv", episode, 8, "mp4v"),
            "seed_ffv1.mkv": _write_video(folder / "seed_ffv1.mkv", episode, 8, "FFV1")}
    return {name: path.read_bytes() for name, path in made.items()}


def mutants(seeds: dict[str, bytes], count: int, seed: int) -> Iterator[tuple[str, str, bytes]]:
    """(file name, mutation, bytes), `count` of them, the same for the same seed."""
    rng = random.Random(seed)
    names = sorted(seeds)
    for i in range(count):
        name = names[i % len(names)]
        mutation = MUTATIONS[(i // len(names)) % len(MUTATIONS)]
        data = bytearray(seeds[name])
        for _ in range(rng.randint(1, 3)):  # stacked mutations find more than single ones
            data = _MUTATE[mutation](data, name, rng)
        yield f"m{i:05d}_{mutation}_{name}", mutation, bytes(data)


def _bit_flips(data: bytearray, name: str, rng: random.Random) -> bytearray:
    for _ in range(rng.choice((1, 2, 8, 32))):
        at = rng.randrange(16, len(data)) if len(data) > 16 else 0  # keep the signature: past the sniff
        data[at] ^= 1 << rng.randrange(8)
    return data


def _truncate(data: bytearray, name: str, rng: random.Random) -> bytearray:
    return data[:rng.randrange(12, max(13, len(data)))]


def _size_fields(data: bytearray, name: str) -> list[tuple[int, int, str]]:
    """(offset, byte width, byte order) of the size fields of the file's boxes, chunks or elements."""
    fields: list[tuple[int, int, str]] = []
    if name.endswith(".mp4"):
        def walk(start: int, end: int) -> None:
            at = start
            while at + 8 <= end:
                size, kind = struct.unpack_from(">I4s", data, at)
                fields.append((at, 4, ">"))
                if kind in _MP4_CONTAINERS:
                    walk(at + 8, min(end, at + size))
                if size < 8:
                    break
                at += size
        walk(0, len(data))
    elif name.endswith(".avi"):
        for chunk in _AVI_CHUNKS:
            at = data.find(chunk)
            while at >= 0 and len(fields) < 64:
                fields.append((at + 4, 4, "<"))
                at = data.find(chunk, at + 1)
    else:
        for element in _MKV_IDS:
            at = data.find(element)
            while at >= 0 and len(fields) < 64:
                fields.append((at + len(element), 1, "vint"))
                at = data.find(element, at + 1)
    return [f for f in fields if f[0] + f[1] <= len(data)]


def _size_rewrite(data: bytearray, name: str, rng: random.Random) -> bytearray:
    fields = _size_fields(data, name)
    if not fields:
        return _bit_flips(data, name, rng)
    at, width, order = rng.choice(fields)
    if order == "vint":  # an 8-byte EBML size: any value, "unknown" (all ones) included
        value = rng.choice((0, 1, 2**56 - 1, rng.randrange(2**56), len(data) * 1000))
        data[at:at + 1] = b"\x01" + value.to_bytes(7, "big")
        return data
    old = struct.unpack_from(f"{order}I", data, at)[0]
    value = rng.choice((0, 1, 7, 8, 0xFFFFFFFF, 0x7FFFFFFF, old + rng.randint(-16, 16), old * 1000,
                        rng.randrange(2**32)))
    struct.pack_into(f"{order}I", data, at, value % 2**32)
    return data


def _index_inflate(data: bytearray, name: str, rng: random.Random) -> bytearray:
    """The count fields of the sample and frame index claim far more than the file holds."""
    huge = rng.choice((1_000, 65_537, 1_000_000, 85_000_000, 0x7FFFFFFF, 0xFFFFFFFF))
    if name.endswith(".mp4"):
        tables = [(b"stsz", 16), (b"stts", 12), (b"stsc", 12), (b"stco", 12), (b"stss", 12), (b"mvhd", 24)]
        kind, offset = rng.choice(tables)
        at = data.find(kind)
        if at >= 0 and at + offset + 4 <= len(data):
            struct.pack_into(">I", data, at + offset - 4, huge % 2**32)
    elif name.endswith(".avi"):
        kind, offset = rng.choice([(b"avih", 8 + 16), (b"strh", 8 + 32), (b"idx1", 4)])
        at = data.find(kind)
        if at >= 0 and at + offset + 4 <= len(data):
            struct.pack_into("<I", data, at + offset, huge % 2**32)
    else:
        cues = data.find(b"\x1c\x53\xbb\x6b")
        at = cues if cues >= 0 else data.find(b"\x1f\x43\xb6\x75")
        if at >= 0 and at + 5 <= len(data):
            data[at + 4:at + 5] = b"\x01" + (huge * 1000).to_bytes(7, "big")
    return data


_MUTATE = {"bit_flips": _bit_flips, "truncate": _truncate, "size_rewrite": _size_rewrite,
           "index_inflate": _index_inflate}
