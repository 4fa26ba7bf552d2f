"""A video frame that decoded in one camera and not the other (grab works, retrieve fails) is left out
of both, as one camera leaves out a frame it cannot decode; the first and the last frame never are
(the model judges by them), and the refusal names the view that lost it. Such a frame cannot be made
on purpose with OpenCV's writers (a damaged packet ends the stream instead), so the decoded views
are built here as the decoder leaves them: that index absent."""

import numpy as np
import pytest

from proxy.errors import MediaDecodeError
from proxy.media.decode import FrameLimits
from proxy.media.decoded import DecodedSource
from proxy.media.encode import decodable_indices, encode_prefix, prefix_indices

LIMITS = FrameLimits(nframes=8, max_pixels=200_704, min_pixels=100_352, video_max_pixels=602_112,
                     total_pixels=90_316_800, image_min_pixels=3136, stills=False, jpeg_quality=90,
                     default_source_fps=4.0, max_inline_frames=2048, max_source_pixels=4096 * 4096)
COUNT = 24
WANTED = prefix_indices(COUNT, LIMITS.nframes, None)


def view(field: str, lost: set[int] = frozenset(), level: int = 0) -> DecodedSource:
    source = DecodedSource(COUNT, 4.0, field)
    for i in range(COUNT):
        if i not in lost:
            source.source_frames[i] = np.full((64, 64, 3), level + i, np.uint8)
            source.sizes[i] = (64, 64)
    return source


def test_one_camera_leaves_out_an_interior_frame_it_lost():
    assert decodable_indices(WANTED, view("video_path", {WANTED[3]})) == [i for i in WANTED if i != WANTED[3]]


@pytest.mark.parametrize("lost_in", ["main", "extra"])
def test_a_frame_one_camera_lost_is_left_out_of_both(lost_in):
    lost = WANTED[4]
    main = view("video_path", {lost} if lost_in == "main" else set())
    extra = view("extra_view.video_path", {lost} if lost_in == "extra" else set(), level=100)
    indices = decodable_indices(WANTED, main, extra)
    assert indices == [i for i in WANTED if i != lost]
    video, other = (encode_prefix(LIMITS, v, indices=indices) for v in (main, extra))
    assert video.indices == other.indices == indices and len(video.jpegs) == len(other.jpegs) == len(WANTED) - 1


@pytest.mark.parametrize(("end", "lost_in", "field"), [
    (0, "extra", "extra_view.video_path"), (-1, "extra", "extra_view.video_path"),
    (0, "main", "video_path"), (-1, "main", "video_path")])
def test_a_first_or_last_frame_either_camera_lost_is_refused_naming_it(end, lost_in, field):
    lost = {WANTED[end]}
    main = view("video_path", lost if lost_in == "main" else set())
    extra = view("extra_view.video_path", lost if lost_in == "extra" else set())
    with pytest.raises(MediaDecodeError) as caught:
        decodable_indices(WANTED, main, extra)
    assert caught.value.field == field
    message = f"frame {WANTED[end]} of the episode (its first or last) could not be decoded in {field}"
    assert message in str(caught.value)


def test_one_camera_that_lost_its_last_frame_is_refused():
    with pytest.raises(MediaDecodeError, match=f"frame {WANTED[-1]} of the episode") as caught:
        encode_prefix(LIMITS, view("video_path", {WANTED[-1]}))
    assert caught.value.field == "video_path"
