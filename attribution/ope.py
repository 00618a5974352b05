"""Off-policy estimators: the value of a policy that did not serve, from traffic another one logged.

Each logged round t has the reward r_t of the action a_t the logging policy π_b chose, its
propensity p_t = π_b(a_t | x_t) (recorded in the impression), and the probability the policy
under evaluation π_e gives the same action, π_e(a_t | x_t). With the importance weight
w_t = π_e(a_t | x_t) / p_t:

- IPS   V = mean(w r)                                   (unbiased; variance grows with w)
- SNIPS V = Σ w r / Σ w                                 (self-normalised; small bias, less variance)
- DR    V = mean(q̂_π(x) + w (r − q̂(x, a)))             (a reward model q̂ as control variate;
                                                         unbiased if either q̂ or p is right)

where q̂_π(x) = Σ_a π_e(a | x) q̂(x, a). The values are those of Open Bandit Pipeline 0.4.1's
`InverseProbabilityWeighting`, `SelfNormalizedInverseProbabilityWeighting` and `DoublyRobust`
(no clipping), fed the same arrays; tests compare the two to float tolerance.

Intervals are normal approximations on the per-round terms: IPS and DR are means of i.i.d.
terms (standard error std/√n); SNIPS is a ratio of two means and gets the delta method, whose
influence terms are w (r − V) / mean(w). With one round the interval is unbounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
from numpy.typing import ArrayLike, NDArray

from schemas.errors import AdstreamError

Array = NDArray[np.float64]


class EstimationError(AdstreamError, ValueError):
    """An estimate was asked of data that cannot give one (empty, mismatched, out of range, no traffic)."""


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its two-sided interval and the number of rounds (or units) behind it."""

    value: float
    ci_low: float
    ci_high: float
    n: int

    @property
    def half_width(self) -> float:
        """Half the interval's width (the ± of the estimate)."""
        return (self.ci_high - self.ci_low) / 2.0

    def as_dict(self) -> dict[str, float | int]:
        """The estimate as plain JSON-ready numbers."""
        return {"value": self.value, "ci_low": self.ci_low, "ci_high": self.ci_high, "n": self.n}


def z_value(alpha: float) -> float:
    """The normal quantile of a two-sided (1 − alpha) interval (1.96 for alpha = 0.05).

    >>> round(z_value(0.05), 4)
    1.96
    """
    if not 0.0 < alpha < 1.0:
        raise EstimationError(f"alpha {alpha!r} must lie in (0, 1)")
    return NormalDist().inv_cdf(1.0 - alpha / 2.0)


def normal_interval(terms: Array, alpha: float = 0.05, centre: float | None = None) -> Estimate:
    """Mean of i.i.d. per-round terms (or `centre`) ± z · std(terms, ddof=1) / √n."""
    n = int(terms.shape[0])
    value = float(terms.mean()) if centre is None else centre
    if n < 2:
        return Estimate(value, -math.inf, math.inf, n)
    half = z_value(alpha) * float(terms.std(ddof=1)) / math.sqrt(n)
    return Estimate(value, value - half, value + half, n)


def _column(name: str, values: ArrayLike, n: int | None) -> Array:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise EstimationError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise EstimationError(f"{name} is empty: no logged rounds to estimate from")
    if n is not None and arr.shape[0] != n:
        raise EstimationError(f"{name} has {arr.shape[0]} rounds but reward has {n}")
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise EstimationError(f"{name}[{bad[0]}] = {float(arr[bad[0]])!r} is not finite")
    return arr


def _checked(reward: ArrayLike, pscore: ArrayLike, target_prob: ArrayLike) -> tuple[Array, Array, Array]:
    r = _column("reward", reward, None)
    n = int(r.shape[0])
    p = _column("pscore", pscore, n)
    bad = np.flatnonzero((p <= 0.0) | (p > 1.0))
    if bad.size:
        raise EstimationError(f"pscore[{bad[0]}] = {float(p[bad[0]])!r} is not a probability in (0, 1]")
    pi = _column("target_prob", target_prob, n)
    bad = np.flatnonzero((pi < 0.0) | (pi > 1.0))
    if bad.size:
        raise EstimationError(f"target_prob[{bad[0]}] = {float(pi[bad[0]])!r} is not a probability in [0, 1]")
    return r, p, pi


def ips(reward: ArrayLike, pscore: ArrayLike, target_prob: ArrayLike, alpha: float = 0.05) -> Estimate:
    """Inverse propensity scoring: the mean of w·r, with a normal interval.

    >>> e = ips([1, 0, 1, 0], [0.5, 0.5, 0.25, 1.0], [1, 0, 0.5, 1])
    >>> e.value, e.n
    (1.0, 4)
    """
    r, p, pi = _checked(reward, pscore, target_prob)
    return normal_interval(pi / p * r, alpha)


def snips(reward: ArrayLike, pscore: ArrayLike, target_prob: ArrayLike, alpha: float = 0.05) -> Estimate:
    """Self-normalised IPS: Σ w·r / Σ w, with a delta-method interval.

    >>> snips([1, 0, 1, 0], [0.5, 0.5, 0.25, 1.0], [1, 0, 0.5, 1]).value
    0.8
    """
    r, p, pi = _checked(reward, pscore, target_prob)
    w = pi / p
    w_mean = float(w.mean())
    if w_mean == 0.0:
        raise EstimationError(
            "snips: the target policy gives probability 0 to every logged action (Σ w = 0), "
            "so the logged data say nothing about it"
        )
    value = float((w * r).mean()) / w_mean
    return normal_interval(w * (r - value) / w_mean, alpha, centre=value)


def dr(
    reward: ArrayLike,
    pscore: ArrayLike,
    target_prob: ArrayLike,
    q_logged: ArrayLike,
    q_target: ArrayLike,
    alpha: float = 0.05,
) -> Estimate:
    """Doubly robust: the mean of q̂_π(x) + w·(r − q̂(x, a)), with a normal interval.

    `q_logged` is q̂(x, a) of the logged action, `q_target` is Σ_a π_e(a|x) q̂(x, a).

    >>> round(dr([1, 0], [0.5, 0.5], [1, 0], [0.6, 0.2], [0.6, 0.4]).value, 12)
    0.9
    """
    r, p, pi = _checked(reward, pscore, target_prob)
    n = int(r.shape[0])
    q_a = _column("q_logged", q_logged, n)
    q_pi = _column("q_target", q_target, n)
    return normal_interval(q_pi + pi / p * (r - q_a), alpha)
