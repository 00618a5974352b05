"""Cold start of a user from declared interests: a prior user state made of pseudo-clicks.

A brand-new user has no state record, so the ranker sees a zero state vector and zero intent
scores, and recall falls back to what is popular. A request may declare the user's interests
(`AdRequest.interests`: category names, e.g. picked at sign-up). Each declared category that the
catalog holds becomes `weight` pseudo-clicks on a typical ad of it, built in the very space
streams build user states in (`schemas.vectors`; `streams.state.apply_event` adds a click's
weight × the ad's content vector to the state vector and the weight to its category's intent):

- state vector: Σ over known declared categories of `weight` × the category's centroid (the mean
  content vector of its ads in the catalog: a click's expected contribution);
- intent scores: `weight` for each of those categories.

So the prior is a state the trained ranker has seen (users after their first clicks): no
retraining, no extra model, nothing read from Redis. It is added to what the user's own state
holds, scaled by `1 - evidence / weight` (`evidence`: the sum of the user's decayed intent
scores), so it gives way as real evidence accrues and is gone once the user has that much of
their own (a warm user is ranked on their own state alone). The ranker layer-normalises its
dense input, so a brand-new user's ranking does not depend on `weight` (the prior is scaled as a
whole; `benchmarks/cold_start.py` sweeps it): `weight` sets how much evidence of their own
replaces the prior. Names the catalog does not hold are
ignored and counted (`unknown`), as OpenRTB bidders ignore taxonomy values they do not know:
a client keeps sending what its users picked while the catalog's categories change.

>>> table = CentroidTable(2)
>>> for row, (cat, vec) in enumerate([("a", [1, 0]), ("a", [0, 1]), ("b", [1, 1])]):
...     table.put(row, cat, np.array(vec))
>>> table.centroids().vector("a").tolist()
[0.5, 0.5]
>>> p = interest_prior(["b", "zz"], table.centroids(), weight=1.0, evidence=0.0)
>>> p.vector.tolist(), p.intents, p.used, p.unknown
([1.0, 1.0], {'b': 1.0}, 1, 1)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CategoryCentroids:
    """The mean content vector of each catalog category (rows of `vectors`, by `index`)."""

    index: Mapping[str, int]
    vectors: np.ndarray  # float32 [categories, state_dim]

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])

    def vector(self, category: str) -> np.ndarray | None:
        """The centroid of `category`, None when the catalog has no ad in it."""
        i = self.index.get(category)
        return None if i is None else self.vectors[i]


class CentroidTable:
    """Per-category sums of the catalog's content vectors, kept as ads come, change or give up
    their row, so `centroids()` costs O(categories), never a pass over the catalog."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self._sums: dict[str, np.ndarray] = {}  # float64: many adds and removes stay exact enough
        self._counts: dict[str, int] = {}
        self._rows: dict[int, tuple[str, np.ndarray]] = {}
        self._cache: CategoryCentroids | None = None

    def put(self, row: int, category: str, vector: np.ndarray) -> None:
        """The ad at catalog `row` now has `category` and content `vector` (replacing what was there)."""
        old = self._rows.get(row)
        if old is not None:
            cat, vec = old
            self._counts[cat] -= 1
            if self._counts[cat]:
                self._sums[cat] -= vec
            else:
                del self._counts[cat], self._sums[cat]
        vec = np.asarray(vector, dtype=np.float64)[: self.dim]
        self._rows[row] = (category, vec)
        self._counts[category] = self._counts.get(category, 0) + 1
        self._sums[category] = self._sums.get(category, np.zeros(self.dim)) + vec
        self._cache = None

    def centroids(self) -> CategoryCentroids:
        """The mean content vector of every category with an ad (cached until the next `put`)."""
        if self._cache is None:
            names = sorted(self._sums)
            vectors = np.zeros((len(names), self.dim), dtype=np.float32)
            for i, name in enumerate(names):
                vectors[i] = self._sums[name] / self._counts[name]
            self._cache = CategoryCentroids({n: i for i, n in enumerate(names)}, vectors)
        return self._cache


@dataclass(frozen=True)
class InterestPrior:
    """What declared interests add to a user's state, and how many were used, faded or unknown."""

    vector: np.ndarray  # float32 [dim]; zeros when nothing is added
    intents: dict[str, float]
    used: int = 0
    faded: int = 0  # known, but the user's own evidence already outweighs the prior
    unknown: int = 0


def interest_prior(
    interests: Sequence[str], centroids: CategoryCentroids, weight: float, evidence: float
) -> InterestPrior:
    """The prior of `interests` for a user whose state holds `evidence` (Σ decayed intent scores;
    0 for a brand-new user): `weight` × (1 − evidence / weight) pseudo-clicks per known category."""
    known = [c for c in interests if c in centroids.index]
    unknown = len(interests) - len(known)
    share = 1.0 - max(evidence, 0.0) / weight if weight > 0 else 0.0
    vector = np.zeros(centroids.dim, dtype=np.float32)
    if not known or share <= 0:
        return InterestPrior(vector, {}, faded=len(known), unknown=unknown)
    w = weight * share
    rows = [centroids.index[c] for c in known]
    vector += np.float32(w) * centroids.vectors[rows].sum(axis=0)
    return InterestPrior(vector, dict.fromkeys(known, w), used=len(known), unknown=unknown)
