"""The shipped A/B/C/D overlays and the tool that merges them into complete RLinf configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlinf_client import RewardModelConfig
from rlinf_client.hook import LiberoVLMReward
from rlinf_client.rlinf_configs import CONFIG_DIR, main

OVERLAYS = sorted((Path(__file__).resolve().parents[2] / "configs" / "rlinf").glob("*.yaml"))
NAMES = ["libero_10_grpo_openvlaoft_runA", "libero_10_grpo_openvlaoft_runB_qwen",
         "libero_10_grpo_openvlaoft_runC_primo", "libero_10_grpo_openvlaoft_runD_srpo"]

# The shape of RLinf's libero_10_grpo_openvlaoft.yaml (the parts the overlays touch).
BASE = """
defaults:
  - env/libero_10@env.train
  - env/libero_10@env.eval
  - override hydra/job_logging: stdout
hydra:
  searchpath:
    - file://${oc.env:EMBODIED_PATH}/config/
runner:
  logger:
    log_path: "../results"
    experiment_name: "libero_10_grpo_openvlaoft"
algorithm:
  group_size: 8
  reward_coef: 5.0
env:
  train:
    rollout_epoch: 16
    total_num_envs: 64
  eval:
    total_num_envs: 500
    group_size: 1
rollout:
  model:
    model_path: "/path/to/model/Openvla-oft-SFT-libero10-traj1/"
actor:
  model:
    model_path: "/path/to/model/Openvla-oft-SFT-libero10-traj1/"
    model_type: "openvla_oft"
"""


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        out.update(flatten(value, path) if isinstance(value, dict) else {path: value})
    return out


def test_the_overlays_differ_only_in_the_reward_model_and_the_name():
    assert [p.stem for p in OVERLAYS] == NAMES
    runs = [flatten(yaml.safe_load(p.read_text())) for p in OVERLAYS]
    block = "env.train.reward_model."
    outside = [{k: v for k, v in run.items() if not k.startswith(block)} for run in runs]
    assert all(o.keys() == outside[0].keys() for o in outside)
    differing = {key for key in outside[0] if len({str(o[key]) for o in outside}) > 1}
    assert differing == {"runner.logger.experiment_name"}
    # Run A is off; B, C and D name their backend. Which keys each sets, and why, is
    # tests/client/test_overlays.py's: only what a run must set or what departs from a default.
    assert runs[0] == {**outside[0], block + "enable": False}
    # each run names itself in the audit log, so `report` can split one log by run
    assert [run.get(block + "run") for run in runs] == [None, "runB_qwen", "runC_primo", "runD_srpo"]
    assert [run.get(block + "backend") for run in runs] == [None, "qwen2_5_vl_vllm", "PRIMO-R1", "embed"]
    configs = [RewardModelConfig.from_mapping(yaml.safe_load(p.read_text())["env"]["train"]["reward_model"])
               for p in OVERLAYS]
    assert [c.reward_source for c in configs] == ["score"] * 3 + ["progress"]
    assert [c.binary_reward for c in configs] == [True] * 3 + [False]
    # PRIMO-R1 reasons up to 4096 tokens: its run waits longer per scoring call
    assert [c.timeout for c in configs] == [120.0, 120.0, 600.0, 120.0]
    assert all(c.transport == "binary" for c in configs)  # the documented, benchmarked path
    # the seed's runB/runC failure semantics: a failed episode stops the run, never the simulator's flag
    assert [c.failure_policy for c in configs[1:]] == ["raise"] * 3
    assert all(run["env.train.group_size"] == "${algorithm.group_size}" for run in runs)
    assert all("PLACEHOLDER" in run["actor.model.model_path"] for run in runs)
    for path in OVERLAYS:  # evaluation success is the simulator's: no reward model there
        assert "reward_model" not in yaml.safe_load(path.read_text())["env"].get("eval", {})


def test_merging_writes_complete_configs_into_the_rlinf_checkout(tmp_path, capsys):
    omegaconf = pytest.importorskip("omegaconf")
    config_dir = tmp_path / CONFIG_DIR
    config_dir.mkdir(parents=True)
    (config_dir / "libero_10_grpo_openvlaoft.yaml").write_text(BASE)
    assert main(["--rlinf", str(tmp_path), *map(str, OVERLAYS)]) == 0
    assert main(["--rlinf", str(tmp_path), str(OVERLAYS[0])]) == 2  # no silent overwrite
    assert "exists" in capsys.readouterr().err

    merged = {name: yaml.safe_load((config_dir / f"{name}.yaml").read_text()) for name in NAMES}
    run_b = merged["libero_10_grpo_openvlaoft_runB_qwen"]
    assert run_b["defaults"][0] == "env/libero_10@env.train" and "searchpath" in run_b["hydra"]
    assert run_b["env"]["train"]["rollout_epoch"] == 16  # the base's values stay
    assert run_b["actor"]["model"]["model_type"] == "openvla_oft"

    node = omegaconf.OmegaConf.create({k: v for k, v in run_b.items() if k not in ("defaults", "hydra")})
    train = node.env.train
    train.seed = 0  # env/libero_10.yaml's, which Hydra's defaults list brings into env.train
    assert train.group_size == 8 and node.rollout.model.model_path == node.actor.model.model_path
    train.reward_coef, train.use_rel_reward, train.ignore_terminations = 5.0, True, False
    hook = LiberoVLMReward.from_env_cfg(train, 4, client=object())
    assert hook is not None and hook.config.backend == "qwen2_5_vl_vllm" and hook.reward_coef == 5.0
    run_a = omegaconf.OmegaConf.create(merged["libero_10_grpo_openvlaoft_runA"]["env"])
    assert LiberoVLMReward.from_env_cfg(run_a.train, 4) is None
    run_d = omegaconf.OmegaConf.create({k: v for k, v in merged["libero_10_grpo_openvlaoft_runD_srpo"].items()
                                        if k not in ("defaults", "hydra")}).env
    run_d.train.reward_coef, run_d.train.use_rel_reward, run_d.train.ignore_terminations = 5.0, True, False
    run_d.train.seed = 0
    hook = LiberoVLMReward.from_env_cfg(run_d.train, 4, client=object())
    assert hook is not None and hook.config.reward_source == "progress" and hook.config.backend == "embed"
    assert hook.config.progress_url == "http://127.0.0.1:18080/progress/batch"
    # the job is the launch's log path and seed, resolved by OmegaConf; the identity its digest
    assert hook.config.job == "../results/seed=0" and hook.identity.startswith("runD_srpo-")


def test_missing_base_config_is_an_error(tmp_path, capsys):
    assert main(["--rlinf", str(tmp_path), str(OVERLAYS[0])]) == 2
    assert "not found" in capsys.readouterr().err
