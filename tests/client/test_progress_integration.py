"""Run D end to end: the hook in the stand-in LiberoEnv → the real proxy's POST /progress/batch →
the fake vLLM's /v1/embeddings (its vector: the mean colour of the frames, / 255), with the
proxy's reference store on; then the reward-quality report on the audit log the run wrote."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from proxy.config import settings_from_dict
from reports.audit import read_audit_log
from reports.progress_quality import progress_numbers
from rlinf_client import NotFoundError, RewardClient
from tests.client.standin_env import StandInLiberoEnv
from tests.helpers import PROMPTS_DIR

COEF, STEPS = 5.0, 6
SUCCESS_COLOUR = (200, 200, 200)
# Task 0: env 0 succeeds at step 2; envs 1-3 fail (truncated at step 6) at three distances from it.
# Task 1: env 4 only fails: it has no reference. Every frame of an env has the env's colour.
COLOURS = [SUCCESS_COLOUR, (180, 190, 200), (120, 120, 140), (20, 40, 60), (90, 90, 90)]
TASKS = [0, 0, 0, 0, 1]
SUCCESS = [2, None, None, None, None]


class ColourEnv(StandInLiberoEnv):
    """The stand-in env with solid frames of each env's colour (the fake embeds the mean colour)."""

    def _simulate(self):
        _, success = super()._simulate()
        frames = np.empty((self.num_envs, self.frame_size, self.frame_size, 3), np.uint8)
        frames[:] = np.asarray(COLOURS, np.uint8)[:, None, None, :]
        return frames, success


@pytest.fixture
def run_d_proxy(proxy_factory, fake_vllm_factory, tmp_path):
    embed = fake_vllm_factory(served_model_name="fake-embed")
    audit = tmp_path / "audit.jsonl"
    settings = settings_from_dict({
        "proxy": {"prompts_dir": str(PROMPTS_DIR), "audit_log": str(audit), "health_interval_s": 0.2,
                  "reference_store": {"dir": str(tmp_path / "references"), "max_successes": 8}},
        "backends": {"embed": {"model": "fake-embed", "kind": "embedding", "endpoints": [embed.base_url],
                               "frames": {"nframes": 4},
                               "retry": {"attempts": 3, "backoff_s": [0.01, 0.02], "timeout_s": 10,
                                         "deadline_s": 30}}}})
    server = proxy_factory(settings)
    server.audit_path = audit
    server.embed = embed
    return server


def expected_progress() -> list[float]:
    """SRPO for task 0's failures against its one stored success (the one centre): distances in the
    raw space, min-max normalised, sigmoid(10 (0.5 - n))."""
    distances = [math.dist(np.divide(c, 255), np.divide(SUCCESS_COLOUR, 255)) for c in COLOURS[1:4]]
    low, high = min(distances), max(distances)
    return [1 / (1 + math.exp(-10 * (0.5 - (d - low) / (high - low)))) for d in distances]


def run_d_cfg(proxy, **model) -> dict:
    return {"reward_coef": COEF, "use_rel_reward": True, "ignore_terminations": False, "auto_reset": False,
            "max_episode_steps": STEPS,
            "reward_model": {"enable": True, "endpoint": f"{proxy.url}/score", "backend": "embed",
                             "reward_source": "progress", "binary_reward": False, "fallback": "raise",
                             "nframes": 4, "buffer_frames": 8, "timeout": 30, "run": "runD_srpo", **model}}


@pytest.mark.parametrize("transport", ["binary", "inline"])
def test_run_d_pays_srpo_progress_through_the_real_proxy_and_the_report_reads_it(run_d_proxy, transport):
    cfg = run_d_cfg(run_d_proxy, transport=transport)
    with RewardClient(cfg["reward_model"]) as client:
        env = ColourEnv(cfg, SUCCESS, client=client, frame_size=56)
        env.task_ids = np.asarray(TASKS)
        env.reset()
        rewards, _, _, infos = env.chunk_step(STEPS)
    run_d_proxy.flush_audit()
    lines = [json.loads(line) for line in run_d_proxy.audit_path.read_text().splitlines()]
    by_env = {line["metadata"]["env"]: line for line in lines}
    paid_progress = [by_env[e]["progress"] for e in (1, 2, 3)]
    # the success pays run A's reward on its end step; the failures 0.6 x the proxy's progress, on theirs
    assert rewards[0, 1] == COEF and np.count_nonzero(rewards[0]) == 1
    np.testing.assert_allclose(rewards[1:4, STEPS - 1], [COEF * 0.6 * p for p in paid_progress], rtol=1e-12)
    assert rewards[4, STEPS - 1] == 0.0 and not rewards[1:, :STEPS - 1].any()
    # which is SRPO's from the colours (JPEG moves a colour a little: the steep middle of the sigmoid
    # shows it most); the nearest and farthest failures are σ(5) and σ(-5) whatever the distances
    progress = expected_progress()
    assert paid_progress == pytest.approx(progress, abs=5e-3)
    assert paid_progress[0] == pytest.approx(1 / (1 + math.exp(-5)), abs=1e-12)
    assert paid_progress[2] == pytest.approx(1 / (1 + math.exp(5)), abs=1e-12)
    last = infos[-1]["episode"]
    np.testing.assert_allclose(last["vlm_score"], [1.0, *paid_progress, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(last["vlm_no_reference"], [0, 0, 0, 0, 1])
    np.testing.assert_array_equal(last["vlm_fallback"], np.zeros(5))
    assert env.vlm_reward.no_reference == 1 and client.stats.requests == 2  # one request per step with endings
    assert len(run_d_proxy.embed.fake.embedding_requests) == 5

    # the audit log: one progress line per episode; the failures measured against the stored success
    assert [line["kind"] for line in lines] == ["progress"] * 5
    assert [by_env[e]["outcome"] for e in range(5)] == ["success", "progress", "progress", "progress", "no_reference"]
    assert by_env[1]["reference"]["batch_successes"] == 0 and by_env[1]["reference"]["stored"] == 1
    assert {line["metadata"]["run"] for line in lines} == {"runD_srpo"}

    # and the report measures them apart from scores
    run_d_proxy.flush_audit()
    summary = read_audit_log(run_d_proxy.audit_path)
    assert summary.backends() == [] and summary.progress.backends() == ["embed"]
    task0 = progress_numbers(summary.progress.groups[("embed", "0")])
    assert (task0["successes"], task0["rated"], task0["no_reference"]) == (1, 3, 0)
    assert task0["progress_mean"] == pytest.approx(sum(paid_progress) / 3, rel=1e-12)
    assert progress_numbers(summary.progress.groups[("embed", "1")])["no_reference"] == 1


def test_a_request_the_proxy_refuses_stops_the_run_with_its_code(run_d_proxy):
    cfg = run_d_cfg(run_d_proxy, backend="no-such-backend")
    with RewardClient(cfg["reward_model"]) as client:
        env = ColourEnv(cfg, SUCCESS, client=client, frame_size=56)
        env.reset()
        with pytest.raises(NotFoundError) as caught:
            env.chunk_step(STEPS)
    assert caught.value.code == "unknown_backend" and client.stats.failures == 1
