"""The RLinf hook with reward_source: progress (run D) in the stand-in LiberoEnv."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from rlinf_client import BadGatewayError, NoReferenceError, RewardClient
from tests.client._progress_support import FakeProgressProxy, item_error
from tests.client._support import FakeProxy, error_response
from tests.client.standin_env import StandInLiberoEnv
from tests.client.test_hook import COEF, env_cfg, run_chunks

# Six envs, four tasks: task 0 succeeds at step 3 (env 0) and fails twice (envs 1, 2) at the
# truncation, task 1 succeeds at step 5 (env 3) and fails once (env 4), task 2 only fails (env 5).
TASKS = [0, 0, 0, 1, 1, 2]
SUCCESS = [3, None, None, 5, None, None]
STEPS = 8
ENDS = [3, 8, 8, 5, 8, 8]


def progress_cfg(**model) -> dict:
    return env_cfg(max_steps=STEPS, model={"reward_source": "progress", "binary_reward": False, "backend": "embed",
                                           "nframes": 4, "buffer_frames": 8, **model})


def run_env(fake: FakeProgressProxy, cfg: dict, *, task_ids=TASKS, success=SUCCESS):
    with RewardClient(cfg["reward_model"], http_transport=fake.transport()) as client:
        env = StandInLiberoEnv(cfg, success, client=client)
        env.task_ids = None if task_ids is None else np.asarray(task_ids)
        rewards, infos = run_chunks(env, 1, chunk=STEPS)
    return env, rewards, infos


def paid(rewards: np.ndarray) -> list[float]:
    return [float(rewards[env, end - 1]) for env, end in enumerate(ENDS)]


def test_successes_pay_as_natively_and_failures_their_progress_times_the_coefficient(caplog):
    fake = FakeProgressProxy(remember=True)  # the proxy's reference store keeps earlier successes
    with caplog.at_level(logging.WARNING, "rlinf_client"):
        env, rewards, infos = run_env(fake, progress_cfg())
    # one request per step in which episodes ended, each with the env's task ids and success flags
    assert [[(i["metadata"]["task_id"], i["metadata"]["env_success"]) for i in body["items"]]
            for body in fake.batches] == [[(0, True)], [(1, True)], [(0, False), (0, False), (1, False), (2, False)]]
    assert all(body["backend"] == "embed" for body in fake.batches)
    # progress (fake: env / 10) x 0.6 x reward_coef; env 5's task has no success: the native 0
    assert paid(rewards) == pytest.approx([COEF, COEF * 0.1 * 0.6, COEF * 0.2 * 0.6, COEF, COEF * 0.4 * 0.6, 0.0])
    assert np.count_nonzero(rewards) == 5  # relative rewards: once, on the end step
    last = infos[-1]["episode"]
    np.testing.assert_allclose(last["vlm_score"], [1.0, 0.1, 0.2, 1.0, 0.4, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(last["vlm_no_reference"], [0, 0, 0, 0, 0, 1])
    np.testing.assert_array_equal(last["vlm_fallback"], np.zeros(6))
    assert (env.vlm_reward.no_reference, env.vlm_reward.failures) == (1, 0)
    assert "1 of 4 episodes ending now failed with no success of their task" in caplog.text


def test_the_successes_rewards_equal_run_as():
    fake = FakeProgressProxy(remember=True)
    _, rewards, _ = run_env(fake, progress_cfg())
    native, _ = run_chunks(StandInLiberoEnv(env_cfg(reward_model=False, max_steps=STEPS), SUCCESS), 1, chunk=STEPS)
    succeeded = [s is not None for s in SUCCESS]
    np.testing.assert_array_equal(rewards[succeeded], native[succeeded])


def test_the_coefficient_and_absolute_rewards():
    fake = FakeProgressProxy(remember=True)
    _, rewards, _ = run_env(fake, progress_cfg(progress_coef=1.0) | {"use_rel_reward": False})
    # without use_rel_reward the value holds from the end step on, as RLinf's own success reward does
    for env, end in enumerate(ENDS):
        assert not rewards[env, :end - 1].any()
        np.testing.assert_allclose(rewards[env, end - 1:], [COEF, COEF * 0.1, COEF * 0.2, COEF, COEF * 0.4, 0][env])


def test_no_reference_raises_when_told_to():
    fake = FakeProgressProxy(remember=True)
    with pytest.raises(NoReferenceError, match="task\\(s\\) 2 had no success") as caught:
        run_env(fake, progress_cfg(on_no_reference="raise"))
    assert caught.value.code == "no_reference"


def test_without_a_reference_store_every_late_failure_is_no_reference_and_paid_natively():
    fake = FakeProgressProxy(remember=False)  # successes ended earlier, in other requests
    env, rewards, infos = run_env(fake, progress_cfg())
    assert paid(rewards) == [COEF, 0.0, 0.0, COEF, 0.0, 0.0]
    np.testing.assert_array_equal(infos[-1]["episode"]["vlm_no_reference"], [0, 1, 1, 0, 1, 1])
    assert env.vlm_reward.no_reference == 4


def task_one_fails(item, frames, with_success):
    if item["metadata"]["task_id"] == 1:
        return item_error(502, "upstream_error")
    return FakeProgressProxy()._default(item, frames, with_success)


@pytest.mark.parametrize(("policy", "env3", "env4"), [("zero", 0.0, 0.0), ("env_success", COEF, 0.0)])
def test_a_failed_item_follows_the_fallback_policy_marked_and_counted(policy, env3, env4):
    fake = FakeProgressProxy(rate=task_one_fails, remember=True)
    env, rewards, infos = run_env(fake, progress_cfg(fallback=policy))
    assert paid(rewards) == pytest.approx([COEF, COEF * 0.06, COEF * 0.12, env3, env4, 0.0])
    last = infos[-1]["episode"]
    np.testing.assert_array_equal(last["vlm_fallback"], [0, 0, 0, 1, 1, 0])
    np.testing.assert_array_equal(last["vlm_no_reference"], [0, 0, 0, 0, 0, 1])  # a fallback is not no_reference
    assert env.vlm_reward.failures == 2 and env.vlm_reward.client.stats.failure_reasons == {"upstream_error": 2}


def test_fallback_raise_stops_the_step_with_the_typed_error():
    fake = FakeProgressProxy(rate=task_one_fails, remember=True)
    with pytest.raises(BadGatewayError) as caught:
        run_env(fake, progress_cfg(fallback="raise"))
    assert caught.value.code == "upstream_error"


def test_a_whole_request_that_fails_falls_back_for_every_episode_in_it():
    fake = FakeProgressProxy(remember=True, script=[None, None, error_response(404, "unknown_backend")])
    env, rewards, infos = run_env(fake, progress_cfg(fallback="zero"))
    assert paid(rewards) == [COEF, 0.0, 0.0, COEF, 0.0, 0.0]
    np.testing.assert_array_equal(infos[-1]["episode"]["vlm_fallback"], [0, 1, 1, 0, 1, 1])
    assert env.vlm_reward.failures == 4 and env.vlm_reward.no_reference == 0


def test_without_task_ids_the_task_text_is_the_task_id():
    fake = FakeProgressProxy(remember=True)
    run_env(fake, progress_cfg(), task_ids=None)
    sent = [(i["metadata"]["task_id"], i["task_text"]) for body in fake.batches for i in body["items"]]
    assert all(task_id == text for task_id, text in sent) and len(sent) == 6


def test_score_mode_logs_no_no_reference_metric():
    cfg = env_cfg(max_steps=STEPS)
    with RewardClient(cfg["reward_model"], http_transport=FakeProxy().transport()) as client:
        _, infos = run_chunks(StandInLiberoEnv(cfg, SUCCESS, client=client), 1, chunk=STEPS)
    assert set(infos[-1]["episode"]) >= {"vlm_score", "vlm_fallback"}
    assert "vlm_no_reference" not in infos[-1]["episode"]
