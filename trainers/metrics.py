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
from collections import deque
from collections.abc import Sequence

import numpy as np

from schemas.stats import auc

__all__ = ["RollingMetrics", "auc", "logloss"]

_EPS = 1e-7


def logloss(probs: Sequence[float] | np.ndarray, labels: Sequence[int] | np.ndarray) -> float:
    """Mean binary cross-entropy, probabilities clipped to [1e-7, 1 - 1e-7]; NaN when empty."""
    p = np.clip(np.asarray(probs, dtype=np.float64), _EPS, 1 - _EPS)
    y = np.asarray(labels, dtype=np.float64)
    if len(p) == 0:
        return math.nan
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


class RollingMetrics:
    """AUC and log loss over the last `window` (prediction, label) pairs."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._p: deque[float] = deque(maxlen=window)
        self._y: deque[int] = deque(maxlen=window)

    def update(self, prob: float, label: int) -> None:
        """Add one scored example."""
        self._p.append(float(prob))
        self._y.append(int(label))

    def extend(self, probs: Sequence[float], labels: Sequence[int]) -> None:
        """Add many scored examples."""
        for p, y in zip(probs, labels, strict=True):
            self.update(p, y)

    @property
    def count(self) -> int:
        """Pairs currently in the window."""
        return len(self._p)

    @property
    def positives(self) -> int:
        """Positive labels currently in the window."""
        return sum(self._y)

    def auc(self) -> float:
        """AUC of the window (NaN with one class only)."""
        return auc(list(self._p), list(self._y))

    def logloss(self) -> float:
        """Log loss of the window (NaN when empty)."""
        return logloss(list(self._p), list(self._y))

    def clear(self) -> None:
        """Forget everything (after an adapter reset)."""
        self._p.clear()
        self._y.clear()
