"""Campaigns as entities (`Campaign` on `ad.campaigns`): budget shared by the campaign's
creatives, schedule and audience targeting masking rows before recall (`serving.catalog`)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from schemas.api import AdRequest
from schemas.codec import MODEL_BY_TOPIC, TOPIC_BY_KIND, decode
from schemas.errors import SchemaError
from schemas.events import AdCreative, Campaign, Targeting
from schemas.topics import CAMPAIGNS
from serving.catalog import Audience, Catalog, CatalogFull
from trainers.models.ranker import RankerConfig

T0 = datetime(2026, 12, 1, 12, tzinfo=UTC)


def ad(i: int, campaign: str, budget: float = 100.0) -> AdCreative:
    return AdCreative(
        event_id=f"e{i}", ts=T0, ad_id=f"a{i}", campaign_id=campaign, advertiser_id="v",
        category="shoes", title=f"ad {i}", bid=1.0, daily_budget=budget, active=True,
    )  # fmt: skip


def campaign(cid: str, **kw: object) -> Campaign:
    fields: dict[str, object] = {"event_id": f"c-{cid}", "ts": T0, "campaign_id": cid,
                                 "advertiser_id": "v", "daily_budget": 50.0}  # fmt: skip
    fields.update(kw)
    return Campaign(**fields)  # type: ignore[arg-type]


def _catalog(max_ads: int = 1000) -> Catalog:
    return Catalog(4, RankerConfig(), lambda a: np.ones(4, dtype=np.float32), max_ads=max_ads)


def ids(cat: Catalog, audience: Audience | None) -> set[str]:
    return {cat.rows[r].ad_id for r in np.flatnonzero(cat.servable(audience))}


def at(now: datetime = T0, **kw: object) -> Audience:
    return Audience.of(now, kw.get("geo"), kw.get("device"), kw.get("interests"))  # type: ignore[arg-type]


def test_campaign_is_on_its_own_topic_and_kind() -> None:
    assert MODEL_BY_TOPIC[CAMPAIGNS] is Campaign
    assert TOPIC_BY_KIND["campaign"] == CAMPAIGNS


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"start": T0.isoformat(), "end": T0.isoformat()}, "end"),
        ({"start": T0.isoformat(), "end": (T0 - timedelta(hours=1)).isoformat()}, "end"),
        ({"daily_budget": 0}, "daily_budget"),
        ({"targeting": {"geo": ["us"]}}, "geo"),
        ({"targeting": {"geo": ["US", "US"]}}, "twice"),
        ({"targeting": {"devices": ["phone"]}}, "devices"),
        ({"targeting": {"segments": ["x"]}}, "segments"),
        ({"bid_type": "cpa"}, "bid_type"),
    ],
)
def test_bad_campaigns_are_refused_naming_the_field(change: dict[str, object], field: str) -> None:
    body = campaign("c1").model_dump(mode="json") | change
    with pytest.raises(SchemaError, match=field):
        decode(Campaign, json.dumps(body))


def test_campaign_budget_replaces_its_creatives_budgets() -> None:
    cat = _catalog()
    cat.upsert(ad(1, "c1", budget=100.0))
    cat.upsert(ad(2, "c1", budget=7.0))  # without an entry, the last creative's budget stands (as before)
    assert cat.budget_of(np.array([0]))[0] == 7.0
    cat.upsert_campaign(campaign("c1", daily_budget=50.0))
    cat.upsert(ad(3, "c1", budget=999.0))  # a creative no longer moves the campaign's budget
    assert set(cat.budget_of(np.arange(3))) == {50.0}
    cat.record_served(np.array([0, 1]), np.array([30.0, 25.0]))  # the campaign's ads share it
    assert ids(cat, at()) == set()


def test_campaign_entry_may_arrive_before_its_ads() -> None:
    cat = _catalog()
    cat.upsert_campaign(campaign("c1", daily_budget=5.0, targeting=Targeting(geo=("DE",))))
    cat.upsert(ad(1, "c1", budget=100.0))
    assert cat.budget_of(np.array([0]))[0] == 5.0
    assert ids(cat, at(geo="DE")) == {"a1"} and ids(cat, at(geo="FR")) == set()


def test_schedule_bounds_are_start_inclusive_end_exclusive() -> None:
    cat = _catalog()
    cat.upsert_campaign(campaign("c1", start=T0, end=T0 + timedelta(days=1)))
    cat.upsert(ad(1, "c1"))
    assert ids(cat, at(T0 - timedelta(seconds=1))) == set()
    assert ids(cat, at(T0)) == {"a1"}
    assert ids(cat, at(T0 + timedelta(days=1))) == set()


def test_targeting_by_geo_device_and_interests() -> None:
    cat = _catalog()
    cat.upsert_campaign(campaign("geo", targeting=Targeting(geo=("US", "CA"))))
    cat.upsert_campaign(campaign("dev", targeting=Targeting(devices=("mobile", "tablet"))))
    cat.upsert_campaign(campaign("int", targeting=Targeting(interests=("running",))))
    cat.upsert_campaign(campaign("all"))
    for i, c in enumerate(("geo", "dev", "int", "all", "none")):  # "none": a campaign with no entry
        cat.upsert(ad(i, c))
    assert ids(cat, at()) == {"a3", "a4"}  # nothing said: only the untargeted
    everyone = {f"a{i}" for i in range(5)}
    assert ids(cat, at(geo="CA", device="tablet", interests=["running", "tea"])) == everyone
    assert ids(cat, at(geo="MX", device="desktop", interests=["tea"])) == {"a3", "a4"}
    assert ids(cat, None) == everyone  # no request (priors): budget and active only


def test_inactive_campaign_hides_its_ads_and_an_update_replaces_the_entry() -> None:
    cat = _catalog()
    cat.upsert_campaign(campaign("c1", active=False))
    cat.upsert(ad(1, "c1"))
    assert ids(cat, at()) == set()
    cat.upsert_campaign(campaign("c1", targeting=Targeting(geo=("US",))))
    assert ids(cat, at(geo="US")) == {"a1"} and ids(cat, at()) == set()
    cat.upsert_campaign(campaign("c1"))  # targeting dropped
    assert ids(cat, at()) == {"a1"}


def test_entries_survive_code_compaction_and_stay_bounded() -> None:
    cat = _catalog(max_ads=20)
    cat.upsert_campaign(campaign("keep", daily_budget=3.0, targeting=Targeting(geo=("JP",))))
    for i in range(400):  # churn of ads, each of a new campaign: compacts the code tables
        cat.upsert(ad(i % 20, f"c{i}"))
    cat.upsert(ad(999, "keep")) if cat.n < 20 else None
    assert len(cat.codes["campaign"]) <= 2 * (20 + 64)
    code = cat.codes["campaign"]["keep"]
    assert cat.campaigns.budget[code] == 3.0 and cat.campaigns.geo[code] == frozenset({"JP"})
    for i in range(19):
        cat.upsert_campaign(campaign(f"n{i}"))
    with pytest.raises(CatalogFull, match="campaign"):
        cat.upsert_campaign(campaign("one-too-many"))
    cat.upsert_campaign(campaign("keep"))  # an update of a known entry still works


def test_request_audience_fields_follow_the_contract() -> None:
    req = AdRequest.model_validate_json('{"user_id": "u", "slot": "feed", "geo": "US", "device": "mobile"}')
    assert (req.geo, req.device) == ("US", "mobile")
    for bad in ('"geo": "USA"', '"geo": "us"', '"device": "watch"'):
        with pytest.raises(ValueError):
            AdRequest.model_validate_json('{"user_id": "u", "slot": "feed", ' + bad + "}")


def test_a_batch_mask_equals_each_requests_own() -> None:
    cat = _catalog()
    for i in range(6):
        cat.upsert(ad(i, f"c{i % 3}"))
    audiences = [at(geo="DE"), at(), at(geo="FR", device="mobile"), at(geo="DE")]
    assert not cat.campaigns.restricts()  # no entries yet: one mask serves every request
    assert (cat.servable_many(audiences) == np.stack([cat.servable(a) for a in audiences])).all()
    cat.upsert_campaign(campaign("c1", targeting=Targeting(geo=("DE",))))
    cat.upsert_campaign(campaign("c2", targeting=Targeting(devices=("mobile",))))
    assert cat.campaigns.restricts()
    assert (cat.servable_many(audiences) == np.stack([cat.servable(a) for a in audiences])).all()
