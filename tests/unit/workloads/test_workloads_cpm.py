"""CPM campaigns in the simulated market (issue 34 item 6, `MarketConfig.cpm_share`): a share of
the campaigns pays per thousand shown impressions, their creatives bid per mille what their
per-click bid is worth at their click rate; at share 0 (the default) the market is the one of
before, byte for byte, so earlier runs' figures stay comparable."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.errors import ConfigError
from schemas.events import AdCreative, Impression
from workloads import Market, MarketConfig

CFG = {"seed": 5, "n_users": 200, "n_ads": 120, "n_advertisers": 12}


def test_by_default_every_campaign_pays_per_click_and_the_market_is_unchanged() -> None:
    market = Market(MarketConfig(**CFG))
    assert {c.bid_type for c in market.campaigns()} == {"cpc"}
    events = list(market.open_loop(400))
    assert all(e.bid_type is None for e in events if isinstance(e, Impression))  # as before billing
    bids = {e.ad_id: e.bid for e in events if isinstance(e, AdCreative)}
    ads = market.world.ads  # the initial ads and those that arrive mid-stream
    assert len(bids) > CFG["n_ads"] and bids == {ads.ad_ids[i]: float(ads.bid[i]) for i in range(len(bids))}


def test_a_share_of_campaigns_pays_per_mille_and_bids_per_mille() -> None:
    market = Market(MarketConfig(**CFG, cpm_share=0.4))
    kinds = {c.campaign_id: c.bid_type for c in market.campaigns(include_new=True)}
    share = sum(k == "cpm" for k in kinds.values()) / len(kinds)
    assert 0.2 < share < 0.6
    cpc_market = Market(MarketConfig(**CFG))
    for ad in market.catalog():
        i = int(ad.ad_id[2:])
        per_click = float(market.world.ads.bid[i])
        if kinds[ad.campaign_id] == "cpc":
            assert ad.bid == per_click == cpc_market.creative(i).bid
        else:  # worth per thousand impressions what a click is worth at a click rate of 0.1 % … 20 %
            assert per_click < ad.bid and 1.0 * per_click < ad.bid < 200.0 * per_click
            assert market.bid_type(i) == "cpm"


def test_the_open_loop_says_how_each_impression_pays_and_draws_the_same_traffic() -> None:
    a, b = Market(MarketConfig(**CFG)), Market(MarketConfig(**CFG, cpm_share=0.4))
    ea, eb = list(a.open_loop(400)), list(b.open_loop(400))
    ia = [e for e in ea if isinstance(e, Impression)]
    ib = [e for e in eb if isinstance(e, Impression)]
    # the same requests, ads and clicks: only the bid unit and the bid type differ
    assert [(i.user_id, i.ad_id, i.slot, i.position) for i in ia] == [
        (i.user_id, i.ad_id, i.slot, i.position) for i in ib
    ]
    assert [e.kind for e in ea] == [e.kind for e in eb]
    kinds = {c.campaign_id: c.bid_type for c in b.campaigns(include_new=True)}
    assert {i.bid_type for i in ib} == {"cpm", "cpc"}
    assert all(i.bid_type == kinds[i.campaign_id] for i in ib)
    bids = {e.ad_id: e.bid for e in eb if isinstance(e, AdCreative)}
    assert all(i.price == round(bids[i.ad_id] * 0.8, 4) for i in ib)  # in its campaign's unit


def test_a_bad_cpm_share_is_refused() -> None:
    with pytest.raises(ConfigError, match="cpm_share"):
        MarketConfig(cpm_share=1.5)


def test_the_demo_writes_cpm_campaigns_when_asked(tmp_path: Path) -> None:
    from deploy.demo import DemoSpec, campaigns_file, write_history
    from serving.loops import read_catalog_entries

    spec = DemoSpec(users=50, ads=40, history=200, cpm_share=0.5)
    write_history(spec, tmp_path / "h.jsonl", tmp_path / "catalog.jsonl")
    _, campaigns = read_catalog_entries(campaigns_file(tmp_path / "catalog.jsonl"))
    assert {c.bid_type for c in campaigns} == {"cpm", "cpc"}
    assert DemoSpec().cpm_share == 0.0  # the benchmarks built on the demo keep their markets
