"""Click-model quality metrics: AUC and log loss, whole-run and over a rolling window.

>>> round(auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]), 3)
0.75
>>> r = RollingMetrics(window=3)
>>> for p, y in [(0.9, 1), (0.1, 0), (0.8, 1), (0.2, 0)]:
...     r.update(p, y)
>>> r.count, round(r.auc(), 2)
(3, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from schemas.stats import auc

__all__ = ["RollingMetrics", "auc", "logloss", "rank_auc"]

_EPS = 1e-7


def logloss(probs: Sequence[float] | np.ndarray, labels: Sequence[int] | np.ndarray) -> float:
    """Mean binary cross-entropy, probabilities clipped to [1e-7, 1 - 1e-7]; NaN when empty."""
    p = np.clip(np.asarray(probs, dtype=np.float64), _EPS, 1 - _EPS)
    y = np.asarray(labels, dtype=np.float64)
    if len(p) == 0:
        return math.nan
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def rank_auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """`auc(scores, positive)` for float64 `scores` and a bool mask, equal to it bit for bit:
    the same tie-averaged rank sum, found by sorting once and looking the positives up
    (`searchsorted`) instead of an argsort plus a rank scatter; ~5× faster on a 2,000-pair window.

    >>> rank_auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([False, False, True, True]))
    0.75
    """
    if np.isnan(scores).any():
        raise ValueError("auc: scores contain NaN")
    pos = scores[positive]
    n_pos = len(pos)
    n_neg = len(scores) - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    ordered = np.sort(scores)
    # a positive's 1-based rank, averaged over its ties: (first + last) / 2 = (left + 1 + right) / 2
    twice = int((np.searchsorted(ordered, pos, "left") + np.searchsorted(ordered, pos, "right")).sum())
    rank_sum = (twice + n_pos) / 2.0
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


_NO_KEY = np.iinfo(np.int64).min  # a slot written without a key


def key_ids(keys: Iterable[Hashable]) -> np.ndarray:
    """int64 ids of `keys` for `RollingMetrics` (Python's hash: stable within one process, which
    is all a rolling window lives in)."""
    return np.fromiter(map(hash, keys), np.int64)


def _ring_put(ring: np.ndarray, start: int, values: np.ndarray) -> None:
    """`values` into `ring` from slot `start` on, wrapping to its start (len(values) <= len(ring))."""
    first = min(len(values), len(ring) - start)
    ring[start : start + first] = values[:first]
    ring[: len(values) - first] = values[first:]


class RollingMetrics:
    """AUC and log loss over the last `window` (prediction, label) pairs.

    A ring of two numpy arrays with a running count of positives: the online trainer's guard
    reads `count`, `positives` and `auc()` after every step, so none of them may copy the window
    into Python lists (AUC does not depend on the order of the pairs, so the ring is never
    rotated back into arrival order). `auc()` is kept until the window changes: the guard and the
    metrics export both read it after a step.

    Delayed labels: pairs added with `keys` (impression ids) can be made positive later by
    `relabel(keys)`, when a click arrives for an impression scored earlier as a negative (the
    fake-negative label modes): each impression is one pair, scored once, with its final label.

    >>> m = RollingMetrics(4)
    >>> m.extend([0.9, 0.2, 0.6], [0, 0, 0], keys=key_ids(["i1", "i2", "i3"]))
    >>> m.relabel(key_ids(["i1", "gone"])), m.positives, m.auc()
    (1, 1, 1.0)
    """

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._p = np.zeros(window, dtype=np.float64)
        self._y = np.zeros(window, dtype=np.int8)
        self._next = 0  # slot the next pair goes to
        self._count = 0
        self._positives = 0
        self._auc: float | None = None  # auc() of the window as it is, until the next change
        self._keys: np.ndarray | None = None  # each slot's key hash, once a key was given

    def update(self, prob: float, label: int) -> None:
        """Add one scored example."""
        self.extend([prob], [label])

    def extend(
        self,
        probs: Sequence[float] | np.ndarray,
        labels: Sequence[int] | np.ndarray,
        keys: np.ndarray | None = None,
    ) -> None:
        """Add many scored examples (with `keys`, int64 ids such as `key_ids(impression_ids)`,
        each pair can be `relabel`ed positive later)."""
        p = np.asarray(probs, dtype=np.float64).reshape(-1)
        y = (np.asarray(labels).reshape(-1) != 0).astype(np.int8)
        if p.shape != y.shape:
            raise ValueError(f"extend: {p.shape[0]} probabilities but {y.shape[0]} labels")
        if keys is not None and len(keys) != len(p):
            raise ValueError(f"extend: {len(p)} probabilities but {len(keys)} keys")
        if len(p) > self.window:  # only the newest `window` pairs survive
            p, y = p[-self.window :], y[-self.window :]
            keys = None if keys is None else keys[-self.window :]
        n = len(p)
        if n == 0:
            return
        if keys is not None or self._keys is not None:
            self._write_keys(self._next, n, keys)
        self._auc = None
        # the slots written: `first` from `_next` on, the rest wrapped to the start of the ring
        start = self._next
        first = min(n, self.window - start)
        if self._count == self.window:  # full: the overwritten pairs leave the window
            self._positives -= int(self._y[start : start + first].sum()) + int(self._y[: n - first].sum())
        elif n > first:  # filling (then `_next == _count`): the wrapped slots hold the oldest pairs
            self._positives -= int(self._y[: n - first].sum())
        _ring_put(self._p, start, p)
        _ring_put(self._y, start, y)
        self._positives += int(y.sum())
        self._next = (start + n) % self.window
        self._count = min(self.window, self._count + n)

    def _write_keys(self, start: int, n: int, keys: np.ndarray | None) -> None:
        """The keys of the `n` slots written from `start` on (wrapping; no key: none)."""
        if self._keys is None:
            self._keys = np.full(self.window, _NO_KEY, dtype=np.int64)
        _ring_put(self._keys, start, np.full(n, _NO_KEY, dtype=np.int64) if keys is None else keys)

    def relabel(self, keys: np.ndarray) -> int:
        """Make the pairs of `keys` positive (their clicks arrived); returns how many it changed
        (a key that left the window, was never added or is positive already changes nothing)."""
        if self._keys is None or len(keys) == 0:
            return 0
        return self._apply(np.isin(self._keys[: self._count], keys))

    @staticmethod
    def relabel_all(windows: Sequence[RollingMetrics], keys: np.ndarray) -> int:
        """`relabel(keys)` on each window, the keys looked up once: windows extended together
        (the online and the base scores of the same impressions) hold the same keys in the same
        slots, so one `np.isin` finds them in all (a window whose keys differ looks on its own).
        Returns how many pairs the first one changed."""
        if not windows:
            return 0
        first = windows[0]
        if first._keys is None or len(keys) == 0:
            return 0
        n = first._count
        at = np.isin(first._keys[:n], keys)
        found = first._apply(at)
        for w in windows[1:]:
            same = w._count == n and w._keys is not None and np.array_equal(w._keys[:n], first._keys[:n])
            if same:
                w._apply(at)
            else:
                w.relabel(keys)
        return found

    def _apply(self, at: np.ndarray) -> int:
        """Make the negative pairs among the first `len(at)` slots marked in `at` positive."""
        hit = at & (self._y[: len(at)] == 0)
        found = int(hit.sum())
        if found:
            self._y[: len(at)][hit] = 1
            self._positives += found
            self._auc = None
        return found

    @property
    def count(self) -> int:
        """Pairs currently in the window."""
        return self._count

    @property
    def positives(self) -> int:
        """Positive labels currently in the window."""
        return self._positives

    def _view(self) -> tuple[np.ndarray, np.ndarray]:
        if self._count == self.window:
            return self._p, self._y
        return self._p[: self._count], self._y[: self._count]

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """The window's (prediction, label) arrays, a view in slot order: two windows extended and
        relabelled together (the online model's and the frozen base's) are aligned slot by slot."""
        return self._view()

    def auc(self) -> float:
        """AUC of the window (NaN with one class only)."""
        if self._auc is None:
            p, y = self._view()
            self._auc = rank_auc(p, y.astype(bool))
        return self._auc

    def logloss(self) -> float:
        """Log loss of the window (NaN when empty)."""
        p, y = self._view()
        return logloss(p, y)

    def clear(self) -> None:
        """Forget everything (after an adapter reset)."""
        self._next = self._count = self._positives = 0
        self._auc = None
        self._keys = None
