"""How many samples an MP4/MOV's index claims, read from its boxes before FFmpeg opens the file.

FFmpeg's MOV demuxer builds an index entry for every sample the file claims while it opens it
(`mov_build_index`, `mov_read_trun`), before the proxy can ask for a frame count: a 1 KB file whose
`stsz` says 85 million samples of a constant size (no per-sample table), with `stts` and `stsc` to
match, took 3 GB of memory in `cv2.VideoCapture()` (found by review, stop 36). A count is a number
in a box, so the file's size bounds nothing; this reads those numbers first, with `pread` on the
opened descriptor, box headers and the index tables only: each track's handler (`hdlr`), sample
count (`stsz`/`stz2`), time-to-sample runs (`stts`) and chunks (`stco`/`co64`, `stsc`), and
fragments' runs (`trun`), counted as FFmpeg counts its entries. Everything else is skipped by its
size; a compressed header (`cmov`) is refused, since its tables are not read here.
"""

from __future__ import annotations

import os
import struct

__all__ = ["MAX_BOXES", "IndexTooLarge", "claimed_samples"]

# Boxes whose children are boxes, on the way to the index (ISO/IEC 14496-12).
_CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"moof", b"traf", b"mvex", b"edts"}
_MAX_DEPTH = 8
# A legit file has a few hundred boxes, a fragmented one two per fragment, and tables of at most
# an entry per frame (or per chunk); past these it is refused rather than read.
MAX_BOXES = 200_000
MAX_TABLE_ENTRIES = 1_000_000


class IndexTooLarge(ValueError):
    """The walk itself was refused: more boxes, or table entries, than a video of frames has."""


def claimed_samples(fd: int, size: int) -> int:
    """The index entries FFmpeg would build for the file: every track's, plus every fragment's
    runs. Raises IndexTooLarge past MAX_BOXES or MAX_TABLE_ENTRIES, or for a compressed movie
    header (`cmov`: FFmpeg inflates it; its counts are not read here)."""
    walk = _Walk(fd)
    walk.boxes(0, size, 0)
    return sum(track.entries() for track in walk.tracks) + walk.in_fragments


class _Track:
    """What one `trak` claims: its sample count (`stsz`/`stz2`), its time-to-sample runs (`stts`) and
    its chunks (`stco`/`co64`, `stsc`)."""

    def __init__(self) -> None:
        self.sample_count = self.stts_total = self.chunk_count = 0
        self.handler = b""  # hdlr: b"vide", b"soun", ...
        self.stts_runs: list[tuple[int, int]] = []
        self.stsc: list[tuple[int, int]] = []  # (first chunk, samples per chunk)

    def entries(self) -> int:
        """FFmpeg's count (mov_build_index): one entry per sample; but an audio track of one run of
        duration 1 (uncompressed audio) is indexed by chunk, ceil(samples in the chunk / 1024)
        entries each (more for its GSM-like codecs' frames, at most 6.4x: bounded all the same)."""
        if self.handler == b"soun" and len(self.stts_runs) == 1 and self.stts_runs[0][1] == 1:
            total = 0
            for i, (first, per_chunk) in enumerate(self.stsc):
                end = self.stsc[i + 1][0] if i + 1 < len(self.stsc) else self.chunk_count + 1
                total += max(0, end - first) * -(-per_chunk // 1024)
            return total
        return max(self.sample_count, self.stts_total)


class _Walk:
    def __init__(self, fd: int) -> None:
        self.fd, self.seen = fd, 0
        self.tracks: list[_Track] = []
        self.in_fragments = 0

    def _read(self, offset: int, length: int) -> bytes:
        return os.pread(self.fd, length, offset)

    def _table(self, body: int, end: int, entry: int) -> bytes:
        """A full box's table: the entries of its stated count that are in the file."""
        fields = self._read(body, 8)
        if len(fields) < 8:
            return b""
        present = min(struct.unpack(">I", fields[4:8])[0], max(0, (end - body - 8) // entry))
        if present > MAX_TABLE_ENTRIES:
            raise IndexTooLarge(f"a table of {present} entries")
        return self._read(body + 8, entry * present)

    def boxes(self, start: int, end: int, depth: int, track: _Track | None = None) -> None:
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
            if kind == b"cmov":
                raise IndexTooLarge("a compressed movie header (cmov), whose tables are not read here")
            if kind == b"trak":
                self.tracks.append(_Track())
                self.boxes(body, box_end, depth + 1, self.tracks[-1])
            elif kind in _CONTAINERS and depth < _MAX_DEPTH:
                self.boxes(body, box_end, depth + 1, track)
            elif kind == b"trun":
                fields = self._read(body, 8)
                if len(fields) == 8:
                    self.in_fragments += struct.unpack(">I", fields[4:8])[0]
            elif track is not None:
                self._track_box(kind, body, box_end, track)
            offset += box_size

    def _track_box(self, kind: bytes, body: int, end: int, track: _Track) -> None:
        if kind == b"hdlr":
            fields = self._read(body, 12)
            track.handler = fields[8:12]
        elif kind in (b"stsz", b"stz2"):
            fields = self._read(body, 12)
            if len(fields) == 12:
                track.sample_count = struct.unpack(">I", fields[8:12])[0]
        elif kind == b"stts":
            table = self._table(body, end, 8)
            track.stts_runs = [struct.unpack_from(">II", table, 8 * i) for i in range(len(table) // 8)]
            track.stts_total = sum(count for count, _ in track.stts_runs)
        elif kind in (b"stco", b"co64"):
            width = 4 if kind == b"stco" else 8
            track.chunk_count = len(self._table(body, end, width)) // width
        elif kind == b"stsc":
            table = self._table(body, end, 12)
            track.stsc = [struct.unpack_from(">II", table, 12 * i) for i in range(len(table) // 12)]
