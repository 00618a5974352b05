"""The simulator's audience (issue 34, `workloads.audience`): users' countries and devices,
search requests' query text, campaigns with targeting; drawn apart from the traffic, so the
requests and clicks of a config are those it gave before."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from schemas.errors import ConfigError
from schemas.events import Campaign
from workloads import Market, MarketConfig


def test_each_user_has_one_country_and_device_drawn_by_share() -> None:
    market = Market(MarketConfig(seed=1, n_users=4000, n_ads=20))
    cfg, aud = market.config, market.audience
    geos = Counter(aud.of(u)[0] for u in range(cfg.n_users))
    devices = Counter(aud.of(u)[1] for u in range(cfg.n_users))
    for counts, shares in ((geos, cfg.geo_share), (devices, cfg.device_share)):
        for name, share in shares.items():
            assert counts[name] / cfg.n_users == pytest.approx(share, abs=0.03), name
    reqs = [market.next_request() for _ in range(300)]
    assert all((r.geo, r.device) == aud.of(r.user) for r in reqs)


def test_search_requests_ask_for_a_category_the_user_declared() -> None:
    market = Market(MarketConfig(seed=2, n_users=200, n_ads=50))
    reqs = [market.next_request() for _ in range(400)]
    search = [r for r in reqs if r.slot == "search"]
    assert search and all(r.query for r in search) and not any(r.query for r in reqs if r.slot != "search")
    for r in search:
        category, word = r.query.split()  # type: ignore[union-attr]
        assert category in r.interests
        assert word in market.world.vocabularies[market.world.categories.index(category)]
    # the query names words that ads of that category carry in their titles
    titles = {c.category: set() for c in market.catalog()}
    for c in market.catalog():
        titles[c.category].update(c.title.lower().split())
    assert any(r.query.split()[1] in titles[r.query.split()[0]] for r in search)  # type: ignore[union-attr]


def test_the_audience_leaves_the_traffic_and_clicks_as_they_were() -> None:
    """A share of targeted campaigns or other countries changes no request, impression or click."""
    a = Market(MarketConfig(seed=4, n_users=100, n_ads=30))
    b = Market(MarketConfig(seed=4, n_users=100, n_ads=30, targeted_share=1.0, geo_share={"NZ": 1.0}))
    ea, eb = list(a.open_loop(300)), list(b.open_loop(300))
    assert ea == eb
    assert {b.audience.of(u)[0] for u in range(100)} == {"NZ"}


def test_campaigns_cover_the_catalog_and_some_target() -> None:
    market = Market(MarketConfig(seed=3, n_users=50, n_ads=300, n_advertisers=40))
    entries = market.campaigns()
    assert all(isinstance(c, Campaign) for c in entries) and entries == market.campaigns()
    ads = market.catalog()
    assert {c.campaign_id for c in entries} == {a.campaign_id for a in ads}
    last = {a.campaign_id: a.daily_budget for a in ads}  # serving took the last creative's budget
    assert all(c.daily_budget == last[c.campaign_id] for c in entries)
    assert all(c.campaign_id.replace("cmp", "adv").startswith(c.advertiser_id) for c in entries)
    targeted = [c for c in entries if c.targeting.geo or c.targeting.devices]
    assert 0.1 < len(targeted) / len(entries) < 0.3  # targeted_share 0.2
    cfg = market.config
    assert all(set(c.targeting.geo) <= set(cfg.geo_share) for c in targeted)
    assert all(set(c.targeting.devices) <= set(cfg.device_share) for c in targeted)
    assert {c.campaign_id for c in market.campaigns(include_new=True)} >= {c.campaign_id for c in entries}


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"geo_share": {"france": 1.0}}, "geo_share"),
        ({"geo_share": {"FR": -1.0, "DE": 2.0}}, "geo_share"),
        ({"device_share": {"phone": 1.0}}, "device_share"),
        ({"device_share": {"mobile": 0.0}}, "device_share"),
        ({"targeted_share": 1.5}, "targeted_share"),
    ],
)
def test_bad_audience_settings_are_refused(kw: dict[str, object], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        MarketConfig(**kw)  # type: ignore[arg-type]


def test_the_demo_writes_the_markets_campaigns_beside_its_catalog(tmp_path: Path) -> None:
    """What the demo and the freshness / soak benchmarks produce to `ad.campaigns`: an entry for
    every campaign of the catalog, which a replica's catalog-file reader takes."""
    from deploy.demo import DemoSpec, campaigns_file, write_history
    from serving.loops import read_catalog_entries

    write_history(DemoSpec(users=50, ads=40, history=300), tmp_path / "h.jsonl", tmp_path / "catalog.jsonl")
    ads, _ = read_catalog_entries(tmp_path / "catalog.jsonl")
    none, campaigns = read_catalog_entries(campaigns_file(tmp_path / "catalog.jsonl"))
    assert not none and {a.campaign_id for a in ads} <= {c.campaign_id for c in campaigns}
    assert any(c.targeting.geo or c.targeting.devices for c in campaigns)
