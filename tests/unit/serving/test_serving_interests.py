"""Cold start from declared interests: the pseudo-click prior, its fading, and the serving path."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pytest
import torch

from schemas.api import AdRequest
from schemas.events import AdCreative
from schemas.settings import Settings
from schemas.vectors import content_vector
from serving.catalog import Catalog
from serving.interests import CategoryCentroids, CentroidTable, interest_prior
from serving.pipeline import AdPipeline, RequestContext, UserView, content_vectorizer
from serving.ranking import RankModel
from trainers.models.ranker import Ranker, RankerConfig

DIM = 16
TS = datetime(2026, 1, 1, 12, tzinfo=UTC)
CATS = ("shoes", "tech", "food", "travel")


def ad(i: int, cat: str) -> AdCreative:
    return AdCreative(
        event_id=f"e{i}",
        ts=TS,
        ad_id=f"a{i}",
        campaign_id=f"c{i % 5}",
        advertiser_id=f"v{i % 7}",
        category=cat,
        title=f"{cat} item {i}",
        bid=1.0,
        daily_budget=1e6,
        active=True,
    )


def centroids() -> CategoryCentroids:
    table = CentroidTable(DIM)
    for i in range(12):
        a = ad(i, CATS[i % 4])
        table.put(i, a.category, np.asarray(content_vector(a.category, a.title, DIM)))
    return table.centroids()


def test_centroid_is_the_mean_content_vector_of_the_category() -> None:
    cents = centroids()
    shoes = [content_vector("shoes", f"shoes item {i}", DIM) for i in (0, 4, 8)]
    assert np.allclose(cents.vector("shoes"), np.mean(shoes, axis=0), atol=1e-6)
    assert cents.vector("garden") is None


def test_an_ad_that_changes_category_or_gives_up_its_row_leaves_its_old_centroid() -> None:
    table = CentroidTable(2)
    table.put(0, "a", np.array([1.0, 0.0]))
    table.put(1, "a", np.array([0.0, 1.0]))
    table.put(2, "b", np.array([1.0, 1.0]))
    table.put(1, "b", np.array([3.0, 3.0]))  # row 1: now another ad, in another category
    table.put(2, "c", np.array([0.0, 2.0]))
    got = table.centroids()
    assert sorted(got.index) == ["a", "b", "c"]
    assert got.vector("a").tolist() == [1.0, 0.0] and got.vector("b").tolist() == [3.0, 3.0]  # type: ignore[union-attr]


def test_a_new_user_gets_one_pseudo_click_per_known_interest() -> None:
    cents = centroids()
    got = interest_prior(["tech", "garden", "food"], cents, weight=1.0, evidence=0.0)
    assert got.unknown == 1 and got.used == 2
    assert got.intents == {"tech": 1.0, "food": 1.0}
    expect = cents.vector("tech") + cents.vector("food")  # type: ignore[operator]
    assert got.vector.dtype == np.float32 and np.allclose(got.vector, expect, atol=1e-6)
    double = interest_prior(["tech", "food"], cents, weight=2.0, evidence=0.0)
    assert np.allclose(double.vector, 2 * expect, atol=1e-6) and double.intents["tech"] == 2.0


def test_the_prior_fades_as_the_users_own_evidence_reaches_it() -> None:
    cents = centroids()
    half = interest_prior(["tech"], cents, weight=2.0, evidence=1.0)
    assert half.intents == {"tech": 1.0} and half.faded == 0
    gone = interest_prior(["tech"], cents, weight=2.0, evidence=2.5)
    assert gone.intents == {} and not gone.vector.any() and gone.faded == 1 and gone.used == 0


@pytest.mark.parametrize("interests", [[], ["garden"]])
def test_no_known_interest_is_no_prior(interests: list[str]) -> None:
    got = interest_prior(interests, centroids(), weight=1.0, evidence=0.0)
    assert got.used == 0 and got.intents == {} and not got.vector.any()


def pipeline(weight: float = 1.0) -> AdPipeline:
    s = Settings(state_dim=DIM, recall={"k": 10}, serving={"adapter_capacity": 4, "interest_weight": weight})
    torch.manual_seed(0)
    cfg = RankerConfig(state_dim=DIM, emb_dim=4, deep_hidden=16)
    pipe = AdPipeline(
        s,
        RankModel(Ranker(cfg).eval(), "v0", s, torch.device("cpu")),
        Catalog(DIM, cfg, content_vectorizer(DIM)),
    )
    for i in range(40):
        pipe.add_ad(ad(i, CATS[i % 4]))
    return pipe


def ranking(pipe: AdPipeline, req: AdRequest, user: UserView | None) -> list[str]:
    rec = pipe.recall(req, user, capped=[], hour=9)
    assert rec.rank_input is not None
    ctx = RequestContext(req, "r1", TS, rows=rec.rows, pctr=pipe.rank.score([rec.rank_input], False)[0])
    resp = pipe.respond(ctx, pipe.finish(ctx))
    return [a.ad_id for a in resp.ads]


def test_a_new_user_with_interests_is_ranked_differently_and_towards_them() -> None:
    pipe = pipeline()
    plain = AdRequest(user_id="new", slot="feed", k=5)
    declared = AdRequest(user_id="new", slot="feed", k=5, interests=["travel"])
    without, with_ = ranking(pipe, plain, None), ranking(pipe, declared, None)
    assert with_ != without
    rec = pipe.recall(declared, None, capped=[], hour=9)
    cats = {pipe.catalog.rows[int(r)].category for r in rec.rows}
    assert cats == {"travel"}  # 10 recalled of 40: the prior's state vector points at travel
    assert pipe.interest_counts["used"] == 2  # two requests declared it


def test_without_interests_or_with_unknown_ones_serving_is_unchanged() -> None:
    pipe = pipeline()
    plain = AdRequest(user_id="new", slot="feed", k=5)
    unknown = AdRequest(user_id="new", slot="feed", k=5, interests=["garden"])
    assert ranking(pipe, unknown, None) == ranking(pipe, plain, None)
    assert pipe.interest_counts["unknown"] == 1
    off = pipeline(weight=0.0)
    declared = AdRequest(user_id="new", slot="feed", k=5, interests=["travel"])
    assert ranking(off, declared, None) == ranking(off, plain, None)


def test_a_warm_user_keeps_their_own_state() -> None:
    pipe = pipeline()
    vec = np.asarray(content_vector("shoes", "shoes item 0", DIM), dtype=np.float32) * 3
    warm = UserView(vec, {"shoes": 3.0})
    plain = AdRequest(user_id="w", slot="feed", k=5)
    declared = AdRequest(user_id="w", slot="feed", k=5, interests=["travel"])
    assert ranking(pipe, declared, warm) == ranking(pipe, plain, warm)
    assert pipe.interest_counts["faded"] == 1


def test_centroids_stay_in_the_user_state_space_whatever_the_catalog_vectors() -> None:
    pipe = pipeline()
    rng = np.random.default_rng(0)
    pipe.add_ad(ad(40, "garden"), rng.normal(size=DIM).astype(np.float32))  # e.g. an ad-tower vector
    pipe.add_ad(ad(41, "garden"))
    expect = np.mean([content_vector("garden", f"garden item {i}", DIM) for i in (40, 41)], axis=0)
    assert np.allclose(pipe.centroids().vector("garden"), expect, atol=1e-6)  # type: ignore[arg-type]
