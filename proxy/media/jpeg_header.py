"""The size of a plain JPEG read from its markers alone: what the proxy needs to forward a caller's
final-size frame, without PIL's full header parse (about 120 µs a frame against 5 here).

Plain: a baseline, extended or progressive Huffman JPEG (SOF0/1/2) of 8-bit samples in 3 components
(PIL's "RGB"), whose header holds only JFIF (APP0), quantization and Huffman tables, a restart
interval and comments before its first scan: no EXIF or XMP (an orientation PIL and OpenCV read
differently), no Adobe colour transform, no ICC profile. The walk follows PIL's own (the same
segments, the same checks of their lengths and of the quantization tables), so where it answers,
PIL answers the same size and mode (tests/rules/test_jpeg_header.py). Anything else answers None and
the caller asks PIL, as before. Pure parsing of the given bytes.
"""

from __future__ import annotations

__all__ = ["plain_jpeg_size"]

_APP0, _DQT, _DHT, _DRI, _COM, _SOS = 0xE0, 0xDB, 0xC4, 0xDD, 0xFE, 0xDA
_FRAMES = (0xC0, 0xC1, 0xC2)  # Huffman-coded sequential or progressive DCT
_SKIPPED = (_DHT, _DRI, _COM)  # read past, as PIL does (it keeps a comment, never parses it)


def plain_jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) of a plain JPEG (see the module docstring), or None."""
    if not data.startswith(b"\xff\xd8\xff"):
        return None
    position, end, size = 2, len(data), None
    while position + 4 <= end:
        if data[position] != 0xFF:
            return None  # junk where a marker belongs: PIL skips it, we do not guess
        marker = data[position + 1]
        if marker == 0xFF:  # a fill byte before the marker
            position += 1
            continue
        length = (data[position + 2] << 8) | data[position + 3]
        body = position + 4
        if length < 2 or position + 2 + length > end:
            return None  # a segment cut short
        content = data[body:position + 2 + length]
        if marker == _SOS:
            return size  # PIL stops here too; None when no frame header came first
        if marker in _FRAMES:
            if size is not None or length < 8 or content[0] != 8 or content[5] != 3:
                return None  # a second frame header, 12-bit samples, or not 3 components
            height, width = (content[1] << 8) | content[2], (content[3] << 8) | content[4]
            if not height or not width:
                return None
            size = (height, width)
        elif marker == _DQT:
            while content:  # PIL's check: each table complete
                table = 1 + (64 if content[0] < 16 else 128)
                if len(content) < table:
                    return None
                content = content[table:]
        elif marker == _APP0:
            if content.startswith(b"JFIF") and len(content) < 7:
                return None  # PIL reads the JFIF version at offset 5
        elif marker not in _SKIPPED:
            return None  # EXIF/XMP, Adobe, ICC, other segments, markers without a length: PIL decides
        position += 2 + length
    return None
