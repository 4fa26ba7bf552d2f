"""How many samples an MP4/MOV's index claims, read from its boxes before FFmpeg opens the file.

FFmpeg's MOV demuxer builds an index entry for every sample the file claims while it opens it
(`mov_build_index`, `mov_read_trun`), before the proxy can ask for a frame count: a 1 KB file whose
`stsz` says 85 million samples of a constant size (no per-sample table), with `stts` and `stsc` to
match, took 3 GB of memory in `cv2.VideoCapture()` (found by review, stop 36). A count is a number
in a box, so the file's size bounds nothing; this reads those numbers first, with `pread` on the
opened descriptor, box headers only: the sample counts (`stsz`/`stz2`), the time-to-sample runs
(`stts`), and fragments' runs (`trun`). Everything else is skipped by its size.
"""

from __future__ import annotations

import os
import struct

__all__ = ["MAX_BOXES", "IndexTooLarge", "claimed_samples"]

# Boxes whose children are boxes, on the way to the index (ISO/IEC 14496-12).
_CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"moof", b"traf", b"mvex", b"edts"}
_MAX_DEPTH = 8
# A legit file has a few hundred boxes, a fragmented one two per fragment, and a time-to-sample
# table of at most one entry per frame; past these it is refused rather than read.
MAX_BOXES = 200_000
MAX_STTS_ENTRIES = 1_000_000


class IndexTooLarge(ValueError):
    """The walk itself was refused: more boxes, or table entries, than a video of frames has."""


def claimed_samples(fd: int, size: int) -> int:
    """The most samples any one track's index claims, plus every fragment's runs (a fragment's
    track is not looked up: its runs add to the total). Raises IndexTooLarge past MAX_BOXES."""
    walk = _Walk(fd)
    walk.boxes(0, size, 0)
    return max(walk.per_track, default=0) + walk.in_fragments


class _Walk:
    def __init__(self, fd: int) -> None:
        self.fd, self.seen = fd, 0
        self.per_track: list[int] = []
        self.in_fragments = 0

    def _read(self, offset: int, length: int) -> bytes:
        return os.pread(self.fd, length, offset)

    def boxes(self, start: int, end: int, depth: int, track: list[int] | None = None) -> None:
        offset = start
        while offset + 8 <= end:
            self.seen += 1
            if self.seen > MAX_BOXES:
                raise IndexTooLarge(f"more than {MAX_BOXES} boxes")
            head = self._read(offset, 16)
            if len(head) < 8:
                return
            box_size, kind = struct.unpack(">I4s", head[:8])
            body = offset + 8
            if box_size == 1:  # a 64-bit size follows
                if len(head) < 16:
                    return
                box_size, body = struct.unpack(">Q", head[8:16])[0], offset + 16
            elif box_size == 0:  # to the end of what holds it
                box_size = end - offset
            box_end = min(offset + box_size, end)
            if box_size < body - offset:
                return  # a size smaller than its own header: FFmpeg stops here too
            if kind == b"trak":
                counts: list[int] = []
                self.boxes(body, box_end, depth + 1, counts)
                self.per_track.append(max(counts, default=0))
            elif kind in _CONTAINERS and depth < _MAX_DEPTH:
                self.boxes(body, box_end, depth + 1, track)
            elif kind in (b"stsz", b"stz2") and track is not None:
                fields = self._read(body, 12)
                if len(fields) == 12:
                    track.append(struct.unpack(">I", fields[8:12])[0])
            elif kind == b"stts" and track is not None:
                track.append(self._stts_total(body, box_end))
            elif kind == b"trun":
                fields = self._read(body, 8)
                if len(fields) == 8:
                    self.in_fragments += struct.unpack(">I", fields[4:8])[0]
            offset += box_size

    def _stts_total(self, body: int, end: int) -> int:
        """The samples of a time-to-sample table: the sum of its runs (entries that are in the file)."""
        fields = self._read(body, 8)
        if len(fields) < 8:
            return 0
        entries = min(struct.unpack(">I", fields[4:8])[0], max(0, (end - body - 8) // 8))
        if entries > MAX_STTS_ENTRIES:
            raise IndexTooLarge(f"a time-to-sample table of {entries} entries")
        table = self._read(body + 8, 8 * entries)
        return sum(struct.unpack_from(">I", table, 8 * i)[0] for i in range(len(table) // 8))
