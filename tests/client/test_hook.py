"""The RLinf hook in a stand-in LiberoEnv: several envs, episodes ending at different steps."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from rlinf_client import BadGatewayError, RewardClient
from rlinf_client.hook import LiberoVLMReward
from tests.client._support import FakeProxy, decode_npy, error_response, frame_tag
from tests.client.standin_env import StandInLiberoEnv

COEF = 5.0
ENV_SCORES = {0: 0.9, 1: 0.2, 2: 0.7, 3: 0.95, 4: 0.1, 5: 0.6}


def env_cfg(*, reward_model: bool = True, max_steps: int = 24, **overrides) -> dict:
    """LIBERO-10's train settings (auto_reset off, terminations on, relative reward, coef 5)."""
    cfg = {"reward_coef": COEF, "use_rel_reward": True, "ignore_terminations": False,
           "auto_reset": False, "max_episode_steps": max_steps}
    model = {"enable": True, "endpoint": "http://proxy.test/score", "batch": "never",
             "nframes": 8, "buffer_frames": 16}
    model.update(overrides.pop("model", {}))
    cfg.update(overrides)
    if reward_model:
        cfg["reward_model"] = model
    return cfg


class Recording:
    """A client wrapper that remembers which envs each scoring call carried."""

    def __init__(self, inner: RewardClient) -> None:
        self.inner = inner
        self.calls: list[list[str]] = []

    def score_episodes(self, episodes):
        self.calls.append([e.task_text for e in episodes])
        return self.inner.score_episodes(episodes)


def by_env(body, frames):
    return ENV_SCORES[frame_tag(frames[-1])[0]]


@pytest.fixture
def fake():
    return FakeProxy(score_fn=by_env)


@pytest.fixture
def client(fake):
    with RewardClient(env_cfg()["reward_model"], http_transport=fake.transport()) as client:
        yield Recording(client)


def run_chunks(env: StandInLiberoEnv, chunks: int, chunk: int = 8):
    env.reset()
    rewards, infos = [], []
    for _ in range(chunks):
        chunk_rewards, _, _, infos_list = env.chunk_step(chunk)
        rewards.append(chunk_rewards)
        infos.extend(infos_list)
    return np.concatenate(rewards, axis=1), infos


def expected_end_steps(success_steps, max_steps):
    return [s if s is not None and s <= max_steps else max_steps for s in success_steps]


def test_each_episode_is_scored_once_at_its_end_with_its_own_frames(fake, client):
    success = [3, 10, None, 5, None, 17]
    env = StandInLiberoEnv(env_cfg(), success, client=client)
    rewards, infos = run_chunks(env, 3)
    ends = expected_end_steps(success, 24)
    # One request per env, with that env's task text and frames from reset (step 0) to its end.
    per_task = collections.Counter(b["task_text"] for b in fake.score_requests)
    assert per_task == {f"task for env {i}": 1 for i in range(6)}
    for body in fake.score_requests:
        env_id = int(body["task_text"].rsplit(" ", 1)[1])
        tags = [frame_tag(f) for f in decode_npy(body["frames_npy"])]
        assert {e for e, _ in tags} == {env_id}
        assert tags[0][1] == 0 and tags[-1][1] == ends[env_id] and len(tags) == min(8, ends[env_id] + 1)
    # Rewards: coef x (score >= 0.5) once, on the end step (relative rewards), else 0.
    expected = np.zeros((6, 24))
    for env_id, end in enumerate(ends):
        expected[env_id, end - 1] = COEF * (ENV_SCORES[env_id] >= 0.5)
    np.testing.assert_allclose(rewards, expected)
    last = infos[-1]["episode"]
    np.testing.assert_allclose(last["vlm_score"], [ENV_SCORES[i] for i in range(6)], rtol=1e-6)
    np.testing.assert_array_equal(last["vlm_fallback"], np.zeros(6))
    # Ground truth stays simulator-driven.
    np.testing.assert_array_equal(last["success_once"], [s is not None for s in success])


def test_envs_ending_in_the_same_step_are_scored_in_one_call(client):
    env = StandInLiberoEnv(env_cfg(), [None, 5, None, 5, 9, None], client=client)
    run_chunks(env, 3)
    assert [sorted(call) for call in client.calls] == [
        ["task for env 1", "task for env 3"], ["task for env 4"],
        ["task for env 0", "task for env 2", "task for env 5"]]


def test_a_vlm_that_agrees_with_the_simulator_reproduces_the_native_rewards(fake):
    success = [4, None, 12, 20, None, 1]

    def agrees(body, frames):  # success <=> the episode ended before truncation
        return 1.0 if frame_tag(frames[-1])[1] < 24 else 0.0

    fake.score_fn = agrees
    native, _ = run_chunks(StandInLiberoEnv(env_cfg(reward_model=False), success), 3)
    with RewardClient(env_cfg()["reward_model"], http_transport=fake.transport()) as client:
        vlm, _ = run_chunks(StandInLiberoEnv(env_cfg(), success, client=client), 3)
    np.testing.assert_array_equal(vlm, native)
    assert native.sum() == COEF * 4


@pytest.mark.parametrize("rel", [True, False])
def test_continuous_scores(fake, rel):
    cfg = env_cfg(use_rel_reward=rel, max_steps=16, model={"binary_reward": False})
    success = [3, None]
    with RewardClient(cfg["reward_model"], http_transport=fake.transport()) as client:
        rewards, _ = run_chunks(StandInLiberoEnv(cfg, success, client=client), 2, chunk=8)
    expected = np.zeros((2, 16))
    for env_id, end in enumerate(expected_end_steps(success, 16)):
        if rel:
            expected[env_id, end - 1] = COEF * ENV_SCORES[env_id]
        else:
            expected[env_id, end - 1:] = COEF * ENV_SCORES[env_id]
    np.testing.assert_allclose(rewards, expected, rtol=1e-6)


def test_failed_requests_fall_back_to_the_simulator_flag_marked_and_counted(fake):
    def fails_for_odd_envs(body, frames):
        env_id = frame_tag(frames[-1])[0]
        return error_response(502, "unparseable_score") if env_id % 2 else ENV_SCORES[env_id]

    fake.score_fn = fails_for_odd_envs
    success = [3, 10, None, None, 7, 6]
    cfg = env_cfg(model={"fallback": "env_success"})  # the explicit choice; never the default
    with RewardClient(cfg["reward_model"], http_transport=fake.transport()) as inner:
        client = Recording(inner)
        env = StandInLiberoEnv(cfg, success, client=client)
        rewards, infos = run_chunks(env, 3)
    ends = expected_end_steps(success, 24)
    # env 1 succeeded (fallback 1 -> 5), env 3 truncated (fallback 0 -> 0), env 5 succeeded.
    assert [rewards[i, ends[i] - 1] for i in range(6)] == [5.0, 5.0, 5.0, 0.0, 0.0, 5.0]
    last = infos[-1]["episode"]
    np.testing.assert_array_equal(last["vlm_fallback"], [0, 1, 0, 1, 0, 1])
    np.testing.assert_allclose(last["vlm_score"], [0.9, 1.0, 0.7, 0.0, 0.1, 1.0], rtol=1e-6)
    assert env.vlm_reward.failures == 3 and client.inner.stats.failures == 3


@pytest.mark.parametrize(("policy", "paid"), [("zero", [5.0, 0.0, 5.0, 0.0, 0.0, 0.0]), ("raise", None)])
def test_the_default_fallbacks_never_pay_the_simulators_flag(fake, policy, paid):
    def fails_for_odd_envs(body, frames):
        env_id = frame_tag(frames[-1])[0]
        return error_response(502, "unparseable_score") if env_id % 2 else ENV_SCORES[env_id]

    fake.score_fn = fails_for_odd_envs
    success = [3, 10, None, None, 7, 6]
    cfg = env_cfg(model={"fallback": policy})
    with RewardClient(cfg["reward_model"], http_transport=fake.transport()) as client:
        env = StandInLiberoEnv(cfg, success, client=client)
        if paid is None:
            with pytest.raises(BadGatewayError):
                run_chunks(env, 3)
            return
        rewards, infos = run_chunks(env, 3)
    ends = expected_end_steps(success, 24)
    assert [rewards[i, ends[i] - 1] for i in range(6)] == paid  # envs 1 and 5 succeeded: still 0
    np.testing.assert_array_equal(infos[-1]["episode"]["vlm_fallback"], [0, 1, 0, 1, 0, 1])


def test_fail_on_request_error_stops_the_step_with_the_proxys_code(fake):
    fake.score_fn = lambda body, frames: error_response(502, "unparseable_score")
    cfg = env_cfg(model={"fail_on_request_error": True})
    with RewardClient(cfg["reward_model"], http_transport=fake.transport()) as client:
        env = StandInLiberoEnv(cfg, [2, None], client=client)
        env.reset()
        env.step()
        with pytest.raises(BadGatewayError) as caught:
            env.step()
    assert caught.value.code == "unparseable_score"


def test_eval_settings_score_at_truncation_and_restart_after_auto_reset(fake):
    cfg = env_cfg(ignore_terminations=True, auto_reset=True, max_steps=16)
    with RewardClient(cfg["reward_model"], http_transport=fake.transport()) as client:
        env = StandInLiberoEnv(cfg, [3, None, 9], client=client)
        env.reset()
        finals = []
        for _ in range(32):
            _, _, _, _, infos = env.step()
            if "final_info" in infos:
                finals.append(infos["final_info"]["episode"])
    assert len(fake.score_requests) == 6  # 3 envs x 2 episodes, all at truncation
    for body in fake.score_requests:
        steps = [frame_tag(f)[1] for f in decode_npy(body["frames_npy"])]
        assert steps[0] == 0 and steps[-1] == 16
    assert len(finals) == 2
    np.testing.assert_allclose(finals[0]["vlm_score"], [0.9, 0.2, 0.7], rtol=1e-6)


@pytest.mark.parametrize("obs_key", ["full_images", "images"])
def test_older_observation_layouts_score_the_same(fake, obs_key):
    success = [3, None, 6]
    with RewardClient(env_cfg()["reward_model"], http_transport=fake.transport()) as client:
        reference, _ = run_chunks(StandInLiberoEnv(env_cfg(), success, client=client), 3)
        other, _ = run_chunks(StandInLiberoEnv(env_cfg(), success, client=client, obs_key=obs_key), 3)
    np.testing.assert_array_equal(other, reference)
    bodies = fake.score_requests
    for first, second in zip(bodies[:3], bodies[3:], strict=True):
        np.testing.assert_array_equal(decode_npy(first["frames_npy"]), decode_npy(second["frames_npy"]))


def test_frame_memory_stays_bounded_over_a_long_episode(fake):
    cfg = env_cfg(max_steps=300, model={"nframes": 16, "buffer_frames": 32})
    with RewardClient(cfg["reward_model"], http_transport=fake.transport()) as client:
        env = StandInLiberoEnv(cfg, [None, None], client=client)
        env.reset()
        for _ in range(299):
            env.step()
            assert max(len(b) for b in env.vlm_reward.buffers) <= 33
        env.step()
    for body in fake.score_requests:
        steps = [frame_tag(f)[1] for f in decode_npy(body["frames_npy"])]
        assert len(steps) == 16 and steps[0] == 0 and steps[-1] == 300


def test_no_reward_model_block_means_no_hook():
    assert LiberoVLMReward.from_env_cfg(env_cfg(reward_model=False), 4) is None
    assert LiberoVLMReward.from_env_cfg(env_cfg(model={"enable": False}), 4) is None
