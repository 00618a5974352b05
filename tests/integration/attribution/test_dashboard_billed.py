"""The operations views count what was billed and shown, on ClickHouse 18.16 and chDB alike.

Spend on the built-in page (pacing, spend against budget, CPA and ROAS) and on Grafana's
operations dashboard (adstream.json) is billed spend (`schemas.billing`, read from the hourly
rollups): a served CPM impression never shown and a CPC impression never clicked cost nothing,
however high their price. The creative variants' CTR (page and Grafana table) is clicks over shown
impressions, as the rollups and `adstream ab` count it, with served impressions beside them.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from test_grafana_sql import expand
from test_paths_hand import backend  # noqa: F401 (the fixture: an empty, migrated database on each engine)
from test_rollup_billing import insert

from attribution.dashboard import events as page
from attribution.dashboard import queries as q
from attribution.dashboard.variants import VARIANT_CTR_SQL, variant_ctr
from attribution.roi import billed_sql
from attribution.rollups import refresh_rollups
from attribution.sql import Backend
from schemas.events import BidType, Click, Conversion, Impression, Message, Render, View
from schemas.holdout import HOLDOUT_AD_ID

pytestmark = [pytest.mark.clickhouse, pytest.mark.timeout(120)]

T0 = 1_789_999_200  # on an hour boundary
H = 3600
GRAFANA = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "dashboards" / "adstream.json"
# what each campaign was billed: CPM price / 1000 when shown, CPC its price when clicked, an
# impression from before billing (no bid type) its price when served
BILLED = {"cpm": 1.0 + 3.0, "cpc": 0.7, "old": 0.3}


def at(t: int) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def imp(
    eid: str, campaign: str, price: float, bid_type: BidType | None, render: Render | None, **extra: Any
) -> Impression:
    return Impression(
        event_id=eid, ts=at(T0 + 10), user_id="u1", request_id=f"r{eid}", ad_id=f"{campaign}_ad",
        campaign_id=campaign, advertiser_id="adv1", slot="feed", position=0, price=price, pctr=0.05,
        bid_type=bid_type, render=render, **extra,
    )  # fmt: skip


def view(eid: str) -> View:
    return View(event_id=f"v{eid}", ts=at(T0 + 60), user_id="u1", impression_id=eid, ad_id="x")


def click(eid: str, campaign: str) -> Click:
    return Click(
        event_id=f"k{eid}", ts=at(T0 + 120), user_id="u1", impression_id=eid, ad_id="x", campaign_id=campaign
    )


def seed_spend(backend: Backend) -> None:  # noqa: F811
    events: list[Message] = [
        imp("m1", "cpm", 2000.0, "cpm", "client"),  # served, never shown: nothing
        imp("m2", "cpm", 1000.0, "cpm", "client"),  # shown by its beacon: 1000 / 1000
        view("m2"),
        imp("m3", "cpm", 3000.0, "cpm", "server"),  # shown when served: 3000 / 1000
        imp("c1", "cpc", 5.0, "cpc", "client"),  # shown, never clicked: nothing
        view("c1"),
        imp("c2", "cpc", 0.7, "cpc", "server"),  # clicked: its price
        click("c2", "cpc"),
        imp("o1", "old", 0.3, None, None),  # before billing: its price when served
        imp("h1", "cpm", 0.0, None, None).model_copy(update={"ad_id": HOLDOUT_AD_ID}),
        Conversion(event_id="x1", ts=at(T0 + 600), user_id="u1", campaign_id="cpm", advertiser_id="adv1",
                   value=8.0),
        Conversion(event_id="x2", ts=at(T0 + 600), user_id="u1", campaign_id="cpc", advertiser_id="adv1",
                   value=1.4),
    ]  # fmt: skip
    insert(backend, events)
    refresh_rollups(backend, T0, T0 + H)  # as the scheduler (or a stored attribution run) does


def grafana(title: str) -> str:
    (panel,) = [p for p in json.loads(GRAFANA.read_text())["panels"] if p["title"] == title]
    sql: str = panel["targets"][0]["rawSql"]
    return expand(sql, T0, T0 + H, 60)


def test_operations_spend_is_billed_spend(backend: Backend) -> None:  # noqa: F811
    seed_spend(backend)
    window = q.Window(T0, T0 + H, 60, top=10)
    served = backend.execute(billed_sql(), {**window.params})
    assert sum(s for *_, s in served) == pytest.approx(sum(BILLED.values()))  # the ROI's definition
    # the built-in page
    over_time = backend.execute(q.SPEND_OVER_TIME, window.params)
    assert sum(s for _, s in over_time) == pytest.approx(sum(BILLED.values()))
    econ = {c: (s, n, v) for c, s, _, n, v in backend.execute(q.CAMPAIGN_ECONOMICS, window.params)}
    assert {c: e[0] for c, e in econ.items()} == pytest.approx(BILLED)
    assert econ["cpm"][1:] == (1, 8.0) and econ["cpc"][1:] == (1, pytest.approx(1.4))
    running = page.pacing(backend, window)["figure"]["data"][0]["y"]
    assert running[-1] == pytest.approx(sum(BILLED.values()))
    # Grafana's operations dashboard
    cumulative = backend.execute(grafana("Spend against budget pacing (cumulative)"))
    assert cumulative[-1][1] == pytest.approx(sum(BILLED.values()))
    per_campaign = {r[0]: r[1] for r in backend.execute(grafana("Spend against budget per campaign"))}
    assert per_campaign == pytest.approx(BILLED)
    cpa = {r[0]: r[1:] for r in backend.execute(grafana("CPA and ROAS per campaign"))}
    spend, conversions, value, cpa_cpm, roas_cpm = cpa["cpm"]
    assert (spend, conversions, value) == (pytest.approx(4.0), 1, 8.0)
    assert (cpa_cpm, roas_cpm) == (pytest.approx(4.0), pytest.approx(2.0))
    assert cpa["cpc"][0] == pytest.approx(0.7) and cpa["cpc"][4] == pytest.approx(2.0)


def test_event_rates_show_served_impressions_and_views_apart(backend: Backend) -> None:  # noqa: F811
    seed_spend(backend)
    window = q.Window(T0, T0 + H, 60)
    page_rates = backend.execute(q.EVENT_RATES, window.params)
    grafana_rates = backend.execute(grafana("Event rates (events/s)"))
    for rows in (page_rates, grafana_rates):
        totals: dict[str, float] = {}
        for r in rows:
            kind = str(r[0] if rows is page_rates else r[1])
            totals[kind] = totals.get(kind, 0) + (r[2] if rows is page_rates else r[2] * 60)
        assert totals == pytest.approx(
            {"impressions": 6, "holdout impressions": 1, "views": 2, "clicks": 1, "conversions": 2}
        )
    names = [t["name"] for t in page.event_rates(backend, window)["figure"]["data"]]
    assert names[:3] == ["served impressions", "views (render beacons: client-rendered ads shown)",
                         "holdout impressions"]  # fmt: skip


def seed_variants(backend: Backend) -> None:  # noqa: F811
    v = {"variant_propensity": 0.5}
    events: list[Message] = [
        # variant a: 4 served on a client-rendered slot, 2 shown (beacons), 1 of them clicked
        *(imp(f"a{i}", "var", 0.1, "cpc", "client", variant_id="a", **v) for i in range(4)),
        view("a0"), view("a1"), click("a0", "var"),
        # variant b: 2 served and shown (server-rendered), 1 clicked
        *(imp(f"b{i}", "var", 0.1, "cpc", "server", variant_id="b", **v) for i in range(2)),
        click("b0", "var"),
    ]  # fmt: skip
    insert(backend, events)


def test_variant_ctr_is_clicks_over_shown(backend: Backend) -> None:  # noqa: F811
    seed_variants(backend)
    window = q.Window(T0, T0 + H, 60)
    # ad, variant, served, shown, clicks, share (of the ad's served), CTR (clicks / shown)
    expect = [("var_ad", "a", 4, 2, 1, 4 / 6, 0.5), ("var_ad", "b", 2, 2, 1, 2 / 6, 0.5)]
    for rows in (
        backend.execute(VARIANT_CTR_SQL, window.params),
        backend.execute(grafana("Creative variants per ad: share and CTR with 95% Wilson interval")),
    ):
        got = [
            (str(r[0]), str(r[1]), int(r[2]), int(r[3]), int(r[4]), float(r[5]), float(r[6])) for r in rows
        ]
        assert got == [pytest.approx(e) for e in expect]
        assert all(low < ctr < high for *_, ctr, low, high in rows)
    (bars, shares) = variant_ctr(backend, window)["figure"]["data"]
    assert bars["y"] == pytest.approx([50.0, 50.0])
    assert shares["y"] == pytest.approx([100 * 4 / 6, 100 * 2 / 6])
    assert [c[:3] for c in bars["customdata"]] == [[4, 2, 1], [2, 2, 1]]  # served, shown, clicks
