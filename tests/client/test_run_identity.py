"""One run identity (issue 39, item 2): the shipped run D config, merged and resolved as RLinf's
launcher and Hydra resolve it, gives each launch its own name for the proxy's monitor key and
reference namespace, the same in every env worker, and `resume` carries an earlier launch's on.

Each job is the merged overlay with what a launch adds: `run_embodiment.sh`'s timestamped
`runner.logger.log_path` and env/libero_10.yaml's `env.train.seed` (Hydra's defaults list). Each
env worker gets the whole config pickled, as Ray ships it, and runs the stand-in LiberoEnv with
its own client against one real proxy whose reference store is on disk.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from proxy.config import settings_from_dict
from rlinf_client.rlinf_configs import merge_overlay
from tests.client.standin_env import StandInLiberoEnv
from tests.client.test_rlinf_configs import BASE
from tests.helpers import HANG_S, PROMPTS_DIR, REPO

omegaconf = pytest.importorskip("omegaconf")

OVERLAY = REPO / "configs" / "rlinf" / "libero_10_grpo_openvlaoft_runD_srpo.yaml"
STEPS = 6
LAUNCHED = "/rlinf/logs/20261128-10:00:00"  # two launches in the same second share the log path


class ColourEnv(StandInLiberoEnv):
    """Solid frames, grey for a success and darker for a failure (the fake embeds the mean colour)."""

    def _simulate(self):
        _, success = super()._simulate()
        frames = np.empty((self.num_envs, self.frame_size, self.frame_size, 3), np.uint8)
        for env, step in enumerate(self.success_steps):
            frames[env] = 200 if step is not None else 60 + 40 * env
        return frames, success


@pytest.fixture
def proxy(proxy_factory, fake_vllm_factory, tmp_path):
    embed = fake_vllm_factory(served_model_name="fake-embed")
    settings = settings_from_dict({
        "proxy": {"prompts_dir": str(PROMPTS_DIR), "audit_log": str(tmp_path / "audit.jsonl"), "health_interval_s": 0.2,
                  "reference_store": {"dir": str(tmp_path / "references"), "max_successes": 8}},
        "backends": {"embed": {"model": "fake-embed", "kind": "embedding", "endpoints": [embed.base_url],
                               "frames": {"nframes": 4},
                               "retry": {"attempts": 3, "backoff_s": [0.01, 0.02], "timeout_s": HANG_S,
                                         "deadline_s": 2 * HANG_S}}}})
    server = proxy_factory(settings)
    server.audit_path = tmp_path / "audit.jsonl"
    return server


def job(tmp_path: Path, proxy, *, log_path: str, seed: int, resume: str | None = None):
    """The run D config as one launch resolves it: the merged overlay, the launch's log path and seed."""
    base = tmp_path / "libero_10_grpo_openvlaoft.yaml"
    base.write_text(BASE)
    merged = yaml.safe_load(merge_overlay(base, OVERLAY))
    root = omegaconf.OmegaConf.create({k: v for k, v in merged.items() if k not in ("defaults", "hydra")})
    root.runner.logger.log_path = log_path  # run_embodiment.sh's runner.logger.log_path=${LOG_DIR}
    train = root.env.train
    train.seed = seed  # env/libero_10.yaml's, brought in by the defaults list
    train.reward_coef, train.use_rel_reward, train.ignore_terminations = 5.0, True, False
    train.auto_reset, train.max_episode_steps = False, STEPS
    model = train.reward_model
    model.endpoint = f"{proxy.url}/score"  # must set: where this cluster reaches the proxy
    model.nframes, model.buffer_frames, model.timeout = 4, 8, HANG_S
    if resume is not None:
        model.resume = resume
    return root


def run_worker(root, success_steps: list[int | None]) -> StandInLiberoEnv:
    """One env worker: the config as Ray ships it (pickled), every env of task 0, one episode each."""
    shipped = pickle.loads(pickle.dumps(root))
    env = ColourEnv(shipped.env.train, success_steps, frame_size=56)
    try:
        env.task_ids = np.zeros(env.num_envs, dtype=np.int64)
        env.reset()
        env.chunk_step(STEPS)
    finally:
        env.vlm_reward.close()
    return env


def lines_of(proxy) -> list[dict]:
    proxy.flush_audit()
    return [json.loads(line) for line in proxy.audit_path.read_text().splitlines()]


def test_two_seeds_see_disjoint_stores_and_a_resumed_job_sees_its_own_from_every_worker(proxy, tmp_path):
    first = job(tmp_path, proxy, log_path=LAUNCHED, seed=0)
    workers = [run_worker(first, [2, None]), run_worker(first, [None])]  # worker 0's success is the reference
    identity = workers[0].vlm_reward.identity
    assert identity.startswith("runD_srpo-") and {w.vlm_reward.identity for w in workers} == {identity}
    # the failures of both workers were measured against the first job's stored success
    assert [list(w.vlm_reward.episode_info()["vlm_no_reference"]) for w in workers] == [[0, 0], [0]]

    second = job(tmp_path, proxy, log_path=LAUNCHED, seed=1)  # the same config, another seed
    others = [run_worker(second, [None, None]), run_worker(second, [None])]
    other = others[0].vlm_reward.identity
    assert other.startswith("runD_srpo-") and other != identity and {w.vlm_reward.identity for w in others} == {other}
    # nothing of the first seed's: every failure has no reference and is paid the native reward
    assert [list(w.vlm_reward.episode_info()["vlm_no_reference"]) for w in others] == [[1, 1], [1]]

    resumed = job(tmp_path, proxy, log_path="/rlinf/logs/20261129-08:00:00", seed=0, resume=identity)
    again = [run_worker(resumed, [None]), run_worker(resumed, [None, None]), run_worker(resumed, [None])]
    assert {w.vlm_reward.identity for w in again} == {identity}
    assert [list(w.vlm_reward.episode_info()["vlm_no_reference"]) for w in again] == [[0], [0, 0], [0]]

    lines = lines_of(proxy)
    assert [line["metadata"]["run"] for line in lines] == [identity] * 3 + [other] * 3 + [identity] * 4
    stored = [(line["reference"] or {}).get("stored") for line in lines if not line["metadata"]["env_success"]]
    assert stored[2:5] == [None] * 3  # the second seed: no_reference, no store to measure against
    assert all(n >= 1 for n in stored[:2] + stored[5:])  # the first seed and its resumption: its own success
    with httpx.Client(timeout=HANG_S, trust_env=False) as http:
        store = http.get(f"{proxy.url}/progress/references").json()["store"]
    assert [(t["namespace"], t["task_id"], t["successes"]) for t in store["tasks"]] == [(identity, "0", 1)]
