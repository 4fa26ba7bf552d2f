"""smart_resize and the video rule, by property (parity with qwen-vl-utils itself: tests/reference)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vlm_protocol.frames import VIDEO_MIN_PIXELS, smart_resize, video_frame_size

MIN_PIXELS, MAX_PIXELS = 3136, 200704


def test_libero_frame_fits_the_default_budget():
    # 256x256 agent view → 252x252 (9 x 9 patches of 28), 63504 px ≤ 200704
    assert smart_resize(256, 256, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS) == (252, 252)


def test_large_frame_is_shrunk_below_the_budget():
    h, w = smart_resize(720, 1280, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    assert (h % 28, w % 28) == (0, 0) and h * w <= MAX_PIXELS


def test_extreme_aspect_ratio_is_refused():
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2100, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


@given(h=st.integers(1, 4000), w=st.integers(1, 4000), max_pixels=st.integers(12544, 2_000_000))
def test_properties(h, w, max_pixels):
    # Degenerate slivers follow the reference even where it overshoots; camera frames don't.
    if max(h, w) / min(h, w) > 20:
        return
    try:
        rh, rw = smart_resize(h, w, min_pixels=MIN_PIXELS, max_pixels=max_pixels)
    except ValueError:
        return  # extreme aspect ratio, or a side that would round to 0
    assert rh % 28 == 0 and rw % 28 == 0 and rh > 0 and rw > 0
    assert rh * rw <= max_pixels
    assert rh * rw >= MIN_PIXELS
    # aspect ratio kept to within a patch per side (meaningless for tiny frames)
    if min(rh, rw) >= 112:
        assert abs((rh / rw) / (h / w) - 1) <= 28 / min(rh, rw) * 2.5


def test_a_libero_episode_as_the_seed_sent_it():
    # qwen-vl-utils' video floor (128 x 28 x 28) lifts 256x256 to 336x336: 144 tokens per 2 frames
    assert video_frame_size(256, 256, 16, max_pixels=200704) == (336, 336)
    assert video_frame_size(256, 256, 16, max_pixels=200704, min_pixels=3136) == (252, 252)  # the old floor


@given(h=st.integers(28, 2000), w=st.integers(28, 2000), n=st.integers(1, 400),
       max_pixels=st.none() | st.integers(28 * 28, 2_000_000))
def test_video_frames_stay_within_the_budget_per_frame_and_in_all(h, w, n, max_pixels):
    if max(h, w) / min(h, w) > 20:
        return
    try:
        rh, rw = video_frame_size(h, w, n, max_pixels=max_pixels)
    except ValueError:
        return
    assert rh % 28 == 0 and rw % 28 == 0
    if max_pixels is not None and max_pixels < VIDEO_MIN_PIXELS * 1.05:
        return  # a caller's cap below the floor: smart_resize's own properties cover it
    if max(28, round(h / 28) * 28) * max(28, round(w / 28) * 28) < VIDEO_MIN_PIXELS:
        # Lifting a small frame to the floor rounds each side *up* (qwen-vl-utils does the same),
        # so the floor wins over a cap only just above it: by one patch row/column at most.
        assert rh * rw >= VIDEO_MIN_PIXELS
        assert (rh - 28) * (rw - 28) < VIDEO_MIN_PIXELS
    elif max_pixels is not None:
        assert rh * rw <= max_pixels
