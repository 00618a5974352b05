"""Approximate recall for large catalogs: an inverted-file index (IVF) over the catalog's rows.

`IvfIndex` fits the `AnnIndex` protocol of `serving.index`. Spherical k-means splits the ads
into `lists` cells around unit centroids (2·√N by default); a request scores the centroids and
scans the ads of its best cells, best first, until it has seen `scan` × k visible ads (each
cell's vectors lie contiguously in one packed float32 copy, so a cell is one small matmul), and
keeps the best `k`. Scores are exact inner products: only which ads
are candidates is approximate, as with the graph (`serving.ann.UsearchIndex`).

Live changes need no rebuild: a new ad, or one whose vector changed, is scanned from a small
side list until the next repack (every `REPACK` changes: only those go into their nearest cell,
the packed copy is rebuilt, nothing is re-trained); a paused ad is masked out at once. The centroids
are trained once, on a seeded sample, when the catalog first reaches `exact_below` ads, and again
only when it has grown `RETRAIN_GROWTH`-fold since. Below `exact_below` ads a matmul is exact
and fast enough, and is used instead.

Why cells and not a graph (measured by `benchmarks/recall.py` on 1 M ads × 32 dims, k = 500):
a graph walk for 500 neighbours visits thousands of nodes one at a time, while the cells give
a few contiguous blocks that BLAS scores at memory speed; the cells also train in seconds where
the graph's inserts took over half an hour on 2 cores.

>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> vecs = rng.normal(size=(4000, 8)).astype(np.float32)
>>> ivf = IvfIndex(8, lists=16, scan=8, exact_below=0)
>>> ivf.update(vecs, 4000)
>>> ivf.upsert_many(np.arange(4000), np.ones(4000, dtype=bool))
>>> rows, scores = ivf.search(vecs[7], 5, None)
>>> int(rows[0]) == int(np.argmax(vecs @ vecs[7])), bool(np.all(np.diff(scores) <= 0))
(True, True)
"""

from __future__ import annotations

import numpy as np

from schemas.errors import ConfigError
from serving.index import exact_search


def _unit(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    out: np.ndarray = (x / np.where(norms > 0, norms, 1.0)).astype(np.float32)
    return out


def spherical_kmeans(x: np.ndarray, k: int, iters: int, seed: int) -> np.ndarray:
    """`k` unit centroids of the rows of `x` by inner product (Lloyd's iterations; an empty
    cell takes the row its centroid explains worst, so every cell stays in use)."""
    rng = np.random.default_rng(seed)
    xu = _unit(np.asarray(x, dtype=np.float32))
    cent = xu[rng.choice(xu.shape[0], size=k, replace=False)].copy()
    for _ in range(iters):
        assign, best = _nearest(xu, cent)
        sums = np.zeros_like(cent)
        np.add.at(sums, assign, xu)
        counts = np.bincount(assign, minlength=k)
        empty = np.flatnonzero(counts == 0)
        if empty.size:
            worst = np.argsort(best)[: empty.size]
            sums[empty] = xu[worst]
        cent = _unit(sums)
    return cent


def _nearest(x: np.ndarray, cent: np.ndarray, chunk: int = 65_536) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `x`: the index of its best centroid by inner product, and that product."""
    assign = np.empty(x.shape[0], dtype=np.int32)
    best = np.empty(x.shape[0], dtype=np.float32)
    for lo in range(0, x.shape[0], chunk):
        s = x[lo : lo + chunk] @ cent.T
        a = np.argmax(s, axis=1)
        assign[lo : lo + chunk] = a
        best[lo : lo + chunk] = s[np.arange(a.shape[0]), a]
    return assign, best


class IvfIndex:
    """Inner-product IVF over catalog rows (keys = row numbers) with exact scores."""

    REPACK = 8192  # side-list size that triggers a repack into the cells
    RETRAIN_GROWTH = 4.0  # retrain the centroids when the catalog has grown this much
    TRAIN_SAMPLE = 64  # rows sampled per cell to train the centroids
    ITERS = 10

    def __init__(
        self,
        dim: int,
        *,
        lists: int = 0,
        scan: float = 20.0,
        exact_below: int = 20_000,
        seed: int = 0,
    ) -> None:
        if scan < 1:
            raise ConfigError(f"recall.ivf_scan must be >= 1, got {scan}")
        self.dim = dim
        self.lists_wanted = lists
        self.scan = scan
        self.exact_below = exact_below
        self.seed = seed
        self.vectors = np.zeros((0, dim), dtype=np.float32)
        self.n = 0
        self.active = np.zeros(0, dtype=bool)  # row → an active ad (in a cell or the side list)
        self.packed_ok = np.zeros(0, dtype=bool)  # row → its packed copy is current
        self.cell = np.zeros(0, dtype=np.int32)  # row → its cell (-1: none yet)
        self.centroids = np.zeros((0, dim), dtype=np.float32)
        self.trained_n = 0
        self.order = np.zeros(0, dtype=np.int64)  # rows, cell by cell
        self.starts = np.zeros(1, dtype=np.int64)  # cell c holds order[starts[c]:starts[c + 1]]
        self.packed = np.zeros((0, dim), dtype=np.float32)  # their vectors, in that order
        self.side: dict[int, None] = {}  # rows changed since the last repack (insertion-ordered)

    # -- keeping up with the catalog ------------------------------------------------------
    def update(self, vectors: np.ndarray, n: int) -> None:
        """Point at the catalog's current float32 matrix (it may have been reallocated)."""
        self.vectors = vectors
        self.n = n
        size = vectors.shape[0]
        if self.active.shape[0] < size:
            for name, fill in (("active", False), ("packed_ok", False), ("cell", -1)):
                old = getattr(self, name)
                grown = np.full(size, fill, dtype=old.dtype)
                grown[: old.shape[0]] = old
                setattr(self, name, grown)

    def upsert(self, row: int, active: bool) -> None:
        """Row `row` is new or changed (scanned from the side list until the next repack), or
        paused (masked out at once)."""
        if row >= self.n:
            raise ConfigError(f"row {row} is beyond the catalog's {self.n} rows: update() first")
        self.active[row] = active
        self.packed_ok[row] = False  # a changed row's packed copy may hold its old vector
        if active:
            self.side[row] = None
            if len(self.side) >= self.REPACK:
                self.repack()
        else:
            self.side.pop(row, None)

    def upsert_many(self, rows: np.ndarray, active: np.ndarray) -> None:
        """`upsert` for many rows at once, then one repack (start-up: the catalog's bulk load)."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.shape[0] and int(rows.max()) >= self.n:
            raise ConfigError(f"row {int(rows.max())} is beyond the catalog's {self.n} rows: update() first")
        act = np.asarray(active, dtype=bool)
        self.active[rows] = act
        self.packed_ok[rows] = False
        for r in rows[~act].tolist():
            self.side.pop(r, None)
        self.side.update(dict.fromkeys(rows[act].tolist()))
        self.repack()

    def flush(self) -> None:
        """Nothing waits: changes are visible to the next search (kept for the protocol's users)."""

    def __len__(self) -> int:
        return int(np.count_nonzero(self.active[: self.n]))

    def repack(self) -> None:
        """Put the changed rows into their nearest cells (training the centroids first when there
        are none yet or the catalog has outgrown them: then every row is placed again) and
        rebuild the packed copy of every active row, cell by cell."""
        rows = np.flatnonzero(self.active[: self.n])
        changed = np.fromiter(self.side, dtype=np.int64, count=len(self.side))
        self.side = {}
        if rows.shape[0] < max(1, self.exact_below):
            self.packed_ok[:] = False
            self.side = dict.fromkeys(rows.tolist())
            return
        if self.centroids.shape[0] == 0 or rows.shape[0] > self.RETRAIN_GROWTH * self.trained_n:
            self._train(rows)
            changed = rows
        if changed.shape[0]:
            self.cell[changed], _ = _nearest(
                _unit(np.asarray(self.vectors[changed], dtype=np.float32)), self.centroids
            )
        cells = self.cell[rows]
        by_cell = np.argsort(cells, kind="stable")
        self.order = rows[by_cell]
        self.packed = np.ascontiguousarray(self.vectors[self.order], dtype=np.float32)
        counts = np.bincount(cells, minlength=self.centroids.shape[0])
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.packed_ok[:] = False
        self.packed_ok[rows] = True

    def _train(self, rows: np.ndarray) -> None:
        k = self.lists_wanted or int(max(16, round(2 * np.sqrt(rows.shape[0]))))
        k = min(k, rows.shape[0])
        rng = np.random.default_rng([self.seed, rows.shape[0]])
        sample = rows[
            rng.choice(rows.shape[0], size=min(rows.shape[0], k * self.TRAIN_SAMPLE), replace=False)
        ]
        self.centroids = spherical_kmeans(self.vectors[np.sort(sample)], k, self.ITERS, self.seed)
        self.trained_n = rows.shape[0]

    # -- search -----------------------------------------------------------------------------
    def search(self, query: np.ndarray, k: int, allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The best `k` allowed rows by inner product, best first, with their exact scores."""
        q = np.asarray(query, dtype=np.float32)
        n = self.n
        live = self.active[:n] if allowed is None else self.active[:n] & allowed[:n]
        if n < self.exact_below or self.centroids.shape[0] == 0:
            return exact_search(self.vectors[:n], q, k, live)
        visible = int(np.count_nonzero(live))
        if visible <= 0 or k <= 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        want = min(visible, int(np.ceil(k * self.scan)))
        by_score = np.argsort(-(self.centroids @ q))
        side = np.fromiter(self.side, dtype=np.int64, count=len(self.side))
        rows_parts = [side]
        score_parts = [self.vectors[side] @ q]
        got = int(np.count_nonzero(live[side])) if side.size else 0
        for c in by_score.tolist():  # best cells first, until enough visible ads were seen
            if got >= want:
                break
            lo, hi = int(self.starts[c]), int(self.starts[c + 1])
            if hi > lo:
                r = self.order[lo:hi]
                rows_parts.append(r)
                score_parts.append(self.packed[lo:hi] @ q)
                got += int(np.count_nonzero(live[r] & self.packed_ok[r]))
        rows = np.concatenate(rows_parts)
        scores = np.concatenate(score_parts)
        keep = live[rows]
        if side.size:
            keep[side.shape[0] :] &= self.packed_ok[rows[side.shape[0] :]]
        rows, scores = rows[keep], scores[keep]
        k = min(k, rows.shape[0])
        if k <= 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        top = np.argpartition(-scores, k - 1)[:k] if k < rows.shape[0] else np.arange(rows.shape[0])
        top = top[np.argsort(-scores[top], kind="stable")]
        return rows[top], scores[top]
