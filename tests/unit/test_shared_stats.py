"""One AUC for every room: serving's canary, the trainers and the simulator must agree on data."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from schemas import stats
from serving import canary
from trainers import quality
from workloads import truth


@pytest.mark.parametrize("seed", range(5))
def test_rooms_agree_with_each_other_and_with_sklearn(seed: int) -> None:
    rng = np.random.default_rng(seed)
    # coarse scores: many ties, the edge case where copies used to differ
    scores = rng.integers(0, 7, size=400) / 7.0
    labels = (rng.random(400) < 0.3).astype(int)
    expected = roc_auc_score(labels, scores)
    assert quality.auc(scores, labels) == pytest.approx(expected)
    assert truth.auc(scores, labels) == pytest.approx(expected)
    assert canary.auc(scores, labels) == pytest.approx(expected)


def test_boolean_and_integer_labels_mean_the_same() -> None:
    scores = [0.2, 0.9, 0.4, 0.7]
    assert stats.auc(scores, [False, True, False, True]) == stats.auc(scores, [0, 1, 0, 1]) == 1.0


def test_one_class_is_nan_and_none_for_the_canary() -> None:
    assert math.isnan(stats.auc([0.1, 0.2], [0, 0]))
    assert canary.auc(np.array([0.1, 0.2]), np.array([1, 1])) is None


def test_bad_input_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="NaN"):
        stats.auc([0.1, float("nan")], [0, 1])
    with pytest.raises(ValueError, match="3 scores but 2 labels"):
        stats.auc([0.1, 0.2, 0.3], [0, 1])
