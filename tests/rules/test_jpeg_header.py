"""The marker reader that lets a caller's final-size JPEG be forwarded without PIL agrees with PIL
wherever it answers: same size, an RGB image, no EXIF rotation — and it answers None (PIL then
decides, as before) for every other kind of JPEG and for damaged or hostile bytes, never raising."""

from __future__ import annotations

import io

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from proxy.media.jpeg_header import plain_jpeg_size
from vlm_protocol.frame_codec import encode_jpeg

JPEG_KINDS = st.fixed_dictionaries({
    "mode": st.sampled_from(["RGB", "L", "CMYK", "YCbCr"]),
    "width": st.integers(1, 96), "height": st.integers(1, 96),
    "quality": st.integers(5, 100), "progressive": st.booleans(), "optimize": st.booleans(),
    "subsampling": st.sampled_from([0, 1, 2]),
    "orientation": st.sampled_from([None, 1, 3, 6, 8]),
})


def _jpeg(kind: dict) -> bytes:
    rng = np.random.default_rng(kind["width"] * 97 + kind["height"])
    bands = len(kind["mode"]) if kind["mode"] != "YCbCr" else 3
    pixels = rng.integers(0, 256, (kind["height"], kind["width"], bands), dtype=np.uint8)
    image = Image.fromarray(pixels[..., 0] if bands == 1 else pixels, "L" if bands == 1 else None)
    if kind["mode"] not in ("L", "RGB"):
        image = image.convert("RGB").convert(kind["mode"])
    extra = {}
    if kind["orientation"] is not None:
        exif = Image.Exif()
        exif[0x0112] = kind["orientation"]
        extra["exif"] = exif
    out = io.BytesIO()
    image.save(out, "JPEG", quality=kind["quality"], progressive=kind["progressive"], optimize=kind["optimize"],
               subsampling=kind["subsampling"], **extra)
    return out.getvalue()


def _agrees_with_pil(data: bytes) -> None:
    size = plain_jpeg_size(data)
    if size is None:
        return
    with Image.open(io.BytesIO(data), formats=["JPEG"]) as image:
        assert (image.height, image.width) == size
        assert image.mode == "RGB"
        assert image.getexif().get(0x0112, 1) == 1


@given(JPEG_KINDS)
@settings(max_examples=150, suppress_health_check=list(HealthCheck))
def test_where_it_answers_pil_says_the_same(kind):
    data = _jpeg(kind)
    _agrees_with_pil(data)
    plain = kind["mode"] in ("RGB", "YCbCr") and kind["orientation"] is None
    assert (plain_jpeg_size(data) is not None) == plain, kind


@given(JPEG_KINDS, st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8),
       st.integers(0, 10_000))
@settings(max_examples=200, suppress_health_check=list(HealthCheck))
def test_damaged_bytes_give_pils_answer_or_none_never_an_error(kind, flips, cut):
    data = bytearray(_jpeg(kind))
    for offset, value in flips:
        data[offset % len(data)] = value
    data = bytes(data[:max(2, cut % (len(data) + 1))])
    try:
        _agrees_with_pil(data)
    except (OSError, SyntaxError, ValueError):  # PIL cannot read it: then the reader must not have answered
        assert plain_jpeg_size(data) is None


@given(st.binary(max_size=64))
def test_any_short_bytes_are_no_plain_jpeg(data):
    assert plain_jpeg_size(data) is None  # no JPEG with a frame header and a scan fits in 64 random bytes


def test_the_smallest_plain_jpeg_needs_its_scan():
    head = b"\xff\xd8\xff\xc0\x00\x11\x08\x00\x02\x00\x03\x03" + bytes(9)
    assert plain_jpeg_size(head) is None  # a frame header but no scan yet: PIL would not open it either
    assert plain_jpeg_size(head + b"\xff\xda\x00\x02") == (2, 3)


def test_the_proxys_and_the_clients_own_jpegs_are_plain():
    frame = np.random.default_rng(0).integers(0, 256, (336, 224, 3), dtype=np.uint8)
    assert plain_jpeg_size(encode_jpeg(frame, 90)) == (336, 224)
