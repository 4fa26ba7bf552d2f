"""SRPO's self-referential progress of failed episodes, from embeddings (pure numpy).

Source: siiRL `siirl/utils/reward_score/embodied.py::compute_embodied_reward` (commit af00a771);
docs/progress.md states the formula step by step. Per task: standardise the references (the
successes), cluster them with DBSCAN, take each cluster's mean as a centre (the mean of the
references when nothing clusters), measure each failure's Euclidean distance to its nearest
centre in the raw space, min-max normalise those distances over the task's failures, and map
them through a steep logistic. scikit-learn is not a dependency of the proxy: the standardising
and DBSCAN here follow its definitions, and tests/rules/test_progress_math.py checks them
against scikit-learn itself running siiRL's code.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

__all__ = ["METHOD", "Progress", "dbscan_labels", "srpo_progress", "standardise"]

EPS, MIN_SAMPLES = 0.5, 2  # DBSCAN on standardised references
STEEPNESS, OFFSET = 10.0, 0.5  # progress = expit(STEEPNESS * (OFFSET - normalised distance))
FLAT_RANGE = 1e-6  # distances spread less than this: every failure is at 0.5
METHOD = {"name": "srpo", "source": "siiRL embodied.py compute_embodied_reward @ af00a771",
          "dbscan_eps": EPS, "dbscan_min_samples": MIN_SAMPLES, "distance": "euclidean (raw space)",
          "normalisation": "min-max over the task's failures in the batch", "steepness": STEEPNESS,
          "offset": OFFSET}


@dataclass(frozen=True)
class Progress:
    progress: np.ndarray  # per failure, in (0, 1)
    distance: np.ndarray  # to the nearest centre
    normalised: np.ndarray  # the distance min-max normalised over the failures
    centres: int
    clustered: bool  # DBSCAN found a cluster (else the one centre is the references' mean)


def standardise(x: np.ndarray) -> np.ndarray:
    """Zero mean and unit population std per dimension; a (near-)constant dimension keeps scale 1
    (scikit-learn's StandardScaler, including its test for a constant feature)."""
    mean, var = x.mean(axis=0), x.var(axis=0)
    n, eps = x.shape[0], np.finfo(x.dtype).eps
    constant = var <= n * eps * var + (n * mean * eps) ** 2
    return (x - mean) / np.where(constant, 1.0, np.sqrt(var))


def _pairwise_sq(x: np.ndarray) -> np.ndarray:
    norms = (x * x).sum(axis=1)
    return np.maximum(norms[:, None] + norms[None, :] - 2.0 * x @ x.T, 0.0)


def dbscan_labels(x: np.ndarray, eps: float = EPS, min_samples: int = MIN_SAMPLES) -> np.ndarray:
    """DBSCAN's labels (-1 = noise): a point with at least `min_samples` points (itself included)
    within `eps` is a core point; clusters grow from core points taken in index order, so a border
    point belongs to the first cluster that reaches it."""
    neighbours = _pairwise_sq(x) <= eps * eps
    core = neighbours.sum(axis=1) >= min_samples
    labels = np.full(len(x), -1)
    cluster = 0
    for start in range(len(x)):
        if labels[start] != -1 or not core[start]:
            continue
        labels[start], frontier = cluster, deque([start])
        while frontier:
            point = frontier.popleft()
            if not core[point]:
                continue
            for other in np.flatnonzero(neighbours[point] & (labels == -1)):
                labels[other] = cluster
                frontier.append(other)
        cluster += 1
    return labels


def srpo_progress(references: np.ndarray, failures: np.ndarray) -> Progress:
    """Progress of each failure (rows of `failures`) against the references (rows, at least one)."""
    if len(references) == 0 or len(failures) == 0:
        raise ValueError("srpo_progress needs at least one reference and one failure")
    refs, fails = np.asarray(references, dtype=np.float64), np.asarray(failures, dtype=np.float64)
    labels = dbscan_labels(standardise(refs))
    clusters = sorted(set(labels.tolist()) - {-1})
    # The inverse transform of a mean of standardised points is the mean of the raw points.
    centres = np.stack([refs[labels == c].mean(axis=0) for c in clusters]) if clusters else refs.mean(axis=0)[None]
    distance = np.min(np.stack([np.linalg.norm(fails - c, axis=1) for c in centres], axis=1), axis=1)
    low, spread = distance.min(), distance.max() - distance.min()
    normalised = np.full_like(distance, 0.5) if spread < FLAT_RANGE else (distance - low) / spread
    progress = 1.0 / (1.0 + np.exp(-STEEPNESS * (OFFSET - normalised)))
    return Progress(progress=progress, distance=distance, normalised=normalised, centres=len(centres),
                    clustered=bool(clusters))
