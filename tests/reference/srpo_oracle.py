"""An independent statement of SRPO's reward for failed episodes, written from siiRL's
`compute_embodied_reward` (sii-research/siiRL @ af00a771, siirl/utils/reward_score/embodied.py)
with the libraries it uses: scikit-learn's StandardScaler and DBSCAN, scipy's cdist and expit.
It shares no code with proxy/progress/math.py, which must agree with it."""

from __future__ import annotations

import numpy as np
from scipy import special
from scipy.spatial.distance import cdist
from sklearn.cluster import DBSCAN
from sklearn.preprocessing import StandardScaler


def siirl_rewards(embeddings: np.ndarray, success: np.ndarray, tasks: list[str]) -> dict[int, dict]:
    """Per episode: siiRL's score (1 for a success, 0.6·σ(...) for a shaped failure, 0 otherwise)
    and, for shaped failures, the distance and normalised distance."""
    out: dict[int, dict] = {}
    for task in dict.fromkeys(tasks):
        idx = np.array([i for i, t in enumerate(tasks) if t == task])
        wins, losses = idx[success[idx]], idx[~success[idx]]
        for i in wins:
            out[int(i)] = {"score": 1.0}
        for i in losses:
            out[int(i)] = {"score": 0.0}
        if len(wins) == 0 or len(losses) == 0:
            continue
        scaler = StandardScaler()
        scaled = scaler.fit_transform(embeddings[wins])
        labels = DBSCAN(eps=0.5, min_samples=2).fit(scaled).labels_
        centres = [scaler.inverse_transform(scaled[labels == k].mean(axis=0, keepdims=True)).ravel()
                   for k in sorted(set(labels) - {-1})] or [embeddings[wins].mean(axis=0)]
        dist = cdist(embeddings[losses], np.array(centres), "euclidean").min(axis=1)
        spread = dist.max() - dist.min()
        norm = np.full_like(dist, 0.5) if spread < 1e-6 else (dist - dist.min()) / spread
        for k, i in enumerate(losses):
            out[int(i)] = {"score": float(0.6 * special.expit(10.0 * (0.5 - norm[k]))),
                           "distance": float(dist[k]), "normalised": float(norm[k])}
    return out
