"""benchmarks.lib.stats: the quantile interval every P99 goal of the benchmarks is decided by.

The freshness run of 2026-12-03 and the ΔW step's runs judged P99 <= goal from the point over
120 and 300 draws, which leave the true P99 above their largest with probability 0.30 and 0.05:
a 'met' that the draws cannot support.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.lib.stats import at_most, quantile_interval


@pytest.mark.parametrize(
    ("n", "has_upper"), [(120, False), (300, False), (367, False), (368, True), (1000, True)]
)
def test_a_p99_has_an_upper_end_only_from_368_draws(n: int, has_upper: bool) -> None:
    low, high = quantile_interval(np.arange(n, dtype=float), 0.99)
    assert (high is not None) is has_upper
    assert low is not None and (high is None or low <= high)


def test_the_interval_covers_the_true_quantile_at_its_level() -> None:
    rng = np.random.default_rng(1)
    for p, true_q in ((0.99, -np.log(0.01)), (0.5, np.log(2.0))):
        hits = 0
        for _ in range(400):
            low, high = quantile_interval(rng.exponential(size=500), p)
            assert low is not None and high is not None
            hits += low <= true_q <= high
        assert hits / 400 >= 0.93  # >= 95 % in expectation; 400 samples' own noise


def test_a_goal_is_met_only_when_the_whole_interval_is_within_it() -> None:
    assert at_most((0.2, 0.45), 0.5) is True
    assert at_most((0.51, 0.9), 0.5) is False
    assert at_most((0.4, 0.6), 0.5) is None  # inside the noise
    assert at_most((0.4, None), 0.5) is None  # too few draws to bound it
    assert at_most((None, None), 0.5) is None


def test_no_draws_no_interval() -> None:
    assert quantile_interval([], 0.99) == (None, None)
