"""What serving says of each served ad (`schemas.billing`): its campaign's bid type and its slot's
rendering go into the signed impression; serving itself bills nothing (the worker does, on views
and clicks), so what it serves never moves the spend that pacing reads."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import torch

from schemas.api import AdRequest
from schemas.events import AdCreative, Campaign
from schemas.settings import Settings
from schemas.signing import check_event, event_key
from serving.catalog import Catalog
from serving.pipeline import AdPipeline, RequestContext, content_vectorizer
from serving.ranking import RankModel
from trainers.models.ranker import Ranker, RankerConfig

TS = datetime(2026, 1, 1, 12, tzinfo=UTC)
CFG = RankerConfig(state_dim=16, emb_dim=4, deep_hidden=16)


# c1 pays per thousand shown (CPM): a1 and a3 bid 1000 per thousand (1.0 per impression, above any
# CPC ad's pCTR × 1.0 per click), its other ads next to nothing
BIDS = {1: 1000.0, 3: 1000.0, 5: 0.001, 7: 0.001, 9: 0.001, 11: 0.001}


def _pipeline(**serving: object) -> AdPipeline:
    torch.manual_seed(0)
    s = Settings(state_dim=16, recall={"k": 30}, serving={"adapter_capacity": 8, **serving})
    pipe = AdPipeline(
        s,
        RankModel(Ranker(CFG).eval(), "v0", s, torch.device("cpu")),
        Catalog(16, CFG, content_vectorizer(16)),
    )
    for i in range(12):
        pipe.add_ad(AdCreative(event_id=f"e{i}", ts=TS, ad_id=f"a{i}", campaign_id=f"c{i % 2}",
                               advertiser_id=f"v{i}", category="shoes", title=f"shoes {i}",
                               bid=BIDS.get(i, 1.0), daily_budget=100.0, active=True))  # fmt: skip
    pipe.catalog.upsert_campaign(
        Campaign(event_id="k1", ts=TS, campaign_id="c1", advertiser_id="v", daily_budget=50.0, bid_type="cpm")
    )
    return pipe


def _serve(pipe: AdPipeline, slot: str) -> list:  # type: ignore[type-arg]
    req = AdRequest(user_id="u", slot=slot, k=6)  # type: ignore[arg-type]
    rec = pipe.recall(req, None, capped=[], hour=12)
    pctr = pipe.rank.score([rec.rank_input], use_adapters=False)[0]
    ctx = RequestContext(req, "req1", TS, rung="base_model", rows=rec.rows, pctr=pctr, stage_ms={})
    served = pipe.finish(ctx)
    pipe.catalog.record_served(served.rows)
    return served.impressions


def test_impressions_carry_the_campaigns_bid_type_and_the_slots_rendering_signed() -> None:
    pipe = _pipeline(shown_on_serve=["splash"])
    for slot, render in (("feed", "client"), ("splash", "server")):
        imps = _serve(pipe, slot)
        assert {i.campaign_id for i in imps} == {"c0", "c1"}
        assert all(i.bid_type == ("cpm" if i.campaign_id == "c1" else "cpc") for i in imps)
        assert all(i.render == render for i in imps)
        assert all(check_event(i, event_key(pipe.settings)) is None for i in imps)


def test_serving_moves_no_spend() -> None:
    pipe = _pipeline()
    _serve(pipe, "feed")
    assert pipe.catalog.impressions.sum() == 6 and not pipe.catalog.campaigns.spend.any()
    pipe.catalog.set_spend({"c1": 7.5})  # the billed spend, from Redis
    assert pipe.catalog.spend_of(np.asarray([pipe.catalog.row_of["a1"]])).tolist() == [7.5]


def test_the_auction_ranks_cpm_bids_per_thousand_and_prices_them_so() -> None:
    """The CPM ads worth 1.0 per impression (bid 1000 per thousand) lead whatever their pCTR;
    a CPM price is per thousand (hundreds here, not a per-click price), and what serving expects a
    shown CPM impression to cost is price / 1000 (a CPC one pCTR × price)."""
    pipe = _pipeline()
    req = AdRequest(user_id="u", slot="feed", k=6)
    rec = pipe.recall(req, None, capped=[], hour=12)
    pctr = pipe.rank.score([rec.rank_input], use_adapters=False)[0]
    served = pipe.finish(
        RequestContext(req, "req1", TS, rung="base_model", rows=rec.rows, pctr=pctr, stage_ms={})
    )
    imps = served.impressions
    assert {i.ad_id for i in imps[:2]} == {"a1", "a3"} and [i.bid_type for i in imps[:2]] == ["cpm", "cpm"]
    assert all(i.bid_type == "cpc" for i in imps[2:])
    # per thousand: far above any per-click price, at most the bid
    assert all(10.0 < i.price <= 1000.0 for i in imps[:2])
    want = [i.price / 1000 if i.bid_type == "cpm" else (i.pctr or 0.0) * i.price for i in imps]
    assert np.allclose(served.spend, want)
    assert all(i.price <= 1.0 for i in imps[2:])  # per click, at most the CPC bid


def test_the_popular_prior_compares_bids_per_impression() -> None:
    """The no-model rung's popular list weighs a CPM bid per thousand (/ 1000) against a CPC bid
    at the rung's pCTR (0.02): CPM 30 (0.03 per impression) above CPC 1.0 (0.02), CPM 10 (0.01)
    below it; read as per-click bids, both CPM ads would have led."""
    cat = Catalog(16, CFG, content_vectorizer(16))
    for ad, campaign, bid in (("cpc", "k_cpc", 1.0), ("cpm30", "k_cpm", 30.0), ("cpm10", "k_cpm", 10.0)):
        cat.upsert(
            AdCreative(event_id=ad, ts=TS, ad_id=ad, campaign_id=campaign, advertiser_id="v",
                       category="shoes", title=ad, bid=bid, daily_budget=100.0, active=True)
        )  # fmt: skip
    cat.upsert_campaign(
        Campaign(
            event_id="kc", ts=TS, campaign_id="k_cpm", advertiser_id="v", daily_budget=50.0, bid_type="cpm"
        )
    )
    assert [cat.rows[int(r)].ad_id for r in cat.popular(3)] == ["cpm30", "cpc", "cpm10"]
