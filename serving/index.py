"""Recall index: nearest ad vectors to a query, behind a small protocol.

`ExactIndex` is a numpy matmul over all ad vectors. For the catalog sizes served here (≤ 100k ads,
32 dims) it beats an ANN library on this CPU (see `benchmarks/rank.py` for the measured figure), and
it is exact; `serving.ann.UsearchIndex` (HNSW) fits the same protocol for large catalogs
(`recall_index=usearch`, measured in `benchmarks/recall.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class AnnIndex(Protocol):
    """A vector index over catalog rows (inner product)."""

    def update(self, vectors: np.ndarray, n: int) -> None:
        """The catalog's matrix now (it may have been reallocated) and its row count."""
        ...

    def upsert(self, row: int, active: bool) -> None:
        """Row `row` is new or changed; an inactive (paused) ad leaves the index."""
        ...

    def search(self, query: np.ndarray, k: int, allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The best `k` rows (and their scores, best first) among `allowed` (bool per row)."""
        ...


class ExactIndex:
    """Exact inner-product search over a live matrix (the catalog's vector column)."""

    def __init__(self, vectors: np.ndarray, n: int) -> None:
        self.vectors = vectors
        self.n = n

    def update(self, vectors: np.ndarray, n: int) -> None:
        """Point at the catalog's current vectors (new ads enter by this, no rebuild)."""
        self.vectors = vectors
        self.n = n

    def upsert(self, row: int, active: bool) -> None:
        """Nothing to do: the matrix is read live, and `allowed` hides paused ads."""

    def search(self, query: np.ndarray, k: int, allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        scores = self.vectors[: self.n] @ np.asarray(query, dtype=np.float32)
        if allowed is not None:
            scores = np.where(allowed[: self.n], scores, -np.inf)
            k = min(k, int(allowed[: self.n].sum()))
        k = min(k, self.n)
        if k <= 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        top = np.argpartition(-scores, k - 1)[:k] if k < self.n else np.arange(self.n)
        top = top[np.argsort(-scores[top], kind="stable")]
        return top.astype(np.int64), scores[top]


def exact_search(
    vectors: np.ndarray,
    query: np.ndarray,
    k: int,
    allowed: np.ndarray | None,
    extra: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k inner product over `vectors` among `allowed` rows (best first); `extra`: a
    score per row added first (a query text's match, `serving.text`)."""
    scores = vectors @ np.asarray(query, dtype=np.float32)
    return top_k(scores if extra is None else scores + extra, k, allowed)


def exact_search_many(
    vectors: np.ndarray,
    queries: np.ndarray,
    k: int,
    allowed: np.ndarray,
    extra: Sequence[np.ndarray | None] | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`exact_search` of a batch of queries ([b, dim]) with one matmul; `allowed` is [b, n];
    `extra[i]`, when given, is added to query i's scores.

    >>> v = np.eye(3, dtype=np.float32)
    >>> [r.tolist() for r, _ in exact_search_many(v, v[[2, 0]], 1, np.ones((2, 3), bool))]
    [[2], [0]]
    """
    # [n, b] then rows: the catalog-major product is ~7x faster than queries @ vectors.T here
    scores = np.ascontiguousarray((vectors @ np.asarray(queries, dtype=np.float32).T).T)
    for i, add in enumerate(extra or ()):
        if add is not None:
            scores[i] += add
    return [top_k(scores[i], k, allowed[i]) for i in range(scores.shape[0])]


def top_k(scores: np.ndarray, k: int, allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The best `k` rows of `scores` among `allowed` ones, and their scores, best first."""
    n = scores.shape[0]
    if allowed is not None:
        scores = np.where(allowed[:n], scores, -np.inf)
        k = min(k, int(allowed[:n].sum()))
    k = min(k, n)
    if k <= 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    top = np.argpartition(-scores, k - 1)[:k] if k < n else np.arange(n)
    top = top[np.argsort(-scores[top], kind="stable")]
    return top.astype(np.int64), scores[top]
