"""Recall in the two-tower space: ad index vectors, new ads through the ad tower, user-tower queries."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from schemas.api import AdRequest
from schemas.events import AdCreative
from schemas.settings import Settings
from serving.catalog import Catalog
from serving.pipeline import AdPipeline, UserView
from serving.ranking import RankModel
from serving.towers import TowerSpace
from trainers.models.ranker import Ranker, RankerConfig
from trainers.models.two_tower import TwoTower, TwoTowerConfig, ad_ids, save_ad_index, save_two_tower

TS = datetime(2026, 1, 1, tzinfo=UTC)
CFG = TwoTowerConfig(state_dim=16, out_dim=8, hidden=16, emb_dim=4, ad_buckets=256)


def ad(i: int, cat: str) -> AdCreative:
    return AdCreative(
        event_id=f"e{i}",
        ts=TS,
        ad_id=f"a{i}",
        campaign_id=f"c{i}",
        advertiser_id=f"v{i % 4}",
        category=cat,
        title=f"{cat} thing {i}",
        bid=1.0,
        daily_budget=100.0,
        active=True,
    )


def _space(tmp_path: Path) -> tuple[TowerSpace, list[AdCreative]]:
    torch.manual_seed(0)
    model = TwoTower(CFG).eval()
    ads = [ad(i, ["shoes", "tech"][i % 2]) for i in range(20)]
    text = torch.randn(len(ads), CFG.text_dim)
    with torch.no_grad():
        vecs = model.ad_vectors(
            ad_ids([a.category for a in ads], [a.advertiser_id for a in ads], [a.ad_id for a in ads], CFG),
            text,
        ).numpy()
    version = save_two_tower(model, tmp_path / "two_tower")
    save_ad_index([a.ad_id for a in ads], vecs, tmp_path / "two_tower", version)
    space = TowerSpace.load(tmp_path)
    assert space is not None and space.version == version
    return space, ads


def test_no_two_tower_means_content_space(tmp_path: Path) -> None:
    assert TowerSpace.load(tmp_path) is None


def test_known_ads_use_the_index_and_new_ads_the_ad_tower(tmp_path: Path) -> None:
    space, ads = _space(tmp_path)
    assert space.knows(ads[0]) and np.array_equal(space.ad_vector(ads[0]), space.index["a0"])
    fresh = ad(99, "garden")
    assert not space.knows(fresh)
    v = space.ad_vector(fresh)  # MiniLM title embedding → ad tower
    assert v.shape == (8,) and abs(float(np.linalg.norm(v)) - 1.0) < 1e-5 and space.knows(fresh)
    again = space.ad_vectors([fresh, ads[1]])
    assert np.array_equal(again[0], v) and np.array_equal(again[1], space.index["a1"])


def test_pipeline_recalls_by_user_tower_query(tmp_path: Path) -> None:
    space, ads = _space(tmp_path)
    s = Settings(state_dim=16, recall={"k": 5}, serving={"adapter_capacity": 4})
    rcfg = RankerConfig(state_dim=16, emb_dim=4, deep_hidden=16)
    pipe = AdPipeline(
        s,
        RankModel(Ranker(rcfg).eval(), "v0", s, torch.device("cpu")),
        Catalog(space.dim, rcfg, space.ad_vector),
        space,
    )
    for a, vec in zip(ads, space.ad_vectors(ads), strict=True):
        pipe.add_ad(a, vec)
    user = UserView(np.linspace(-1, 1, 16).astype(np.float32), {})
    req = AdRequest(user_id="u", slot="search", k=3)
    rec = pipe.recall(req, user, capped=[], hour=9)
    q = space.query(user.vector, "search", 9)
    expect = np.argsort(-(pipe.catalog.vectors[: pipe.catalog.n] @ q))[:5]
    assert rec.rows.tolist() == expect.tolist()
    assert np.allclose(rec.scores, pipe.catalog.vectors[rec.rows] @ q, atol=1e-6)
    cold = pipe.recall(AdRequest(user_id="c", slot="feed", k=3), None, capped=[], hour=9)
    assert len(cold.rows) == 5
