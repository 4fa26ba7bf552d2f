"""Reward-quality alarms (the proxy's `quality` field) in the hook: keep, native and raise.

The proxy's answers here come from a FakeProxy that adds the `quality` object the proxy's live
monitor sends, keyed as the proxy keys it: (metadata.run, the backend, metadata.task_id)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import numpy as np
import pytest

from rlinf_client import QualityAlarmError, RewardClient, RewardClientError
from tests.client._support import FakeProxy, frame_tag, score_body
from tests.client.standin_env import StandInLiberoEnv
from tests.client.test_hook import COEF, ENV_SCORES, env_cfg, expected_end_steps, run_chunks

REASON = "false-success rate 0.45 > 0.3 over 64 episodes"
# envs 1 and 3 end together at step 10 (one scoring call), env 5 at 17, envs 2 and 4 at truncation (24)
SUCCESS = [3, 10, None, 10, None, 17]


def quality(metadata: dict[str, Any], status: str) -> dict[str, Any]:
    """The proxy's `quality` object for an episode's answer."""
    return {"status": status, "reason": REASON if status == "alarm" else None,
            "key": {"run": metadata.get("run"), "backend": "fake", "task_id": str(metadata["task_id"])}}


@dataclass
class QualityProxy(FakeProxy):
    """FakeProxy whose answers (on /score and in /score/batch items) carry `quality`: alarm for the
    envs in `alarmed`, `others` for the rest (a status, or a whole value: None, a string, ...)."""

    alarmed: frozenset[int] = frozenset()
    others: Any = "ok"

    def _score(self, body: dict) -> dict | httpx.Response:
        answer = super()._score(body)
        if isinstance(answer, httpx.Response):
            return answer
        metadata = body["metadata"]
        if metadata["env"] in self.alarmed:
            return {**answer, "quality": quality(metadata, "alarm")}
        if self.others in ("ok", "unknown"):
            return {**answer, "quality": quality(metadata, self.others)}
        return answer if self.others == "absent" else {**answer, "quality": self.others}


def by_env(body, frames):
    return ENV_SCORES[frame_tag(frames[-1])[0]]


def run_env(fake: FakeProxy, **model: Any):
    """Three chunks of 8 steps over SUCCESS's six envs; (rewards, last infos, the hook)."""
    cfg = env_cfg(model={"run": "runB", **model})
    with RewardClient(cfg["reward_model"], http_transport=fake.transport()) as client:
        env = StandInLiberoEnv(cfg, SUCCESS, client=client)
        rewards, infos = run_chunks(env, 3)
    return rewards, infos[-1]["episode"], env.vlm_reward


def alarm_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "rlinf_client" and r.levelname == "WARNING" and "reward-quality alarm" in r.getMessage()]


def batch_paths(fake: FakeProxy) -> list[str]:
    return [path for path, body in fake.requests if path == "/score/batch" and body.get("items")]


@pytest.mark.parametrize("batch", ["never", "auto"])
def test_keep_pays_the_vlm_score_and_marks_the_alarm(batch, caplog):
    fake = QualityProxy(score_fn=by_env, batch=True, alarmed=frozenset({1, 3, 5}))
    rewards, last, hook = run_env(fake, batch=batch)
    expected = np.zeros((6, 24))
    for env_id, end in enumerate(expected_end_steps(SUCCESS, 24)):
        expected[env_id, end - 1] = COEF * (ENV_SCORES[env_id] >= 0.5)
    np.testing.assert_array_equal(rewards, expected)
    np.testing.assert_array_equal(last["vlm_quality_alarm"], [0, 1, 0, 1, 0, 1])
    np.testing.assert_array_equal(last["vlm_fallback"], np.zeros(6))
    np.testing.assert_allclose(last["vlm_score"], [ENV_SCORES[i] for i in range(6)], rtol=1e-6)
    assert (hook.quality_alarms, hook.failures) == (3, 0)
    # One warning per step that saw alarms: envs 1 and 3 together, then env 5.
    first, second = alarm_warnings(caplog)
    assert first.startswith("reward model: 2 of 2 episodes ending now came with a reward-quality alarm")
    assert f"run=runB backend=fake task=1: {REASON} x1; run=runB backend=fake task=3: {REASON} x1" in first
    assert "paid the VLM's score all the same (on_quality_alarm: keep)" in first
    assert f"task=5: {REASON} x1" in second and second.endswith("3 alarmed episodes so far")
    assert bool(batch_paths(fake)) == (batch == "auto")


@pytest.mark.parametrize("batch", ["never", "auto"])
def test_native_pays_the_simulators_reward_for_exactly_the_alarmed_episodes(batch, caplog):
    # env 1 succeeded but the VLM says 0.2 (reward 0); env 2 never succeeded but the VLM says 0.7 (reward 5)
    native, _ = run_chunks(StandInLiberoEnv(env_cfg(reward_model=False), SUCCESS), 3)
    vlm, _, _ = run_env(QualityProxy(score_fn=by_env, batch=True), batch=batch)
    fake = QualityProxy(score_fn=by_env, batch=True, alarmed=frozenset({1, 2}))
    rewards, last, hook = run_env(fake, batch=batch, on_quality_alarm="native")
    np.testing.assert_array_equal(rewards[[1, 2]], native[[1, 2]])
    np.testing.assert_array_equal(rewards[[0, 3, 4, 5]], vlm[[0, 3, 4, 5]])
    assert (native[1].sum(), native[2].sum(), vlm[1].sum(), vlm[2].sum()) == (COEF, 0.0, 0.0, COEF)
    np.testing.assert_array_equal(last["vlm_fallback"], [0, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(last["vlm_quality_alarm"], [0, 1, 1, 0, 0, 0])
    np.testing.assert_allclose(last["vlm_score"], [0.9, 1.0, 0.0, 0.95, 0.1, 0.6], rtol=1e-6)
    assert (hook.quality_alarms, hook.failures) == (2, 0)  # failures: requests that failed, none here
    warnings = alarm_warnings(caplog)
    assert len(warnings) == 2 and all("paid the simulator's reward instead (marked in vlm_fallback) "
                                      "(on_quality_alarm: native)" in w for w in warnings)
    assert bool(batch_paths(fake)) == (batch == "auto")


def test_raise_stops_the_run_naming_the_run_backend_task_and_reason():
    fake = QualityProxy(score_fn=by_env, alarmed=frozenset({3}))
    with pytest.raises(QualityAlarmError) as caught:
        run_env(fake, on_quality_alarm="raise")
    error = caught.value
    assert isinstance(error, RewardClientError) and error.code == "quality_alarm"
    assert f"run=runB backend=fake task=3: {REASON} x1" in str(error) and "on_quality_alarm: raise" in str(error)
    assert [alarm["key"] for alarm in error.alarms] == [{"run": "runB", "backend": "fake", "task_id": "3"}]
    # env 3 ends at step 10 with env 1: the step raised before paying either
    assert len(fake.score_requests) == 3


@pytest.mark.parametrize("others", ["absent", None, "ok", "unknown", "alarm", {"status": "bogus"}])
@pytest.mark.parametrize("policy", ["native", "raise"])
def test_answers_without_an_alarm_are_paid_as_before(others, policy, caplog):
    """No quality (an older proxy), null, ok, unknown, or a value that is not a quality object
    (the bare string "alarm" included): no information, paid and logged exactly as before."""
    before, last_before, _ = run_env(FakeProxy(score_fn=by_env))
    rewards, last, hook = run_env(QualityProxy(score_fn=by_env, others=others), on_quality_alarm=policy)
    np.testing.assert_array_equal(rewards, before)
    for key in ("vlm_score", "vlm_fallback"):
        np.testing.assert_array_equal(last[key], last_before[key])
    np.testing.assert_array_equal(last["vlm_quality_alarm"], np.zeros(6))
    assert hook.quality_alarms == 0 and alarm_warnings(caplog) == []


def test_a_new_episode_clears_its_envs_alarm():
    fake = QualityProxy(score_fn=by_env, alarmed=frozenset({0}))
    cfg = env_cfg(auto_reset=True, max_steps=8)
    with RewardClient(cfg["reward_model"], http_transport=fake.transport()) as client:
        env = StandInLiberoEnv(cfg, [3, None], client=client)
        env.reset()
        for _ in range(3):
            *_, infos = env.step()
    np.testing.assert_array_equal(infos["final_info"]["episode"]["vlm_quality_alarm"], [1, 0])
    np.testing.assert_array_equal(env.vlm_reward.episode_info()["vlm_quality_alarm"], [0, 0])


# -- over real HTTP on loopback ------------------------------------------------------------------
class _Handler(BaseHTTPRequestHandler):
    """/score and /score/batch in the proxy's answer shape, alarm for env 1 (JSON bodies: inline)."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path == "/score/batch":
            if not body["items"]:
                return self._send(422, {"error": {"code": "invalid_request", "message": "items: too short"}})
            return self._send(200, {"results": [{"index": i, "ok": True, "status": 200, "result": self._answer(item)}
                                                for i, item in enumerate(body["items"])]})
        return self._send(200, self._answer(body))

    @staticmethod
    def _answer(item: dict) -> dict:
        metadata = item["metadata"]
        return {**score_body(ENV_SCORES[metadata["env"]]),
                "quality": quality(metadata, "alarm" if metadata["env"] == 1 else "ok")}

    def _send(self, status: int, answer: dict) -> None:
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def loopback_proxy() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.paths = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, name="quality-proxy",
                              daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_alarms_in_batch_items_over_http_pay_the_native_reward(loopback_proxy):
    host, port = loopback_proxy.server_address[:2]
    cfg = env_cfg(model={"endpoint": f"http://{host}:{port}/score", "batch": "auto", "transport": "inline",
                         "run": "runB", "on_quality_alarm": "native"})
    env = StandInLiberoEnv(cfg, [None, 5, 5], frame_size=16)  # env 1 succeeded; the VLM says 0.2
    try:
        env.reset()
        rewards, *_, infos = env.chunk_step(8)
    finally:
        env.vlm_reward.close()
    assert "/score/batch" in loopback_proxy.paths  # envs 1 and 2 ended together: one batch
    assert [rewards[1, 4], rewards[2, 4]] == [COEF, COEF]  # env 1: the simulator's success, not 0.2
    np.testing.assert_array_equal(infos[-1]["episode"]["vlm_quality_alarm"], [0, 1, 0])
    np.testing.assert_array_equal(infos[-1]["episode"]["vlm_fallback"], [0, 1, 0])
