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
