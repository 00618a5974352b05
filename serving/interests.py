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
their own (a warm user is ranked on their own state alone). Names the catalog does not hold are
ignored and counted (`unknown`), as OpenRTB bidders ignore taxonomy values they do not know:
a client keeps sending what its users picked while the catalog's categories change.

>>> cents = category_centroids({"a": 0, "b": 1}, np.array([0, 0, 1]),
...                            np.array([[1, 0], [0, 1], [1, 1]], dtype=np.float32))
>>> p = interest_prior(["b", "zz"], cents, weight=1.0, evidence=0.0)
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


def category_centroids(
    codes: Mapping[str, int], row_codes: np.ndarray, content: np.ndarray
) -> CategoryCentroids:
    """Centroids from each ad's category code (`row_codes`, [n]) and content vector (`content`,
    [n, dim]); `codes` maps category names to codes. A code no ad uses gets no centroid."""
    n_codes = max(codes.values(), default=-1) + 1
    sums = np.zeros((n_codes, content.shape[1]), dtype=np.float64)
    np.add.at(sums, row_codes, content)
    counts = np.bincount(row_codes, minlength=n_codes)
    used = {name: code for name, code in codes.items() if counts[code] > 0}
    vectors = (sums / np.maximum(counts, 1)[:, None]).astype(np.float32)
    return CategoryCentroids(used, vectors)


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
