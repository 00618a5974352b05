"""RollingMetrics (a numpy ring) against the obvious deque definition of a rolling window."""

from __future__ import annotations

import math
import random
from collections import deque

import pytest
from helpers_trainers import make_examples

from schemas.stats import auc
from trainers.features import featurize
from trainers.metrics import RollingMetrics, logloss
from trainers.ranker import RankerConfig


@pytest.mark.parametrize("window", [1, 7, 64, 500])
def test_rolling_window_equals_a_deque_of_the_last_pairs(window: int) -> None:
    rng = random.Random(window)
    ring = RollingMetrics(window)
    ps: deque[float] = deque(maxlen=window)
    ys: deque[int] = deque(maxlen=window)
    for step in range(300):
        n = rng.choice([0, 1, 3, window - 1, window, window + 5, rng.randrange(1, 2 * window + 2)])
        p = [rng.random() for _ in range(max(n, 0))]
        y = [int(rng.random() < 0.3) for _ in p]
        if step % 97 == 96:
            ring.clear()
            ps.clear()
            ys.clear()
        ring.extend(p, y)
        ps.extend(p)
        ys.extend(y)
        assert ring.count == len(ps)
        assert ring.positives == sum(ys)
        want = auc(list(ps), list(ys)) if ps else math.nan
        got = ring.auc() if ps else math.nan
        assert (math.isnan(want) and math.isnan(got)) or got == pytest.approx(want, abs=1e-12)
        if ps:
            assert ring.logloss() == pytest.approx(logloss(list(ps), list(ys)), abs=1e-12)


def test_extend_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="2 probabilities but 1 labels"):
        RollingMetrics(4).extend([0.1, 0.2], [1])


def test_featurize_batches_equal_one_by_one() -> None:
    """The column-wise featurize gives every row what featurizing it alone gives."""
    cfg = RankerConfig(state_dim=8)
    exs = make_examples(40, dim=8)
    exs[3] = exs[3].model_copy(update={"user_vector": [0.5, 0.25]})  # short: zero-padded
    exs[5] = exs[5].model_copy(update={"user_vector": [0.1] * 12, "recall_score": 0.7})  # long: truncated
    whole = featurize(exs, cfg)
    for i, ex in enumerate(exs):
        one = featurize([ex], cfg)
        assert whole.dense[i].tolist() == one.dense[0].tolist()
        assert whole.ids[i].tolist() == one.ids[0].tolist()
    assert whole.dense[3, 2:8].abs().sum() == 0
