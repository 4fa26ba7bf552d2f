"""SRPO's progress (proxy/progress/math.py) against an independent implementation on scikit-learn
(tests/reference/srpo_oracle.py), on synthetic embeddings whose geometry fixes the answer."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.cluster import DBSCAN
from sklearn.preprocessing import StandardScaler

from proxy.progress.math import dbscan_labels, srpo_progress, standardise
from tests.reference.srpo_oracle import siirl_rewards

SIGMA_5 = 1.0 / (1.0 + np.exp(-5.0))


def _against_oracle(references: np.ndarray, failures: np.ndarray) -> None:
    ours = srpo_progress(references, failures)
    embeddings = np.vstack([references, failures])
    success = np.array([True] * len(references) + [False] * len(failures))
    theirs = siirl_rewards(embeddings, success, ["t"] * len(embeddings))
    for k in range(len(failures)):
        oracle = theirs[len(references) + k]
        assert ours.progress[k] * 0.6 == pytest.approx(oracle["score"], abs=1e-9)
        assert ours.distance[k] == pytest.approx(oracle["distance"], rel=1e-9, abs=1e-9)
        assert ours.normalised[k] == pytest.approx(oracle["normalised"], abs=1e-9)


def test_failures_on_a_line_from_one_centre_get_the_logistic_of_their_place():
    references = np.array([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])  # one tight cluster at the origin
    failures = np.array([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0]])  # distances 1, 2, 3
    result = srpo_progress(references, failures)
    assert result.distance.tolist() == pytest.approx([1.0, 2.0, 3.0])
    assert result.normalised.tolist() == pytest.approx([0.0, 0.5, 1.0])
    assert result.progress.tolist() == pytest.approx([SIGMA_5, 0.5, 1 - SIGMA_5])
    assert result.centres == 1 and result.clustered
    _against_oracle(references, failures)


def test_two_clusters_each_failure_is_measured_to_the_nearer_centre():
    rng = np.random.default_rng(0)
    left = rng.normal([-10.0, 0.0], 0.01, size=(5, 2))
    right = rng.normal([10.0, 0.0], 0.01, size=(5, 2))
    references = np.vstack([left, right])
    failures = np.array([[-9.0, 0.0], [10.0, 4.0], [0.0, 0.0]])
    result = srpo_progress(references, failures)
    assert result.centres == 2 and result.clustered
    assert result.distance == pytest.approx([1.0, 4.0, 10.0], abs=0.05)
    assert result.progress[0] > result.progress[1] > result.progress[2]
    _against_oracle(references, failures)


def test_no_cluster_falls_back_to_the_mean_of_the_references():
    references = np.array([[0.0, 0.0], [4.0, 0.0]])  # two points: standardised 2 apart, over eps
    assert dbscan_labels(standardise(references)).tolist() == [-1, -1]
    result = srpo_progress(references, np.array([[2.0, 1.0], [2.0, 3.0]]))
    assert not result.clustered and result.centres == 1
    assert result.distance.tolist() == pytest.approx([1.0, 3.0])  # from the mean (2, 0)


def test_one_failure_and_equidistant_failures_get_one_half():
    references = np.array([[0.0, 0.0], [0.1, 0.0]])
    assert srpo_progress(references, np.array([[5.0, 5.0]])).progress.tolist() == [0.5]
    ring = np.array([[3.0, 0.0], [0.0, 3.0], [-3.0, 0.0]]) + references.mean(axis=0)
    result = srpo_progress(references, ring)
    assert result.normalised.tolist() == [0.5, 0.5, 0.5] and result.progress.tolist() == [0.5] * 3


def test_it_refuses_an_empty_side():
    with pytest.raises(ValueError):
        srpo_progress(np.empty((0, 3)), np.ones((2, 3)))
    with pytest.raises(ValueError):
        srpo_progress(np.ones((2, 3)), np.empty((0, 3)))


def test_standardise_and_dbscan_match_scikit_learn_in_high_dimensions():
    rng = np.random.default_rng(1)
    x = np.vstack([rng.normal(0, 1, (6, 64)), rng.normal(0, 1, (1, 64)).repeat(4, axis=0) + 1e-3])
    x[:, 5] = 2.5  # a constant dimension keeps scale 1
    assert standardise(x) == pytest.approx(StandardScaler().fit_transform(x), abs=1e-12)
    scaled = standardise(x)
    for eps in (0.5, 5.0, 11.0, 12.0):
        assert dbscan_labels(scaled, eps=eps).tolist() == DBSCAN(eps=eps, min_samples=2).fit(scaled).labels_.tolist()


@settings(max_examples=60)
@given(seed=st.integers(0, 2**32 - 1), successes=st.integers(1, 8), failures=st.integers(1, 8),
       dim=st.sampled_from([2, 3, 16]), spread=st.sampled_from([0.05, 0.3, 1.0, 5.0]))
def test_random_batches_agree_with_the_oracle(seed, successes, failures, dim, spread):
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 3, (2, dim))
    references = centres[rng.integers(0, 2, successes)] + rng.normal(0, spread, (successes, dim))
    _against_oracle(references, rng.normal(0, 3, (failures, dim)))


def test_the_oracle_groups_by_task_and_leaves_unreferenced_failures_at_zero():
    embeddings = np.array([[0.0, 0.0], [1.0, 0.0], [2.0, 0.0], [5.0, 5.0], [6.0, 6.0]])
    success = np.array([True, False, False, False, False])
    out = siirl_rewards(embeddings, success, ["a", "a", "a", "b", "b"])
    assert out[0]["score"] == 1.0 and out[3]["score"] == out[4]["score"] == 0.0
    ours = srpo_progress(embeddings[:1], embeddings[1:3])
    assert [out[1]["score"], out[2]["score"]] == pytest.approx((0.6 * ours.progress).tolist())
