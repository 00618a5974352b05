"""Offline-quality choices of the trainers: LR baseline scaling, training start point."""

from __future__ import annotations

import numpy as np
from helpers_trainers import make_examples

from trainers.baseline import logistic_probs
from trainers.features import RankerBatch, featurize
from trainers.ranker import RankerConfig

CFG = RankerConfig(
    state_dim=8, ad_buckets=64, advertiser_buckets=16, campaign_buckets=16, category_buckets=8, deep_hidden=16
)


def test_logistic_baseline_does_not_depend_on_dense_scale() -> None:
    # user-state sums grow with a user's history; LR standardises them, so a unit change of a
    # dense column (here ×1000 on the column that carries the signal) changes nothing
    exs = make_examples(800, dim=8, seed=3)
    train, hold = featurize(exs[:600], CFG), featurize(exs[600:], CFG)
    scale = np.ones(train.dense.shape[1], dtype=np.float32)
    scale[0] = 1000.0
    scaled = [RankerBatch(b.dense * scale, b.ids, b.label) for b in (train, hold)]
    p = logistic_probs(train, hold)
    q = logistic_probs(*scaled)
    assert np.allclose(p, q, atol=1e-4)
