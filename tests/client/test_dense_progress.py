"""Dense progress from the client's side (dense_points): a curve per episode from the real proxy's
/score/dense over the fake vLLM, mapped to episode steps, and the hook's per-step shaped rewards."""

from __future__ import annotations

import numpy as np
import pytest

from rlinf_client import RewardClient, RewardConfigError
from rlinf_client._frames import EpisodeFrameBuffer
from rlinf_client.hook import LiberoVLMReward
from tests.client.test_integration import last_frame_level
from tests.fakes.episodes import episode_frames, frame_level
from vlm_protocol.frames import sample_indices

FRAMES = episode_frames(40, 64, 64)
TASK = "put the bowl on the plate"


def _progress(level: float) -> int:
    return round((level - 20) / 215 * 100)  # episode_frames' grey level runs 20 → 235


def _progress_reply(body: dict) -> str:
    return f"<score>{_progress(last_frame_level(body))}</score>"


def _cfg(proxy_server, **overrides) -> dict:
    return {"enable": True, "endpoint": f"{proxy_server.url}/score", "backend": "qwen2_5_vl_vllm", "timeout": 30,
            "binary_reward": False, "dense_points": 4, "nframes": 8, **overrides}


def test_a_curve_comes_back_in_episode_steps(proxy_server, fake_qwen):
    fake_qwen.fake.state.reply_fn = _progress_reply
    with RewardClient(_cfg(proxy_server)) as client:
        result = client.score_episode(FRAMES, TASK)
    assert result.ok, result.error
    ends = sample_indices(40, 5)[1:]
    assert [step for step, _ in result.curve] == ends
    assert [score for _, score in result.curve] == pytest.approx(
        [_progress(frame_level(FRAMES[end])) / 100 for end in ends], abs=0.011)
    assert result.score == result.value == result.curve[-1][1]
    assert len(fake_qwen.chat_requests) == 4  # k points, k calls, one HTTP request from the client
    assert result.attempts == 1


def test_a_strided_buffer_maps_the_curve_to_the_steps_it_holds(proxy_server, fake_qwen):
    fake_qwen.fake.state.reply_fn = _progress_reply
    buffer = EpisodeFrameBuffer(capacity=16)
    for frame in FRAMES:
        buffer.append(frame)
    held, _ = buffer.held()
    with RewardClient(_cfg(proxy_server, buffer_frames=16)) as client:
        result = client.score_episode(buffer, TASK)
    steps = [step for step, _ in result.curve]
    assert set(steps) <= set(held) and steps[-1] == 39 and steps == sorted(steps)
    assert [score for _, score in result.curve] == pytest.approx(
        [_progress(frame_level(FRAMES[step])) / 100 for step in steps], abs=0.011)


def _independent_shaping(curve: list[tuple[int, float]], steps: int, coef: float) -> list[float]:
    """Potential differences, written out step by step: phi(0) = 0, straight lines between points."""
    knots = [(0, 0.0), *curve]

    def phi(t: int) -> float:
        for (t0, v0), (t1, v1) in zip(knots, knots[1:], strict=False):
            if t0 <= t <= t1:
                return v0 + (v1 - v0) * (t - t0) / (t1 - t0)
        return knots[-1][1]

    return [0.0] + [coef * (phi(t) - phi(t - 1)) for t in range(1, steps)]


def test_the_hook_pays_the_last_point_and_keeps_the_per_step_shaping(proxy_server, fake_qwen):
    fake_qwen.fake.state.reply_fn = _progress_reply
    coef, end = 5.0, 30
    with RewardClient(_cfg(proxy_server)) as client:
        hook = LiberoVLMReward(_cfg(proxy_server), 1, reward_coef=coef, use_rel_reward=True,
                               ignore_terminations=False, client=client)
        hook.on_reset({"main_images": FRAMES[:1]})
        rewards = [hook.step_reward({"main_images": FRAMES[t:t + 1]}, [t == end], [False], [TASK])[0]
                   for t in range(1, end + 1)]
    curve, steps = hook.curves[0]
    assert steps == end + 1
    assert rewards[:-1] == [0.0] * (end - 1)
    assert rewards[-1] == pytest.approx(coef * curve[-1][1])
    shaped = hook.shaped_rewards(0)
    assert shaped.shape == (end + 1,) and shaped.sum() == pytest.approx(rewards[-1])
    np.testing.assert_allclose(shaped, _independent_shaping(list(curve), end + 1, coef), atol=1e-12)
    assert [step for step, _ in curve] == sample_indices(end + 1, 5)[1:]


@pytest.mark.parametrize(("overrides", "words"), [({"binary_reward": True}, "binary_reward: false"),
                                                   ({"dense_points": 1}, "dense_points must be 0")])
def test_dense_settings_that_cannot_work_are_refused(overrides, words):
    with pytest.raises(RewardConfigError, match=words):
        RewardClient({"enable": True, "dense_points": 4, "binary_reward": False, **overrides})


def test_a_curve_that_fails_is_the_fallback_never_a_partial_curve(proxy_server, fake_qwen):
    # The shortest prefix never holds a score: the proxy fails the whole curve, the client's policy applies.
    fake_qwen.fake.state.reply_fn = lambda body: ("no idea" if last_frame_level(body) < 80 else _progress_reply(body))
    with RewardClient(_cfg(proxy_server, fallback="zero")) as client:
        hook = LiberoVLMReward(_cfg(proxy_server, fallback="zero"), 1, reward_coef=5.0, use_rel_reward=True,
                               ignore_terminations=False, client=client)
        hook.on_reset({"main_images": FRAMES[:1]})
        rewards = [hook.step_reward({"main_images": FRAMES[t:t + 1]}, [t == 39], [False], [TASK])[0]
                   for t in range(1, 40)]
    assert rewards[-1] == 0.0 and hook.vlm_fallback[0] == 1.0 and hook.failures == 1
    assert hook.shaped_rewards(0) is None and hook.curves[0] is None


def test_a_short_episode_gets_fewer_points_and_the_result_says_so(proxy_server, fake_qwen, caplog):
    """Issue 39, item 5: an episode of 4 frames has 3 prefixes after its first frame; asked for 4
    points, it gets 3, and the result, the client's stats and the log say so."""
    fake_qwen.fake.state.reply_fn = _progress_reply
    with RewardClient(_cfg(proxy_server)) as client:
        result = client.score_episode(FRAMES[:4], TASK)
        stats = client.stats.as_dict()
    assert result.ok, result.error
    assert len(result.curve) == 3
    assert result.frames_short == {"wanted": 4, "sent": 3, "source_count": 4, "why": "points"}
    assert stats["frames_short"] == 1 and "3 curve points where 4 were asked" in caplog.text
