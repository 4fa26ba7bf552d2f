"""Cache-aware routing through the real proxy over two fake PRIMO-R1 replicas: a GRPO group (one
initial state, so one first frame) lands on one replica; group_id overrides; /metrics counts it."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from proxy.config import settings_from_dict
from tests.conftest import PRIMO_MODEL, PRIMO_REPLY, libero_settings_dict
from tests.fakes.episodes import episode_frames, npy_b64


def _group(group: int, size: int = 4) -> list[np.ndarray]:
    """`size` episodes that share their first frame (the group's initial state) and differ after it."""
    episodes = []
    for member in range(size):
        frames = episode_frames(6, 56, 56)
        frames[0] = 40 + 30 * group  # the group's own start
        frames[1:] = (frames[1:].astype(np.int32) + 11 * member + 3 * group).clip(0, 255).astype(np.uint8)
        episodes.append(frames)
    return episodes


@pytest.fixture
def two_replicas(proxy_factory, fake_vllm_factory, fake_qwen, media_root):
    replicas = [fake_vllm_factory(served_model_name=PRIMO_MODEL, default_text=PRIMO_REPLY) for _ in range(2)]

    def start(policy: str):
        data = libero_settings_dict([fake_qwen.base_url], [r.base_url for r in replicas], media_root)
        data["backends"]["PRIMO-R1"]["routing"] = {"policy": policy}
        return proxy_factory(settings_from_dict(data))
    return replicas, start


@pytest.mark.parametrize("policy", ["affinity", "least_outstanding"])
def test_a_group_stays_on_one_replica_under_affinity(two_replicas, policy):
    replicas, start = two_replicas
    server = start(policy)
    firsts: dict[int, set[int]] = {}
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as http:
        for group in range(4):
            for frames in _group(group):
                before = [len(r.chat_requests) for r in replicas]
                answer = http.post("/score", json={"task_text": "t", "backend": "PRIMO-R1",
                                                   "frames_npy": npy_b64(frames)})
                assert answer.status_code == 200, answer.text
                served = next(i for i, r in enumerate(replicas) if len(r.chat_requests) > before[i])
                firsts.setdefault(group, set()).add(served)
        metrics = http.get("/metrics").text
    if policy == "affinity":
        assert all(len(served) == 1 for served in firsts.values()), firsts
        assert 'vlm_proxy_routed_calls{backend="PRIMO-R1",decision="affinity"} 16.0' in metrics
    else:  # one at a time, least outstanding alternates: a group is spread over both
        assert all(served == {0, 1} for served in firsts.values()), firsts
        assert 'vlm_proxy_routed_calls{backend="PRIMO-R1",decision="least_outstanding"} 16.0' in metrics


def test_group_id_names_the_group_whatever_the_frames(two_replicas):
    replicas, start = two_replicas
    server = start("affinity")
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as http:
        for group in range(6):  # six different first frames, one declared group
            for frames in _group(group, size=1):
                answer = http.post("/score", json={"task_text": "t", "backend": "PRIMO-R1",
                                                   "frames_npy": npy_b64(frames), "metadata": {"group_id": "g1"}})
                assert answer.status_code == 200, answer.text
    assert sorted(len(r.chat_requests) for r in replicas) == [0, 6]
