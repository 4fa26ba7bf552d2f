"""Frames on the client: normalising RLinf's observations, bounded buffers, the picks sent."""

from __future__ import annotations

import numpy as np
import pytest

from proxy.media.encode import sample_indices as proxy_sample_indices
from rlinf_client import EpisodeFrameBuffer, FramesError, env_frames_from_obs, sample_indices, to_uint8_frames
from rlinf_client._frames import prepare_frames
from tests.client._support import frame_tag, tagged_frames


@pytest.mark.parametrize("count", [1, 2, 7, 16, 17, 100, 511, 512])
@pytest.mark.parametrize("nframes", [1, 2, 8, 16, 32])
def test_client_sampling_uses_the_proxys_indices(count, nframes):
    assert sample_indices(count, nframes) == proxy_sample_indices(count, nframes)


def test_frames_are_normalised_from_every_layout_and_dtype():
    rgb = tagged_frames(3, range(4), size=8)
    assert to_uint8_frames(rgb) is not None and np.array_equal(to_uint8_frames(rgb), rgb)
    assert np.array_equal(to_uint8_frames(rgb.transpose(0, 3, 1, 2)), rgb)  # channels first
    assert np.array_equal(to_uint8_frames(rgb.astype(np.float32) / 255.0), rgb)  # [0, 1] floats
    assert np.array_equal(to_uint8_frames(rgb.astype(np.float64)), rgb)  # [0, 255] floats
    assert np.array_equal(to_uint8_frames(rgb[0]), rgb[:1])  # one frame
    with pytest.raises(FramesError):
        to_uint8_frames(np.zeros((2, 8, 8, 4), dtype=np.uint8))
    with pytest.raises(FramesError):
        to_uint8_frames(np.full((1, 8, 8, 3), np.nan, dtype=np.float32))


def test_torch_frames_are_accepted():
    torch = pytest.importorskip("torch")
    rgb = tagged_frames(1, range(3), size=8)
    tensor = torch.from_numpy(rgb.transpose(0, 3, 1, 2).copy()).float() / 255.0
    assert np.array_equal(to_uint8_frames(tensor), rgb)


@pytest.mark.parametrize("key", ["main_images", "full_images", "images"])
def test_observation_keys_of_every_rlinf_version(key):
    rgb = np.stack([tagged_frames(env, range(5, 6), size=8)[0] for env in range(3)])
    images = rgb.transpose(0, 3, 1, 2) if key == "images" else rgb
    frames = env_frames_from_obs({key: images, "states": np.zeros((3, 8))})
    assert [frame_tag(f) for f in frames] == [(0, 5), (1, 5), (2, 5)]


def test_observation_without_images_is_an_error():
    with pytest.raises(FramesError, match="main_images"):
        env_frames_from_obs({"states": np.zeros((2, 8))})


def _fill(buffer: EpisodeFrameBuffer, steps: int) -> None:
    for step, frame in enumerate(tagged_frames(0, range(steps), size=4)):
        assert frame_tag(frame)[1] == step
        buffer.append(frame)


def test_buffer_is_exact_while_the_episode_fits():
    buffer = EpisodeFrameBuffer(capacity=64)
    _fill(buffer, 50)
    indices, frames = buffer.sample(16)
    assert indices == sample_indices(50, 16)
    assert [frame_tag(f)[1] for f in frames] == indices


@pytest.mark.parametrize("steps", [65, 100, 333, 512, 513])
def test_buffer_memory_is_bounded_and_picks_stay_close(steps):
    buffer = EpisodeFrameBuffer(capacity=64)
    _fill(buffer, steps)
    assert len(buffer) <= 65 and buffer.count == steps
    held, _ = buffer.held()
    assert held[0] == 0 and held[-1] == steps - 1  # first and last always kept
    indices, frames = buffer.sample(16)
    assert [frame_tag(f)[1] for f in frames] == indices
    exact = sample_indices(steps, 16)
    assert len(indices) == 16 and indices[0] == 0 and indices[-1] == steps - 1
    assert max(abs(a - b) for a, b in zip(indices, exact, strict=True)) <= buffer.stride / 2


def test_unbounded_buffer_with_a_stride():
    buffer = EpisodeFrameBuffer(capacity=0, stride=4)
    _fill(buffer, 30)
    held, _ = buffer.held()
    assert held == [0, 4, 8, 12, 16, 20, 24, 28, 29]


def test_prepare_frames_sends_the_picked_frames_or_all_held():
    episode = tagged_frames(2, range(40), size=8).astype(np.float32) / 255.0  # RLinf float frames
    picked = prepare_frames(episode, 16, client_sampling=True)
    assert picked.frames.dtype == np.uint8 and picked.count == 16 and picked.source_count == 40
    assert [frame_tag(f)[1] for f in picked.frames] == sample_indices(40, 16)
    everything = prepare_frames(list(tagged_frames(2, range(40), size=8)), 16, client_sampling=False)
    assert everything.count == 40
    with pytest.raises(FramesError):
        prepare_frames(np.zeros((0, 8, 8, 3), dtype=np.uint8), 16, client_sampling=True)
    with pytest.raises(FramesError):
        prepare_frames(EpisodeFrameBuffer(capacity=64), 16, client_sampling=True)
