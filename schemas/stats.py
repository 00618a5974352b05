"""Statistics two or more rooms must compute identically (the canary in serving, the trainers'
progressive validation, the simulator's oracle): one definition, imported by all of them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def auc(scores: Sequence[float] | np.ndarray, labels: Sequence[int] | Sequence[bool] | np.ndarray) -> float:
    """Area under the ROC curve by ranks (ties count half); NaN when only one class is present.

    A label is positive when it is non-zero (`True`, `1`). NaN scores are rejected: they have
    no rank, and silently ranking them would make the AUC depend on the sort's whims.

    >>> auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1])
    0.75
    >>> auc([0.5, 0.5, 0.5], [0, 1, 0])
    0.5
    >>> math.isnan(auc([0.1, 0.2], [1, 1]))
    True
    """
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels).reshape(-1).astype(bool)
    if s.shape != y.shape:
        raise ValueError(f"auc: {s.shape[0]} scores but {y.shape[0]} labels")
    if np.isnan(s).any():
        raise ValueError("auc: scores contain NaN")
    n_pos = int(y.sum())
    n_neg = int(y.shape[0]) - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    # average 1-based ranks over runs of tied scores
    boundaries = np.flatnonzero(np.diff(sorted_s)) + 1
    starts = np.concatenate(([0], boundaries))
    ends = np.concatenate((boundaries, [len(s)]))
    ranks = np.empty(len(s), dtype=np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def _midranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of `x`, ties sharing their mean rank."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    bounds = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1], True])
    mid = (bounds[:-1] + bounds[1:] - 1) / 2.0 + 1.0
    out = np.empty(x.shape[0], dtype=np.float64)
    out[order] = np.repeat(mid, np.diff(bounds))
    return out


def paired_auc_difference(
    scores_a: np.ndarray, scores_b: np.ndarray, labels: np.ndarray
) -> tuple[float, float]:
    """AUC(a) − AUC(b) of two models scored on the same examples, and its standard error by
    DeLong's method (DeLong, DeLong & Clarke-Pearson 1988; the midrank form of Sun & Xu 2014),
    which accounts for the two AUCs' correlation. (NaN, NaN) with fewer than two examples of a
    class. The trainer's guard and its online-vs-frozen report use it.

    >>> y = np.array([0, 0, 1, 1, 0, 1])
    >>> a, b = np.array([0.1, 0.2, 0.8, 0.9, 0.3, 0.7]), np.array([0.2, 0.1, 0.3, 0.9, 0.8, 0.7])
    >>> d, se = paired_auc_difference(a, b, y)
    >>> round(d, 4), round(se, 4)
    (0.2222, 0.2485)
    >>> paired_auc_difference(np.array([.1, .2]), np.array([.3, .1]), np.array([1, 1]))
    (nan, nan)
    """
    y = np.asarray(labels).reshape(-1).astype(bool)
    s = np.vstack(
        [np.asarray(scores_a, np.float64).reshape(-1), np.asarray(scores_b, np.float64).reshape(-1)]
    )
    if s.shape[1] != y.shape[0]:
        raise ValueError(f"paired_auc_difference: {s.shape[1]} scores but {y.shape[0]} labels")
    m, n = int(y.sum()), int((~y).sum())
    if m < 2 or n < 2:
        return math.nan, math.nan
    v10 = np.empty((2, m))
    v01 = np.empty((2, n))
    aucs = np.empty(2)
    for k in range(2):
        tz = _midranks(s[k])
        tx, ty = _midranks(s[k][y]), _midranks(s[k][~y])
        aucs[k] = (tz[y].sum() - m * (m + 1) / 2.0) / (m * n)
        v10[k] = (tz[y] - tx) / n
        v01[k] = 1.0 - (tz[~y] - ty) / m
    s10, s01 = np.cov(v10), np.cov(v01)
    var = (s10[0, 0] + s10[1, 1] - 2 * s10[0, 1]) / m + (s01[0, 0] + s01[1, 1] - 2 * s01[0, 1]) / n
    return float(aucs[0] - aucs[1]), float(math.sqrt(max(var, 0.0)))
