"""The page's advertiser view (`?view=advertiser`) on chDB: only the chosen advertiser's and
campaigns' numbers, from the hourly rollups; every rate beside its counts; money in the page's
currency; days whose spend ran ahead of plan flagged; bad filters are 400s naming the value."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from attribution.dashboard import advertiser, panels
from attribution.dashboard.app import create_app
from attribution.migrate import apply_migrations
from attribution.rollups import refresh_rollups
from attribution.sql import ChdbBackend
from schemas.settings import Settings

T0 = 1767225600  # 2026-01-01T00:00:00Z
IMP = ("event_id", "ts", "ts_ms", "user_id", "request_id", "ad_id", "campaign_id", "advertiser_id", "slot",
       "position", "price", "kafka_partition", "kafka_offset")  # fmt: skip
CLICK = ("event_id", "ts", "ts_ms", "user_id", "impression_id", "ad_id", "campaign_id", "kafka_partition",
         "kafka_offset")  # fmt: skip
CONV = ("event_id", "ts", "ts_ms", "user_id", "campaign_id", "advertiser_id", "value", "kafka_partition",
        "kafka_offset")  # fmt: skip
ADS = ("event_id", "ts", "ts_ms", "ad_id", "campaign_id", "advertiser_id", "category", "title", "bid",
       "daily_budget", "active", "kafka_partition", "kafka_offset")  # fmt: skip
# campaign → (advertiser, impressions, price, clicks, conversions, value, daily budget)
CAMPAIGNS = {
    "c_hot": ("adv1", 40, 0.5, 8, 2, 30.0, 10.0),  # 20.0 spent on a 10.0 budget: ahead of plan
    "c_cool": ("adv1", 20, 0.1, 1, 0, 0.0, 50.0),
    "c_other": ("adv2", 30, 1.0, 3, 1, 99.0, 100.0),
}


class SharedChdb(ChdbBackend):
    """One in-memory engine for the test (the app's per-request close would forget its tables)."""

    def close(self) -> None:
        pass


@pytest.fixture
def client() -> Iterator[TestClient]:
    db = SharedChdb(f"dash_adv_{uuid.uuid4().hex[:8]}")
    apply_migrations(db)
    imps, clicks, convs, ads = [], [], [], []
    for campaign, (adv, n, price, k, conv, value, budget) in CAMPAIGNS.items():
        ads.append((f"a_{campaign}", T0 - 60, (T0 - 60) * 1000, f"ad_{campaign}", campaign, adv, "x", "t",
                    1.0, budget, 1, 0, 0))  # fmt: skip
        for i in range(n):
            t = T0 + 3600 * (i % 5) + i
            imps.append((f"i_{campaign}_{i}", t, t * 1000, f"u{i}", f"r{i}", f"ad_{campaign}", campaign, adv,
                         "feed", 0, price, 0, i))  # fmt: skip
        for i in range(k):
            t = T0 + 3600 * (i % 5) + i + 5
            clicks.append((f"k_{campaign}_{i}", t, t * 1000, f"u{i}", f"i_{campaign}_{i}", f"ad_{campaign}",
                           campaign, 0, i))  # fmt: skip
        for i in range(conv):
            t = T0 + 7200 + i
            convs.append((f"v_{campaign}_{i}", t, t * 1000, f"u{i}", campaign, adv, value / conv, 0, i))
    db.insert("impressions", IMP, imps)
    db.insert("clicks", CLICK, clicks)
    db.insert("conversions", CONV, convs)
    db.insert("ads", ADS, ads)
    refresh_rollups(db, T0, T0 + 86400)
    settings = Settings(clickhouse={"url": f"clickhouse://default@127.0.0.1:9000/{db.database}"})
    yield TestClient(create_app(settings, connect=lambda: db))
    db.execute(f"DROP DATABASE IF EXISTS {db.database}")
    ChdbBackend.close(db)


def _view(client: TestClient, query: str) -> dict[str, Any]:
    response = client.get(f"/api/panels?view=advertiser&since={T0}&until={T0 + 86400}&{query}")
    assert response.status_code == 200, response.text
    body = response.json()
    assert [p["id"] for p in body["panels"]] == list(panels.ADVERTISER_PANEL_IDS)
    return {p["id"]: p for p in body["panels"]}


def _table(panel: dict[str, Any]) -> list[dict[str, Any]]:
    trace = panel["figure"]["data"][0]
    names, cols = trace["header"]["values"], trace["cells"]["values"]
    return [dict(zip(names, row, strict=True)) for row in zip(*cols, strict=True)]


def test_an_advertiser_sees_their_campaigns_with_the_counts_behind_each_rate(client: TestClient) -> None:
    got = _view(client, "advertiser=adv1&currency=eur")
    rows = {r["campaign"]: r for r in _table(got["adv_campaigns"])}
    assert set(rows) == {"c_hot", "c_cool"}  # not adv2's
    hot = rows["c_hot"]
    assert (hot["impressions"], hot["clicks"], hot["CTR %"]) == (40, 8, 20.0)
    assert (hot["spend (EUR)"], hot["conversions"], hot["value (EUR)"]) == (20.0, 2, 30.0)
    assert (hot["CPA (EUR)"], hot["ROAS"]) == (10.0, 1.5)
    assert rows["c_cool"]["CPA (EUR)"] == "–"  # no conversion: no CPA, not 0
    assert "EUR" in got["adv_spend"]["title"] and "EUR" in got["adv_pacing"]["title"]
    spend = {t["name"]: sum(t["y"]) for t in got["adv_spend"]["figure"]["data"]}
    assert spend == pytest.approx({"c_hot": 20.0, "c_cool": 2.0})


def test_pacing_flags_spend_ahead_of_plan(client: TestClient) -> None:
    alerts = _table(_view(client, "advertiser=adv1")["adv_pacing"])
    assert alerts[0]["campaign"] == "c_hot" and alerts[0]["alert"] == "spend ahead of plan"
    assert alerts[0]["spend / plan"] == pytest.approx(2.0)
    assert {r["campaign"]: r["alert"] for r in alerts}["c_cool"] == "on plan"


def test_the_campaign_filter_narrows_and_all_means_every_advertiser(client: TestClient) -> None:
    only = _table(_view(client, "advertiser=adv1&campaign=c_cool")["adv_campaigns"])
    assert [r["campaign"] for r in only] == ["c_cool"]
    every = _table(_view(client, "")["adv_campaigns"])
    assert {r["campaign"] for r in every} == set(CAMPAIGNS)
    none = _view(client, "advertiser=adv_unknown")
    assert all(p["figure"] is None and "adv_unknown" in p["empty"] for p in none.values())
    assert client.get("/api/filters").json() == {
        "advertisers": {"adv1": ["c_cool", "c_hot"], "adv2": ["c_other"]}
    }


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("view=advertisers", "view='advertisers' is not one of operations, advertiser"),
        ("view=advertiser&currency=euro", "currency='EURO' is not an ISO 4217 code"),
        ("view=advertiser&advertiser=" + "x" * 200, "advertiser='xxxx"),
    ],
)
def test_bad_view_parameters_are_400_naming_the_value(client: TestClient, query: str, message: str) -> None:
    response = client.get(f"/api/panels?{query}")
    assert response.status_code == 400 and message in response.json()["error"]


def test_the_advertiser_view_reads_no_raw_event_table() -> None:
    for name, sql in advertiser.QUERIES.items():
        tables = set(re.findall(r"FROM\s+(\w+)", sql))
        assert tables <= {"rollup_hourly", "ads"}, (name, tables)
        assert "ads FINAL" not in sql  # the catalog's latest state is argMax, duplicates harmless
