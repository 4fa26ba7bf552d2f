"""reward_source: progress — the config keys and the outcome → score mapping."""

from __future__ import annotations

import pytest

from rlinf_client import RewardConfigError, RewardModelConfig
from rlinf_client.mapping import map_progress, map_score

PROGRESS = {"reward_source": "progress", "binary_reward": False}


def test_progress_is_off_by_default_with_srpos_constants():
    cfg = RewardModelConfig()
    assert (cfg.reward_source, cfg.progress_coef, cfg.on_no_reference) == ("score", 0.6, "native")


@pytest.mark.parametrize(("endpoint", "url"), [("http://proxy:18080/score", "http://proxy:18080/progress/batch"),
                                               ("http://proxy:18080/", "http://proxy:18080/progress/batch")])
def test_the_progress_url_comes_from_the_endpoint_like_the_batch_url(endpoint, url):
    cfg = RewardModelConfig.from_mapping({"endpoint": endpoint, **PROGRESS})
    assert cfg.progress_url == url
    assert cfg.batch_url == url.replace("/progress/batch", "/score/batch")


def test_a_progress_block_loads_and_an_int_coefficient_is_a_float():
    cfg = RewardModelConfig.from_mapping({**PROGRESS, "progress_coef": 1, "on_no_reference": "raise",
                                          "backend": "embed", "fallback": "zero"})
    assert cfg.progress_coef == 1.0 and isinstance(cfg.progress_coef, float)
    assert (cfg.reward_source, cfg.on_no_reference, cfg.backend) == ("progress", "raise", "embed")


@pytest.mark.parametrize(("bad", "says"), [
    ({"reward_source": "vlm"}, "reward_source must be"),
    ({"progress_coef": 1.5}, "progress_coef must be"),
    ({"progress_coef": -0.1}, "progress_coef must be"),
    ({"progress_coef": True}, "progress_coef must be"),
    ({"progress_coef": "0.6"}, "progress_coef must be"),
    ({"on_no_reference": "zero"}, "on_no_reference must be"),
    ({**PROGRESS, "dense_points": 4}, "set dense_points: 0"),
    ({"reward_source": "progress"}, "set binary_reward: false"),  # binary_reward defaults to true
    ({**PROGRESS, "backend_kwargs": {"score_mode": "auto"}}, "set backend_kwargs: {}"),
])
def test_bad_progress_settings_are_refused_with_what_to_do(bad, says):
    with pytest.raises(RewardConfigError, match=says.replace("{", r"\{").replace("}", r"\}")):
        RewardModelConfig.from_mapping(bad)


def test_unknown_keys_are_still_refused():
    with pytest.raises(RewardConfigError, match="progress_coeff"):
        RewardModelConfig.from_mapping({**PROGRESS, "progress_coeff": 0.6})


def test_score_settings_are_unaffected_by_the_progress_keys():
    # binary_reward and backend_kwargs remain free with reward_source: score
    cfg = RewardModelConfig.from_mapping({"backend_kwargs": {"score_mode": "auto"}, "binary_reward": True,
                                          "progress_coef": 0.3})
    assert cfg.reward_source == "score" and cfg.binary_reward


@pytest.mark.parametrize(("outcome", "progress", "coef", "score"), [
    ("success", 1.0, 0.6, 1.0), ("progress", 0.5, 0.6, 0.3), ("progress", 1.0, 0.6, 0.6),
    ("progress", 0.25, 1.0, 0.25), ("progress", 0.7, 0.0, 0.0)])
def test_a_success_scores_one_and_a_failure_its_progress_times_the_coefficient(outcome, progress, coef, score):
    assert map_progress(outcome, progress, progress_coef=coef) == pytest.approx(score)
    # and through the score mapping (binary_reward is false with progress), unchanged
    assert map_score(score, binary_reward=False, success_threshold=0.5) == pytest.approx(score)


def test_no_reference_has_no_number_and_a_progress_needs_one():
    assert map_progress("no_reference", None, progress_coef=0.6) is None
    with pytest.raises(ValueError, match="without a progress"):
        map_progress("progress", None, progress_coef=0.6)
    with pytest.raises(ValueError, match="unknown"):
        map_progress("halfway", 0.5, progress_coef=0.6)
