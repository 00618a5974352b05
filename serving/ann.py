"""Approximate recall for large catalogs: an HNSW graph (usearch) over the catalog's rows.

`UsearchIndex` fits the `AnnIndex` protocol of `serving.index`. Ads enter and leave one at a time
(`upsert`: a new ad is added, an updated one re-inserted, a paused one removed), so the catalog
never needs a rebuild while it serves. The graph stores compact vectors (`f16`/`i8`); the
candidates it returns are re-scored exactly against the catalog's float32 matrix, so the order
and scores recall hands to the ranker are exact, and only which ads are candidates is approximate.

Rows the request may not see (budget spent, frequency-capped) stay in the graph: the search asks
for more candidates in proportion to their share and drops them (and asks again for twice as
many when too few remain), so `allowed` keeps its meaning without a rebuild.
Below `exact_below` ads a matmul is faster than the graph and exact, and is used instead.

>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> vecs = rng.normal(size=(3000, 8)).astype(np.float32)
>>> ann = UsearchIndex(8, exact_below=0)
>>> ann.update(vecs, 3000)
>>> ann.upsert_many(np.arange(3000), np.ones(3000, dtype=bool))
>>> rows, scores = ann.search(vecs[7], 5, None)
>>> int(rows[0]) == int(np.argmax(vecs @ vecs[7])), bool(np.all(np.diff(scores) <= 0))
(True, True)
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import numpy as np

from schemas.errors import ConfigError
from serving.index import exact_search

log = logging.getLogger(__name__)

Dtype = Literal["f32", "f16", "i8"]


class UsearchIndex:
    """Inner-product HNSW over catalog rows (keys = row numbers), exact re-scoring of candidates."""

    BATCH = 4096

    def __init__(
        self,
        dim: int,
        *,
        connectivity: int = 16,
        expansion_add: int = 128,
        expansion_search: int = 64,
        dtype: Dtype = "i8",
        oversample: float = 1.3,
        exact_below: int = 20_000,
        threads: int = 1,
    ) -> None:
        from usearch.index import Index

        if oversample < 1:
            raise ConfigError(f"recall.ann_oversample must be >= 1, got {oversample}")
        self.dim = dim
        self.dtype = dtype
        self.oversample = oversample
        self.exact_below = exact_below
        self.expansion_search = expansion_search
        self.threads = threads
        self.graph: Any = Index(
            ndim=dim,
            metric="ip",
            dtype=dtype,
            connectivity=connectivity,
            expansion_add=expansion_add,
            expansion_search=expansion_search,
        )
        self.vectors = np.zeros((0, dim), dtype=np.float32)
        self.n = 0
        self.indexed = np.zeros(0, dtype=bool)  # row → in the graph (active ads)
        self.pending: dict[int, bool] = {}  # upserts not applied yet (row → active)

    # -- keeping up with the catalog ------------------------------------------------------
    def update(self, vectors: np.ndarray, n: int) -> None:
        """Point at the catalog's current float32 matrix (it may have been reallocated)."""
        self.vectors = vectors
        self.n = n
        if self.indexed.shape[0] < vectors.shape[0]:
            grown = np.zeros(vectors.shape[0], dtype=bool)
            grown[: self.indexed.shape[0]] = self.indexed
            self.indexed = grown

    def _graph_vectors(self, rows: np.ndarray) -> np.ndarray:
        vecs: np.ndarray = np.asarray(self.vectors[rows], dtype=np.float32)
        # i8 holds [-1, 1]: rows go in at unit length, so nothing is clipped. The graph then ranks
        # by cosine, which is the inner product for the unit vectors recall uses (content
        # vectors and two-tower outputs are both L2-normalised); the re-scoring is exact anyway.
        if self.dtype == "i8":
            norms = np.linalg.norm(vecs, axis=1, keepdims=True)
            vecs = (vecs / np.where(norms > 0, norms, 1.0)).astype(np.float32)
        return vecs

    def upsert(self, row: int, active: bool) -> None:
        """Row `row` of the matrix changed (new ad, new vector, paused or resumed). Applied at the
        next search, or in bulk every `BATCH` rows (a catalog loaded ad by ad at start is then
        inserted by every core, not one insert at a time)."""
        self.pending[row] = active
        if len(self.pending) >= self.BATCH:
            self.flush()

    def flush(self) -> None:
        """Apply the pending `upsert`s to the graph."""
        if self.pending:
            rows = np.fromiter(self.pending.keys(), dtype=np.int64, count=len(self.pending))
            active = np.fromiter(self.pending.values(), dtype=bool, count=len(self.pending))
            self.pending = {}
            self.upsert_many(rows, active)

    def upsert_many(self, rows: np.ndarray, active: np.ndarray) -> None:
        """`upsert` for many rows at once (start-up: the graph is built in one multi-threaded call)."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.shape[0] and int(rows.max()) >= self.n:
            raise ConfigError(f"row {int(rows.max())} is beyond the catalog's {self.n} rows: update() first")
        stale = rows[self.indexed[rows]]
        if stale.shape[0]:
            self.graph.remove(stale.astype(np.uint64))
            self.indexed[stale] = False
        add = rows[np.asarray(active, dtype=bool)]
        if add.shape[0]:
            threads = 0 if add.shape[0] > 1000 else 1  # bulk: every core; one ad: no thread pool
            self.graph.add(add.astype(np.uint64), self._graph_vectors(add), threads=threads)
            self.indexed[add] = True

    def __len__(self) -> int:
        self.flush()
        return len(self.graph)

    # -- search -----------------------------------------------------------------------------
    def search(self, query: np.ndarray, k: int, allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The best `k` allowed rows by inner product, best first, with their exact scores."""
        q = np.asarray(query, dtype=np.float32)
        n = self.n
        if n < self.exact_below:
            return exact_search(self.vectors[:n], q, k, allowed)
        self.flush()
        indexed = self.indexed[:n]
        size = len(self.graph)
        hidden = 0 if allowed is None else int(np.count_nonzero(indexed & ~allowed[:n]))
        visible = size - hidden
        if visible <= 0 or k <= 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        # hidden rows come back in proportion to their share; fetch more when too few were left
        want = int(np.ceil(k * self.oversample * size / visible))
        norm = float(np.linalg.norm(q))
        probe = q / norm if self.dtype == "i8" and norm > 0 else q  # the ranking is scale-free
        while True:
            if want >= size // 2:  # most of the graph: the walk costs more than a matmul
                mask = indexed if allowed is None else allowed[:n] & indexed
                return exact_search(self.vectors[:n], q, k, mask)
            self.graph.expansion_search = max(self.expansion_search, want)
            rows = self.graph.search(probe, want, threads=self.threads).keys.astype(np.int64)
            if allowed is not None:
                rows = rows[allowed[rows]]
            if rows.shape[0] >= min(k, visible):
                break
            want *= 2
        scores = self.vectors[rows] @ q
        top = np.argsort(-scores, kind="stable")[:k]
        return rows[top], scores[top]
