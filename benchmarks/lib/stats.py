"""Statistics the benchmarks decide goals with (the product's own are in `schemas.stats`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def quantile_interval(
    x: Sequence[float] | np.ndarray, p: float, level: float = 0.95
) -> tuple[float | None, float | None]:
    """A distribution-free interval of the `p`-quantile of the draws `x`: the order statistics
    (x_(l), x_(u)) that hold it with probability >= `level` (two-sided), from Binomial(n, p):
    x_(j) is at or under the quantile exactly when at least j draws are. An end is None where n
    is too small for it (the upper end of a P99 needs 0.99^n <= 2.5 %: n >= 368).

    >>> quantile_interval(range(1, 121), 0.99)  # 120 trials: no upper end for the P99
    (116.0, None)
    """
    xs = np.sort(np.asarray(x, dtype=float))
    n = xs.shape[0]
    if n == 0:
        return None, None
    alpha = (1.0 - level) / 2.0
    # cdf[k] = P(Binomial(n, p) <= k), k = 0 .. n, summed in logs (n in the thousands is fine)
    k = np.arange(n + 1)
    log_pmf = (
        np.array([math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in k])
        + k * math.log(p)
        + (n - k) * math.log1p(-p)
    )
    cdf = np.cumsum(np.exp(log_pmf))
    # upper: the smallest u with P(B <= u - 1) >= 1 - alpha; lower: the largest l with P(B <= l - 1) <= alpha
    ups = np.nonzero(cdf[:n] >= 1.0 - alpha)[0]
    lows = np.nonzero(cdf[:n] <= alpha)[0]
    high = float(xs[ups[0]]) if ups.size else None  # x_(u) with u = index + 1
    low = float(xs[lows[-1]]) if lows.size else None  # x_(l) with l = index + 1
    return low, high


def at_most(interval: Sequence[float | None], goal: float) -> bool | None:
    """A goal "the quantile is at most `goal`" judged by the quantile's interval: True when its
    upper end is at or under the goal, False when its lower end is past it, None (inside the
    noise, or too few draws to bound it) otherwise.

    >>> at_most((0.2, 0.4), 0.5), at_most((0.6, 0.9), 0.5), at_most((0.3, None), 0.5)
    (True, False, None)
    """
    low, high = interval
    if low is not None and low > goal:
        return False
    if high is not None and high <= goal:
        return True
    return None


def ratio_summary(num: list[float], den: list[float], seed: int = 0) -> dict[str, Any]:
    """Median of the same-round ratios num/den with its 95 % bootstrap interval (rounds
    resampled; each round ran both cases back to back, so load hits them alike)."""
    r = np.asarray(num) / np.asarray(den)
    rng = np.random.default_rng(seed)
    boots = np.median(r[rng.integers(0, len(r), (1000, len(r)))], axis=1)
    return {
        "median": round(float(np.median(r)), 4),
        "ci95": [round(float(np.quantile(boots, 0.025)), 4), round(float(np.quantile(boots, 0.975)), 4)],
        "rounds": len(r),
    }
