"""MP4 files whose index lies, made from a real small MP4 by rewriting its boxes: what an attacker
with write access to a media root could place there (tests/security/test_media_budget.py)."""

from __future__ import annotations

import struct
from pathlib import Path

_CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl"}


def _boxes(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, payload) of each box in `data` (OpenCV's small files use 32-bit sizes only)."""
    out, offset = [], 0
    while offset + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[offset:offset + 8])
        size = size or len(data) - offset
        out.append((kind, data[offset + 8:offset + size]))
        offset += size
    return out


def _rebuilt(kind: bytes, payload: bytes, replace: dict[bytes, bytes]) -> bytes:
    if kind in _CONTAINERS:
        payload = b"".join(_rebuilt(k, p, replace) for k, p in _boxes(payload))
    elif kind in replace:
        payload = replace[kind]
    return struct.pack(">I4s", 8 + len(payload), kind) + payload


def index_bomb(source: Path, target: Path, samples: int) -> Path:
    """`source` with a sample table that claims `samples` samples of 100 bytes in one chunk, each
    one tick long: a few bytes more, whatever `samples` is (found by review, stop 36)."""
    replace = {b"stsz": struct.pack(">III", 0, 100, samples),  # version/flags, one size for all, count
               b"stts": struct.pack(">IIII", 0, 1, samples, 1),  # one run: `samples` samples of 1 tick
               b"stsc": struct.pack(">IIIII", 0, 1, 1, samples, 1)}  # chunk 1 on: `samples` per chunk
    target.write_bytes(b"".join(_rebuilt(k, p, replace) for k, p in _boxes(source.read_bytes())))
    return target


def with_fragment_runs(source: Path, target: Path, samples: int) -> Path:
    """`source` followed by a movie fragment whose one run claims `samples` samples (no per-sample
    table: their sizes come from defaults)."""
    trun = struct.pack(">I4sII", 16, b"trun", 0, samples)
    traf = struct.pack(">I4s", 8 + len(trun), b"traf") + trun
    moof = struct.pack(">I4s", 8 + len(traf), b"moof") + traf
    target.write_bytes(source.read_bytes() + moof)
    return target


def track_tables(handler: bytes, samples: int, sample_size: int, per_chunk: int, chunks: int,
                 tick: int = 1) -> dict[bytes, bytes]:
    """The boxes of a track: its handler (b"vide", b"soun"), `samples` of `sample_size` bytes in
    one run of `tick`, `per_chunk` samples in each of `chunks` chunks."""
    return {b"hdlr": struct.pack(">II4s12s", 0, 0, handler, b"\0" * 12) + b"\0",
            b"stts": struct.pack(">IIII", 0, 1, samples, tick),
            b"stsz": struct.pack(">III", 0, sample_size, samples),
            b"stsc": struct.pack(">IIIII", 0, 1, 1, per_chunk, 1),
            b"stco": struct.pack(f">II{chunks}I", 0, chunks, *([48] * chunks))}


def with_tracks(source: Path, target: Path, tracks: list[dict[bytes, bytes]], extra_moov: bytes = b"") -> Path:
    """`source` with more tracks in its moov, each a copy of its first track with these boxes
    replaced (track_tables), and `extra_moov` (raw boxes) at the moov's end."""
    out = []
    for kind, payload in _boxes(source.read_bytes()):
        if kind == b"moov":
            children = _boxes(payload)
            first = next(p for k, p in children if k == b"trak")
            payload = (b"".join(struct.pack(">I4s", 8 + len(p), k) + p for k, p in children)
                       + b"".join(_rebuilt(b"trak", first, replace) for replace in tracks) + extra_moov)
        out.append(struct.pack(">I4s", 8 + len(payload), kind) + payload)
    target.write_bytes(b"".join(out))
    return target
