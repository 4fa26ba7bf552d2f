"""Uniform frame sampling: first and last frame always kept, no repeats, evenly spread."""

from hypothesis import given
from hypothesis import strategies as st

from proxy.media.encode import sample_indices


def test_sixteen_of_forty_spreads_evenly_and_keeps_both_ends():
    indices = sample_indices(40, 16)
    assert indices[0] == 0 and indices[-1] == 39
    assert len(indices) == 16
    gaps = {b - a for a, b in zip(indices, indices[1:], strict=False)}
    assert gaps <= {2, 3}  # 39/15 = 2.6 → every gap is 2 or 3


def test_fewer_frames_than_asked_returns_all():
    assert sample_indices(5, 16) == [0, 1, 2, 3, 4]
    assert sample_indices(16, 16) == list(range(16))


def test_one_frame_asked_is_the_last_state():
    assert sample_indices(512, 1) == [511]


def test_half_way_rounding_never_repeats_an_index():
    # step 1.5: numpy's half-to-even would give 0, 2, 3→2 ... a repeat
    assert sample_indices(4, 3) == [0, 2, 3]
    assert sample_indices(7, 5) == [0, 2, 3, 5, 6]


@given(source=st.integers(1, 5000), wanted=st.integers(1, 300))
def test_properties(source, wanted):
    indices = sample_indices(source, wanted)
    assert len(indices) == min(source, wanted)
    assert all(0 <= i < source for i in indices)
    assert indices == sorted(set(indices))  # strictly increasing
    assert indices[-1] == source - 1
    if len(indices) > 1:
        assert indices[0] == 0
        step = (source - 1) / (len(indices) - 1)
        assert all(abs(i - k * step) <= 0.5 for k, i in enumerate(indices))
