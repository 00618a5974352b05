"""serving.ann and serving.ivf: the approximate recall backends (usearch HNSW, inverted file) —
ads entering, changing and leaving without a rebuild, `allowed` masks, exact scores, recall
against exact search, selection by settings. The behaviour tests run on both backends."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.errors import ConfigError
from schemas.settings import Settings
from serving.ann import UsearchIndex
from serving.index import ExactIndex, exact_search
from serving.ivf import IvfIndex
from serving.recall_index import make_index

DIM = 16


def unit(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    return out


def built(vectors: np.ndarray, dtype: str = "i8", **kw: object) -> UsearchIndex | IvfIndex:
    """A bulk-built index; dtype "ivf" means the inverted file (its cells hold float32)."""
    index: UsearchIndex | IvfIndex
    if dtype == "ivf":
        index = IvfIndex(vectors.shape[1], exact_below=0, **kw)  # type: ignore[arg-type]
    else:
        index = UsearchIndex(vectors.shape[1], dtype=dtype, exact_below=0, **kw)  # type: ignore[arg-type]
    index.update(vectors, vectors.shape[0])
    index.upsert_many(np.arange(vectors.shape[0]), np.ones(vectors.shape[0], dtype=bool))
    return index


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    centroids = unit(rng.normal(size=(40, DIM)))
    ads = unit(centroids[rng.integers(0, 40, 6000)] + 0.4 * rng.normal(size=(6000, DIM)) / 4)
    queries = unit(centroids[rng.integers(0, 40, 30)] + 0.5 * rng.normal(size=(30, DIM)) / 4)
    return ads, queries


@pytest.mark.parametrize("dtype", ["i8", "f32", "ivf"])
def test_recall_against_exact_and_exact_scores(data: tuple[np.ndarray, np.ndarray], dtype: str) -> None:
    ads, queries = data
    index = built(ads, dtype)
    recalls = []
    for q in queries:
        rows, scores = index.search(q, 100, None)
        truth, _ = exact_search(ads, q, 100, None)
        recalls.append(len(set(rows.tolist()) & set(truth.tolist())) / 100)
        assert rows.shape == (100,) and len(set(rows.tolist())) == 100
        np.testing.assert_allclose(scores, ads[rows] @ q, rtol=1e-6)  # re-scored exactly, float32
        assert np.all(np.diff(scores) <= 0)
    assert np.mean(recalls) >= 0.95, recalls


@pytest.mark.parametrize("backend", ["i8", "ivf"])
def test_paused_ads_leave_and_new_ads_enter_without_rebuild(
    data: tuple[np.ndarray, np.ndarray], backend: str
) -> None:
    ads, queries = data
    n = ads.shape[0]
    matrix = np.zeros((n + 10, DIM), dtype=np.float32)
    matrix[:n] = ads
    index = built(matrix[:n], backend)
    index.update(matrix, n)
    q = queries[0]
    best = int(index.search(q, 1, None)[0][0])
    index.upsert(best, False)  # paused
    assert best not in index.search(q, 200, None)[0].tolist()
    assert len(index) == n - 1
    matrix[n] = q  # a new ad exactly where the user is
    index.update(matrix, n + 1)
    index.upsert(n, True)
    rows, scores = index.search(q, 5, None)
    assert int(rows[0]) == n and scores[0] == pytest.approx(float(q @ q))
    index.upsert(best, True)  # resumed
    assert best in index.search(q, 5, None)[0].tolist()
    matrix[n] = -q  # the new ad's vector changed: it moves in the graph
    index.upsert(n, True)
    assert n not in index.search(q, 200, None)[0].tolist()
    assert int(index.search(-q, 1, None)[0][0]) == n
    assert len(index) == n + 1


@pytest.mark.parametrize("backend", ["i8", "ivf"])
def test_allowed_mask_is_respected_even_when_it_hides_the_best(
    data: tuple[np.ndarray, np.ndarray], backend: str
) -> None:
    ads, queries = data
    index = built(ads, backend)
    q = queries[1]
    allowed = np.ones(ads.shape[0], dtype=bool)
    truth, _ = exact_search(ads, q, 300, None)
    allowed[truth] = False  # the 300 nearest ads have spent their budget
    rows, _ = index.search(q, 100, allowed)
    assert rows.shape == (100,) and allowed[rows].all()
    expected, _ = exact_search(ads, q, 100, allowed)
    assert len(set(rows.tolist()) & set(expected.tolist())) >= 90
    few = np.zeros(ads.shape[0], dtype=bool)
    few[[3, 5, 8]] = True  # almost everything hidden: exact over what is left
    assert sorted(index.search(q, 100, few)[0].tolist()) == [3, 5, 8]
    assert index.search(q, 10, np.zeros(ads.shape[0], dtype=bool))[0].shape == (0,)


def test_i8_keeps_exact_scores_for_vectors_longer_than_one() -> None:
    rng = np.random.default_rng(3)
    ads = rng.normal(size=(3000, DIM)).astype(np.float32) * 3  # not unit: i8 stores them normalised
    index = built(ads)
    q = rng.normal(size=DIM).astype(np.float32) * 5
    rows, scores = index.search(q, 20, None)
    np.testing.assert_allclose(scores, ads[rows] @ q, rtol=1e-5)
    assert int(rows[0]) == int(np.argmax(ads @ q)) or scores[0] >= np.sort(ads @ q)[-2]


def test_small_catalogs_stay_exact_and_bulk_upserts_are_batched(data: tuple[np.ndarray, np.ndarray]) -> None:
    ads, queries = data
    index = UsearchIndex(DIM, exact_below=10_000)
    index.update(ads, ads.shape[0])
    for row in range(ads.shape[0]):  # a catalog loaded ad by ad
        index.upsert(row, True)
    assert len(index.pending) == ads.shape[0] % UsearchIndex.BATCH  # the rest went in bulk
    rows, scores = index.search(queries[2], 50, None)
    truth, truth_scores = exact_search(ads, queries[2], 50, None)
    assert rows.tolist() == truth.tolist() and np.allclose(scores, truth_scores)
    assert len(index) == ads.shape[0] and not index.pending


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ConfigError, match=r"recall\.ann_oversample"):
        UsearchIndex(DIM, oversample=0.5)
    index = UsearchIndex(DIM)
    index.update(np.zeros((4, DIM), dtype=np.float32), 2)
    with pytest.raises(ConfigError, match="row 3 is beyond"):
        index.upsert_many(np.asarray([3]), np.asarray([True]))


def test_make_index_follows_the_settings() -> None:
    vecs = np.zeros((8, DIM), dtype=np.float32)
    assert isinstance(make_index(Settings(), vecs, 0), ExactIndex)
    ann = make_index(
        Settings(recall={"index": "usearch", "ann_dtype": "f32", "ann_connectivity": 8, "ann_min_ads": 5}),
        vecs,
        0,
    )
    assert isinstance(ann, UsearchIndex)
    assert (ann.dtype, ann.exact_below, ann.graph.connectivity) == ("f32", 5, 8)
    ivf = make_index(
        Settings(recall={"index": "ivf", "ivf_lists": 4, "ivf_scan": 3, "ann_min_ads": 5}), vecs, 0
    )
    assert isinstance(ivf, IvfIndex)
    assert (ivf.lists_wanted, ivf.scan, ivf.exact_below) == (4, 3.0, 5)


def test_ivf_repacks_side_rows_into_cells_and_retrains_when_outgrown(
    data: tuple[np.ndarray, np.ndarray],
) -> None:
    """Changes wait in the side list until REPACK of them, then go into their cells without
    moving the others; the centroids are trained again only once the catalog has outgrown them."""
    ads, queries = data
    n = ads.shape[0]
    matrix = np.zeros((4 * n + 10, DIM), dtype=np.float32)
    matrix[:n] = ads
    index = built(matrix[:n], "ivf")
    index.update(matrix, n)
    cells, centroids = index.cell[:n].copy(), index.centroids.copy()
    index.REPACK = 50  # type: ignore[misc]
    rng = np.random.default_rng(5)
    moved = rng.choice(n, size=49, replace=False)
    matrix[moved] = -matrix[moved]
    for row in moved:
        index.upsert(int(row), True)
    assert len(index.side) == 49 and not index.packed_ok[moved].any()
    for q in queries[:5]:  # side rows are searched with their new vectors meanwhile
        rows, scores = index.search(q, 50, None)
        np.testing.assert_allclose(scores, matrix[rows] @ q, rtol=1e-6)
    index.upsert(int(np.setdiff1d(np.arange(n), moved)[0]), True)  # the 50th change: repack
    assert not index.side and index.packed_ok[:n].all()
    untouched = np.setdiff1d(np.arange(n), moved)
    assert (index.cell[untouched] == cells[untouched]).all()  # nothing else moved
    assert np.array_equal(index.centroids, centroids)  # nor was anything trained again
    matrix[n : 4 * n + 10] = np.concatenate([ads] * 4)[: 3 * n + 10]
    index.update(matrix, 4 * n + 10)
    index.upsert_many(np.arange(n, 4 * n + 10), np.ones(3 * n + 10, dtype=bool))
    assert index.trained_n == 4 * n + 10 and index.centroids.shape[0] > centroids.shape[0]


def test_ivf_bad_arguments_are_named() -> None:
    with pytest.raises(ConfigError, match=r"recall\.ivf_scan"):
        IvfIndex(DIM, scan=0.5)
    index = IvfIndex(DIM)
    index.update(np.zeros((4, DIM), dtype=np.float32), 2)
    with pytest.raises(ConfigError, match="row 3 is beyond"):
        index.upsert(3, True)


@pytest.mark.parametrize("backend", ["usearch", "ivf"])
def test_the_pipeline_recalls_through_the_ann_index_when_the_settings_say_so(backend: str) -> None:
    """AdPipeline with recall_index=usearch: live ads (past the catalog's first reallocation),
    paused, spent and capped ads filtered, and nearly the exact pipeline's candidates."""
    from datetime import UTC, datetime

    import torch

    from schemas.api import AdRequest
    from schemas.events import AdCreative
    from serving.catalog import Catalog
    from serving.pipeline import AdPipeline, UserView, content_vectorizer
    from serving.ranking import RankModel
    from trainers.models.ranker import Ranker, RankerConfig

    cfg = RankerConfig(state_dim=16, emb_dim=4, deep_hidden=16)
    cats = ["shoes", "tech", "food", "travel", "games"]

    def creative(i: int, active: bool = True) -> AdCreative:
        return AdCreative(
            event_id=f"e{i}",
            ts=datetime(2026, 1, 1, tzinfo=UTC),
            ad_id=f"a{i}",
            campaign_id=f"c{i % 7}",
            advertiser_id=f"v{i % 11}",
            category=cats[i % 5],
            title=f"{cats[i % 5]} {['red', 'blue', 'fast', 'new', 'big'][i % 5 - 1]} item {i}",
            bid=1.0,
            daily_budget=100.0,
            active=active,
        )

    pipes = {}
    for kind in ("exact", backend):
        torch.manual_seed(0)
        s = Settings(state_dim=16, recall={"k": 40, "index": kind, "ann_min_ads": 0, "ann_dtype": "f32"})
        pipe = AdPipeline(
            s,
            RankModel(Ranker(cfg).eval(), "v0", s, torch.device("cpu")),
            Catalog(16, cfg, content_vectorizer(16)),
        )
        for i in range(1500):  # beyond the catalog's initial 1024 rows: its matrix is reallocated
            pipe.add_ad(creative(i))
        pipe.add_ad(creative(1, active=False))  # paused
        pipe.catalog.set_spend({"c2": 1e9})  # campaign c2 spent out
        pipes[kind] = pipe
    kinds = {"usearch": UsearchIndex, "ivf": IvfIndex}
    assert isinstance(pipes[backend].index, kinds[backend]) and isinstance(pipes["exact"].index, ExactIndex)
    assert len(pipes[backend].index) == 1499  # the paused ad left the index
    req = AdRequest(user_id="u", slot="feed", k=5)
    user = UserView(np.asarray(content_vectorizer(16)(creative(6)), dtype=np.float32), {"tech": 1.0})
    got = {k: pipe.recall(req, user, capped=["a6", "a11"], hour=12) for k, pipe in pipes.items()}
    ann = got[backend]
    ids = {pipes[backend].catalog.rows[r].ad_id for r in ann.rows}
    assert len(ids) == 40 and not ids & {"a1", "a6", "a11"}
    assert all(pipes[backend].catalog.rows[r].campaign_id != "c2" for r in ann.rows)
    # usearch builds the graph on every core (`upsert_many`): its shape, and so which of the
    # near ties it misses, depends on the threads' timing (with two busy cores beside it, 1 run
    # in 10 swapped one of the exact 40 for a lower one). Hence a recall bar, as for the index
    # alone above, and no score above the exact top 40's, best first
    exact = got["exact"].scores
    assert np.sum(ann.scores >= exact[-1] - 1e-6) >= 0.95 * len(exact)
    assert np.all(ann.scores <= exact + 1e-6) and np.all(np.diff(ann.scores) <= 0)
    if backend == "ivf":  # deterministic (seeded k-means, one thread): the same scores
        np.testing.assert_allclose(ann.scores, exact, rtol=1e-5)  # ties aside, the same ads
