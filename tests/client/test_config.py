"""The `reward_model` block: the seed's keys, our additions, strict validation."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import typing

import pytest

from rlinf_client import AsyncRewardClient, RewardClient, RewardConfigError, RewardModelConfig, RewardModelOptions

SEED_BLOCK = {  # runB_qwen in the seed's fork, verbatim keys
    "enable": True, "endpoint": "http://127.0.0.1:18080/score", "timeout": 120, "nframes": 16,
    "max_pixels": 200704, "backend": "qwen2_5_vl_vllm", "backend_kwargs": {"score_mode": "auto"},
    "video_fps": 4, "fail_on_request_error": True, "binary_reward": True, "success_threshold": 0.5,
    "keep_temp_video": False, "temp_video_dir": None,
}


def test_the_seed_block_loads_unchanged():
    cfg = RewardModelConfig.from_mapping(SEED_BLOCK)
    assert cfg.enable and cfg.backend == "qwen2_5_vl_vllm" and cfg.timeout == 120.0
    assert dict(cfg.backend_kwargs) == {"score_mode": "auto"}
    assert cfg.transport == "binary" and cfg.client_sampling  # frames in the request: no shared disk needed
    assert cfg.score_url == "http://127.0.0.1:18080/score"
    assert cfg.batch_url == "http://127.0.0.1:18080/score/batch"
    assert cfg.health_url == "http://127.0.0.1:18080/health"


def test_a_bare_base_url_works_as_endpoint():
    cfg = RewardModelConfig(endpoint="http://proxy:18080/")
    assert cfg.score_url == "http://proxy:18080/score"


def test_defaults_are_the_seeds():
    cfg = RewardModelConfig()
    assert (cfg.enable, cfg.nframes, cfg.max_pixels, cfg.video_fps, cfg.fail_on_request_error,
            cfg.binary_reward, cfg.success_threshold, cfg.keep_temp_video) == (
        False, 16, 200704, 4.0, False, True, 0.5, False)


def test_unknown_keys_are_refused():
    with pytest.raises(RewardConfigError, match="nframe"):
        RewardModelConfig.from_mapping({"nframe": 8})


@pytest.mark.parametrize("bad", [{"timeout": 0}, {"nframes": 0}, {"success_threshold": 1.5},
                                 {"transport": "nfs"}, {"endpoint": "127.0.0.1:18080"},
                                 {"buffer_frames": 10}, {"max_retries": -1}])
def test_bad_values_are_refused(bad):
    with pytest.raises(RewardConfigError):
        RewardModelConfig.from_mapping(bad)


@pytest.mark.parametrize(("bad", "says"), [
    # quoted in YAML, each reads as the opposite of what it does: a non-empty string is true
    ({"enable": "false"}, "enable must be true or false"),
    ({"binary_reward": "false"}, "binary_reward must be true or false"),
    ({"fail_on_request_error": "no"}, "fail_on_request_error must be true or false"),
    ({"client_sampling": 0}, "client_sampling must be true or false"),
    ({"success_threshold": "0.5"}, "success_threshold must be a number"),  # a str: a TypeError at the first episode
    ({"success_threshold": True}, "success_threshold must be a number"),
    ({"timeout": True}, "timeout must be a positive number"),  # was one second
])
def test_a_value_of_the_wrong_type_is_refused_not_read_as_another(bad, says):
    # found by review: each of these was accepted
    with pytest.raises(RewardConfigError, match=says):
        RewardModelConfig.from_mapping(bad)


def test_backend_kwargs_are_a_private_read_only_copy():
    kwargs = {"score_mode": "unit"}
    cfg = RewardModelConfig(backend_kwargs=kwargs)
    kwargs["score_mode"] = "percentage"
    assert cfg.backend_kwargs["score_mode"] == "unit"
    with pytest.raises(TypeError):
        cfg.backend_kwargs["x"] = 1  # type: ignore[index]


def test_omegaconf_nodes_are_read_without_importing_omegaconf():
    omegaconf = pytest.importorskip("omegaconf")
    node = omegaconf.OmegaConf.create({"env": {"train": {"reward_model": SEED_BLOCK}},
                                       "fps": 8, "rm": {"video_fps": "${fps}"}})
    assert RewardModelConfig.from_mapping(node.env.train.reward_model).backend == "qwen2_5_vl_vllm"
    assert RewardModelConfig.from_mapping(node.rm).video_fps == 8.0


def test_from_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("env:\n  train:\n    reward_model:\n      enable: true\n      nframes: 8\n")
    assert RewardModelConfig.from_yaml(path, "env.train.reward_model").nframes == 8
    with pytest.raises(RewardConfigError):
        RewardModelConfig.from_yaml(path, "env.eval.reward_model")


def test_on_quality_alarm_defaults_to_keep_and_takes_the_three_policies():
    assert RewardModelConfig().on_quality_alarm == "keep"
    for policy in ("keep", "native", "raise"):
        assert RewardModelConfig.from_mapping({"on_quality_alarm": policy}).on_quality_alarm == policy


@pytest.mark.parametrize("bad", ["env_success", "zero", None, True])
def test_a_bad_on_quality_alarm_names_the_allowed_values(bad):
    with pytest.raises(RewardConfigError, match=r"on_quality_alarm must be one of keep, native, raise, got "):
        RewardModelConfig.from_mapping({"on_quality_alarm": bad})


# -- one failure switch, two spellings ------------------------------------------------------------
def _seed_name_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "fail_on_request_error" in r.getMessage()]


@pytest.mark.parametrize(("seed", "new"), [
    ({"fail_on_request_error": True}, {"fallback": "raise"}),
    ({"fail_on_request_error": False}, {}),
    ({"fail_on_request_error": False, "fallback": "env_success"}, {"fallback": "env_success"}),
    ({"fail_on_request_error": True, "fallback": "raise"}, {"fallback": "raise"}),
])
def test_the_seeds_failure_switch_is_read_as_fallback_and_says_so_once(caplog, seed, new):
    caplog.set_level(logging.INFO, logger="rlinf_client")
    with_seed_name = RewardModelConfig.from_mapping(seed)
    [line] = _seed_name_lines(caplog)
    assert line.startswith("reward_model: fail_on_request_error is the seed's name for fallback: read as fallback: ")
    caplog.clear()
    with_new_name = RewardModelConfig.from_mapping(new)
    assert _seed_name_lines(caplog) == [] and caplog.records == []
    assert with_seed_name == with_new_name
    assert with_seed_name.failure_policy == with_new_name.failure_policy == new.get("fallback", "zero")
    assert with_seed_name.fail_on_request_error is (new.get("fallback") == "raise")  # seed-era code reads it
    assert _seed_name_lines(caplog) == []  # nor does a copy read it again
    with_seed_name.replace(nframes=8)
    assert _seed_name_lines(caplog) == []


def test_the_readmes_client_still_takes_the_seeds_name(caplog):
    caplog.set_level(logging.INFO, logger="rlinf_client")
    with RewardClient(endpoint="http://127.0.0.1:18080/score", backend="qwen2_5_vl_vllm",
                      fail_on_request_error=True) as client:
        assert client.config.failure_policy == "raise"
    assert len(_seed_name_lines(caplog)) == 1


def test_the_clients_typed_options_are_the_configs_keys():
    """RewardModelOptions types the clients' keyword arguments (an IDE completes and checks them);
    it must name every key RewardModelConfig reads, with the same type."""
    hints = {f.name: f.type for f in dataclasses.fields(RewardModelConfig)}
    hints["fail_on_request_error"] = "dataclasses.InitVar[bool | None]"
    options = RewardModelOptions.__annotations__
    assert set(options) == set(hints)
    for key, declared in options.items():
        declared = declared.__forward_arg__ if isinstance(declared, typing.ForwardRef) else declared
        assert hints[key] in (declared, f"dataclasses.InitVar[{declared}]"), key
    for client in (RewardClient, AsyncRewardClient):
        assert str(inspect.signature(client).parameters["overrides"].annotation) == "Unpack[RewardModelOptions]"
