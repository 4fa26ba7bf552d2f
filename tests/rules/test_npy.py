"""The strict .npy reader agrees with numpy on what numpy writes, and refuses the rest."""

import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.media.npy import NpyError, read_uint8


def _npy(array: np.ndarray, **kwargs) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False, **kwargs)
    return buf.getvalue()


@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=4), fortran=st.booleans())
def test_round_trips_whatever_numpy_writes(shape, fortran):
    array = np.arange(int(np.prod(shape)) if shape else 1, dtype=np.uint8).reshape(shape)
    if fortran:
        array = np.asfortranarray(array)
    assert np.array_equal(read_uint8(_npy(array)), array)


def test_version_2_header():
    array = np.zeros((2, 3, 4, 3), dtype=np.uint8)
    raw = io.BytesIO()
    np.lib.format.write_array(raw, array, version=(2, 0))
    assert read_uint8(raw.getvalue()).shape == (2, 3, 4, 3)


@pytest.mark.parametrize(("raw", "message"), [
    (b"not npy at all", "magic"),
    (_npy(np.zeros((2, 2), dtype=np.float32)), "not uint8"),
    (_npy(np.zeros((4, 8, 8, 3), dtype=np.uint8))[:-10], "truncated"),
    (b"\x93NUMPY\x01\x00\x10\x00{'descr': 1}   ", "malformed"),  # no fortran_order/shape
])
def test_refuses_what_it_cannot_read_exactly(raw, message):
    with pytest.raises(NpyError, match=message):
        read_uint8(raw)


def test_many_threads_at_once():
    """np.load's header parsing (ast) was not thread-safe on CPython 3.11; this reader is."""
    raw = _npy(np.ones((16, 32, 32, 3), dtype=np.uint8))
    with ThreadPoolExecutor(8) as pool:
        shapes = list(pool.map(lambda _: read_uint8(raw).shape, range(2000)))
    assert set(shapes) == {(16, 32, 32, 3)}
