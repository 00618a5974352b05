"""`schemas.stats.paired_auc_difference`: DeLong's paired test, against the textbook O(m·n)
definition and on simulated models whose difference is known to be zero."""

from __future__ import annotations

import math

import numpy as np

from schemas.stats import auc, paired_auc_difference


def _delong_by_definition(a: np.ndarray, b: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    pos, neg = y.astype(bool), ~y.astype(bool)

    def psi(s: np.ndarray) -> np.ndarray:  # m x n kernel: 1 above, 1/2 tied, 0 below
        x, z = s[pos][:, None], s[neg][None, :]
        return (x > z) + 0.5 * (x == z)

    ka, kb = psi(a), psi(b)
    m, n = ka.shape
    v10 = np.vstack([ka.mean(1), kb.mean(1)])
    v01 = np.vstack([ka.mean(0), kb.mean(0)])
    s10, s01 = np.cov(v10), np.cov(v01)
    var = (s10[0, 0] + s10[1, 1] - 2 * s10[0, 1]) / m + (s01[0, 0] + s01[1, 1] - 2 * s01[0, 1]) / n
    return float(ka.mean() - kb.mean()), math.sqrt(var)


def test_equals_the_definition_with_ties() -> None:
    rng = np.random.default_rng(0)
    for trial in range(20):
        n = int(rng.integers(8, 300))
        y = rng.random(n) < 0.3
        y[:2], y[2:4] = True, False
        a = np.round(rng.random(n) + y * 0.5, 1)  # rounding makes ties
        b = np.round(rng.random(n) + y * 0.2 * trial / 20, 2)
        got = paired_auc_difference(a, b, y)
        want = _delong_by_definition(a, b, y)
        assert np.allclose(got, want, atol=1e-12), (trial, got, want)
        assert got[0] == auc(a, y) - auc(b, y)


def test_under_no_difference_the_interval_covers_zero_at_its_level() -> None:
    rng = np.random.default_rng(1)
    covered = 0
    trials = 400
    for _ in range(trials):
        y = rng.random(500) < 0.06  # ~30 clicks in 500 impressions, as in the trainer's window
        signal = y * 0.8
        a = signal + rng.normal(size=500)
        b = signal + rng.normal(size=500)  # the same model quality: the true difference is 0
        d, se = paired_auc_difference(a, b, y)
        covered += abs(d) <= 1.96 * se
    assert 0.92 <= covered / trials <= 0.98


def test_one_class_or_too_few_is_nan() -> None:
    d, se = paired_auc_difference(np.array([0.1, 0.9, 0.3]), np.array([0.2, 0.1, 0.3]), np.array([1, 0, 0]))
    assert math.isnan(d) and math.isnan(se)
