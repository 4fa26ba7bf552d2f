"""The client against the real proxy and fake vLLM servers on loopback."""

from __future__ import annotations

import json
import re
import threading

import cv2
import numpy as np
import pytest

from proxy.config import settings_from_dict
from rlinf_client import (
    APIConnectionError,
    AsyncRewardClient,
    BadGatewayError,
    Episode,
    RewardClient,
    RewardModelConfig,
)
from tests.client.standin_env import StandInLiberoEnv
from tests.conftest import libero_settings_dict
from tests.fakes.episodes import episode_frames, frame_level
from tests.fakes.fake_vllm import decode_video_part
from tests.helpers import free_port, release_when

QWEN = "qwen2_5_vl_vllm"


def last_frame_level(body: dict) -> float:
    """The grey level of the last frame the proxy sent upstream (qwen_video layout)."""
    for message in body["messages"]:
        for part in message["content"] if isinstance(message["content"], list) else []:
            if part.get("type") == "video_url":
                jpeg = decode_video_part(part["video_url"]["url"], num_frames=-1)[-1]
                bgr = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
                return frame_level(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
    raise AssertionError("no video in the upstream request")


def brightness_reply(body: dict) -> str:
    """A fake model whose score depends on the pictures: the last frame's brightness, in tens."""
    return f"<score>{round(last_frame_level(body) / 255 * 10) * 10}</score>"


def client_cfg(proxy_server, **overrides) -> dict:
    return {"enable": True, "endpoint": f"{proxy_server.url}/score", "backend": QWEN,
            "timeout": 30, "backend_kwargs": {"score_mode": "auto"}, **overrides}


def test_inline_and_path_transports_give_the_same_score(proxy_server, fake_qwen, media_root):
    fake_qwen.fake.state.reply_fn = brightness_reply
    frames = episode_frames(60, 128, 128)
    results = {}
    for transport in ("inline", "path"):
        cfg = client_cfg(proxy_server, transport=transport, temp_video_dir=str(media_root), batch="never")
        with RewardClient(cfg) as client:
            results[transport] = client.score_episode(frames, "put the bowl on the plate", fallback=0.0)
    inline, path = results["inline"], results["path"]
    assert inline.ok and path.ok and inline.score == path.score == 0.9
    for key in ("count", "indices", "source_count", "size", "fps"):
        assert inline.response["frames"][key] == path.response["frames"][key], key
    # the real rate rides in the MP4's own timescale: equal to its precision
    assert inline.response["frames"]["sampled_fps"] == pytest.approx(path.response["frames"]["sampled_fps"], rel=1e-3)
    assert inline.response["frames"]["fps"] == 4.0  # the seed's video_fps, told to vLLM either way
    upstream = [r["media_io_kwargs"] for r in fake_qwen.chat_requests]
    assert upstream[0] == upstream[1]
    assert list(media_root.iterdir()) == []  # the temporary MP4 was deleted


def test_the_binary_transport_sends_the_same_episodes_as_inline_one_by_one_and_in_a_batch(proxy_server, fake_qwen):
    """transport: binary (a multipart body with the raw .npy) against inline base64: the same frames
    reach vLLM and the same scores come back, for /score and for /score/batch."""
    fake_qwen.fake.state.reply_fn = brightness_reply
    episodes = [Episode(episode_frames(30 + 7 * i, 96, 96), f"task {i}", 0.0) for i in range(3)]
    seen = {}
    for transport in ("inline", "binary"):
        for batch in ("never", "auto"):
            fake_qwen.fake.reset()
            fake_qwen.fake.state.reply_fn = brightness_reply
            with RewardClient(client_cfg(proxy_server, transport=transport, batch=batch)) as client:
                results = client.score_episodes(episodes)
            assert all(r.ok for r in results), [r.error for r in results]
            videos = sorted(json.dumps(r["messages"][-1]["content"][0]) for r in fake_qwen.chat_requests)
            seen[transport, batch] = ([r.score for r in results], [r.response["frames"]["sha256"] for r in results],
                                      videos)
    assert seen["inline", "never"] == seen["binary", "never"] == seen["inline", "auto"] == seen["binary", "auto"]


def test_keep_temp_video_keeps_the_mp4(proxy_server, media_root):
    cfg = client_cfg(proxy_server, transport="path", temp_video_dir=str(media_root),
                     keep_temp_video=True)
    with RewardClient(cfg) as client:
        assert client.score_episode(episode_frames(20, 64, 64), "t").ok
    [kept] = list(media_root.iterdir())
    assert kept.suffix == ".mp4" and kept.stat().st_size > 0


def test_primo_backend(proxy_server):
    with RewardClient(client_cfg(proxy_server, backend="PRIMO-R1")) as client:
        result = client.score_episode(episode_frames(20, 64, 64), "t")
    assert result.ok and result.score == 0.6 and result.response["backend"] == "PRIMO-R1"


@pytest.mark.parametrize("batch", ["never", "auto"])
async def test_fifty_envs_ending_together_are_scored_concurrently(proxy_factory, fake_qwen, fake_primo, media_root,
                                                                   batch):
    # Overlap, not time: the fake holds every generation until all 50 are in flight at once (a
    # client that scored one by one would never get there: the watcher gives up after 60 s). A
    # proxy of its own, whose one attempt per call waits as long as the hang bound: a held call is
    # never timed out and retried (50 chat requests are 50 episodes), however loaded the machine.
    data = libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root)
    data["backends"][QWEN]["retry"] = {"attempts": 1, "parse_attempts": 1, "backoff_s": [0.01, 0.05],
                                       "timeout_s": 300, "deadline_s": 300}
    proxy = proxy_factory(settings_from_dict(data))
    release = threading.Event()
    fake_qwen.script(*[{"hold": release}] * 50)
    episodes = [Episode(episode_frames(16, 56, 56), f"task {i}", 0.0) for i in range(50)]
    with release_when(lambda: fake_qwen.fake.state.chat_count >= 50, release, 60,
                      "50 generations in flight at once") as seen:
        async with AsyncRewardClient(client_cfg(proxy, batch=batch, nframes=4, timeout=300)) as client:
            results = await client.score_episodes(episodes)
    assert seen["met"]
    assert all(r.ok for r in results) and len(results) == 50
    assert fake_qwen.fake.state.chat_count == 50
    # requests beyond one per episode and the client's one GET /frame-rules
    batch_calls = client.stats.requests - 50 - 1
    assert (batch_calls < 0) if batch == "auto" else (batch_calls == 0)


def test_unparseable_replies_raise_with_fail_on_request_error(proxy_server, fake_qwen):
    fake_qwen.config.default_text = "I cannot tell from these pictures."
    with (RewardClient(client_cfg(proxy_server, fail_on_request_error=True)) as client,
          pytest.raises(BadGatewayError) as caught):
        client.score_episode(episode_frames(8, 64, 64), "t", fallback=1.0)
    assert caught.value.code == "unparseable_score" and caught.value.status_code == 502


def test_unparseable_replies_fall_back_marked_without_it(proxy_server, fake_qwen):
    fake_qwen.config.default_text = "I cannot tell from these pictures."
    with RewardClient(client_cfg(proxy_server, fallback="env_success")) as client:
        results = client.score_episodes([(episode_frames(8, 64, 64), "t", 1.0),
                                         (episode_frames(8, 64, 64), "t", 0.0)])
        assert client.stats.failures == 2
    assert [(r.ok, r.value, r.reason) for r in results] == [
        (False, 1.0, "unparseable_score"), (False, 0.0, "unparseable_score")]


def test_a_proxy_that_is_down(unused_port):
    cfg = {"endpoint": f"http://127.0.0.1:{unused_port}/score", "max_retries": 1, "timeout": 5}
    with RewardClient(cfg, fail_on_request_error=True) as client:
        with pytest.raises(APIConnectionError) as caught:
            client.score_episode(episode_frames(4, 32, 32), "t")
        assert caught.value.attempts == 2 and caught.value.code == "connection_error"
    with RewardClient(cfg) as client:
        result = client.score_episode(episode_frames(4, 32, 32), "t", fallback=0.0)
    assert (result.ok, result.value, result.reason) == (False, 0.0, "connection_error")


def test_hook_in_a_stand_in_env_against_the_real_proxy(proxy_server, fake_qwen):
    def by_task(body: dict) -> str:
        env_id = int(re.search(r"task for env (\d+)", json.dumps(body)).group(1))
        return f"<score>{env_id * 25}</score>"

    fake_qwen.fake.state.reply_fn = by_task
    cfg = {"reward_coef": 5.0, "use_rel_reward": True, "ignore_terminations": False,
           "auto_reset": False, "max_episode_steps": 16,
           "reward_model": client_cfg(proxy_server, nframes=8, buffer_frames=16)}
    env = StandInLiberoEnv(cfg, [3, None, 6, None], frame_size=56)
    try:
        env.reset()
        rewards, _, _, infos = env.chunk_step(16)
    finally:
        env.vlm_reward.close()
    ends = [3, 16, 6, 16]
    assert [rewards[i, end - 1] for i, end in enumerate(ends)] == [0.0, 0.0, 5.0, 5.0]
    assert rewards.sum() == 10.0
    np.testing.assert_allclose(infos[-1]["episode"]["vlm_score"], [0.0, 0.25, 0.5, 0.75])
    assert fake_qwen.fake.state.chat_count == 4


@pytest.fixture
def unused_port() -> int:
    return free_port()


def test_health(proxy_server, unused_port):
    with RewardClient(client_cfg(proxy_server)) as client:
        assert client.health()["status"] == "ok"
    with RewardClient(endpoint=f"http://127.0.0.1:{unused_port}") as client, \
            pytest.raises(APIConnectionError):
        client.health()


def test_the_hook_sends_ground_truth_and_ids_that_reach_the_audit_log_not_the_model(
        proxy_factory, fake_qwen, fake_primo, media_root, tmp_path):
    audit = tmp_path / "audit.jsonl"
    settings = settings_from_dict(libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root,
                                                       audit_log=str(audit)))
    proxy = proxy_factory(settings)
    cfg = {"reward_coef": 5.0, "use_rel_reward": True, "ignore_terminations": False, "auto_reset": True,
           "max_episode_steps": 8, "reward_model": client_cfg(proxy, nframes=4, buffer_frames=8, run="runB_qwen")}
    env = StandInLiberoEnv(cfg, [3, None, 5], frame_size=32)
    try:
        env.reset()
        env.chunk_step(8)  # env 0 ends at step 3 and env 2 at 5 (success), env 1 at 8 (truncated)
    finally:
        env.vlm_reward.close()
    proxy.flush_audit()
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    got = sorted((m["env"], m["episode_id"], m["env_success"], m["step"], m["task_id"], m["run"],
                  m["success_threshold"]) for m in (line["metadata"] for line in lines))
    threshold = RewardModelConfig().success_threshold  # the run's own, for the live monitor's "says success"
    assert got == [(0, "env0-ep1", True, 3, 0, "runB_qwen", threshold), (1, "env1-ep1", False, 8, 1, "runB_qwen",
                                                                         threshold),
                   (2, "env2-ep1", True, 5, 2, "runB_qwen", threshold)]
    sent = json.dumps(fake_qwen.chat_requests)
    assert "runB_qwen" not in sent and "env0-ep1" not in sent  # metadata never reaches the model
