"""The hourly rollups' spend is what campaigns pay (`schemas.billing`), on ClickHouse 18.16 and
chDB alike: a CPM impression price / 1000 (its price is per thousand shown) in the hour it was
shown (its view, or when served on a server-rendered slot), a CPC impression its price at its
first click only; a served ad never shown costs nothing; a click shows a CPM impression its beacon
did not; impressions without a bid type (from before bid types) keep the old rule, their price
when served (`schemas.billing`: the worker's too)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from test_paths_hand import backend  # noqa: F401 (the fixture: an empty, migrated database on each engine)

from attribution.rollups import ROLLUP_TOTALS_SQL, read_rollups, refresh_rollups
from attribution.sql import Backend
from schemas.events import BidType, Click, Impression, Message, Render, View
from streams.sink import COLUMNS, row_of

pytestmark = [pytest.mark.clickhouse, pytest.mark.timeout(120)]

T0 = 1_789_999_200  # on an hour boundary
H = 3600


def at(t: int) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def imp(eid: str, t: int, campaign: str, bid_type: BidType | None, render: Render | None) -> Impression:
    return Impression(
        event_id=eid, ts=at(t), user_id="u1", request_id="r", ad_id=f"{campaign}_ad", campaign_id=campaign,
        advertiser_id="adv1", slot="feed", position=0, price=2.0, pctr=0.05, bid_type=bid_type, render=render,
    )  # fmt: skip


def insert(backend: Backend, events: list[Message]) -> None:  # noqa: F811
    rows: dict[type[Message], list[tuple[Any, ...]]] = {}
    for i, e in enumerate(events):
        rows.setdefault(type(e), []).append(row_of(e, 0, i)[1])
    for model, batch in rows.items():
        table, cols = COLUMNS[model]
        backend.insert(table, (*cols, "kafka_partition", "kafka_offset"), batch)


def test_spend_counts_billable_events_in_the_hour_billed(backend: Backend) -> None:  # noqa: F811
    insert(
        backend,
        [
            imp("a", T0, "cpm-client", "cpm", "client"),  # shown an hour later: billed then
            imp("b", T0, "cpm-client", "cpm", "client"),  # never shown: nothing
            imp("c", T0, "cpm-server", "cpm", "server"),  # shown when served
            imp("d", T0, "cpc", "cpc", "client"),  # clicked twice: its price once
            imp("e", T0, "cpc", "cpc", "client"),  # shown, never clicked: nothing
            imp("f", T0, "legacy", None, None),  # before bid types: its price when served
            imp("f2", T0 + H, "legacy", None, None),  # the same, never clicked
            imp("g", T0, "cpm-client", "cpm", "client"),  # clicked before its beacon: billed at the click
            View(event_id="va", ts=at(T0 + H + 60), user_id="u1", impression_id="a", ad_id="cpm-client_ad"),
            View(event_id="ve", ts=at(T0 + 60), user_id="u1", impression_id="e", ad_id="cpc_ad"),
            Click(event_id="k1", ts=at(T0 + 120), user_id="u1", impression_id="d", ad_id="cpc_ad",
                  campaign_id="cpc"),
            Click(event_id="k2", ts=at(T0 + 2 * H), user_id="u1", impression_id="d", ad_id="cpc_ad",
                  campaign_id="cpc"),
            Click(event_id="kf", ts=at(T0 + 300), user_id="u1", impression_id="f", ad_id="legacy_ad",
                  campaign_id="legacy"),
            Click(event_id="kg", ts=at(T0 + 2 * H + 10), user_id="u1", impression_id="g",
                  ad_id="cpm-client_ad", campaign_id="cpm-client"),
            View(event_id="vg", ts=at(T0 + 2 * H + 20), user_id="u1", impression_id="g",
                 ad_id="cpm-client_ad"),
        ],
    )  # fmt: skip
    refresh_rollups(backend, T0, T0 + 3 * H)
    spend: dict[tuple[int, str], float] = {}
    served: dict[str, int] = {}
    for r in read_rollups(backend, T0, T0 + 3 * H):
        h = r["hour"]  # a datetime from the server, text from chDB
        hour = int(
            (h if isinstance(h, datetime) else datetime.fromisoformat(str(h))).replace(tzinfo=UTC).timestamp()
        )
        if r["spend"]:
            spend[hour - T0, r["campaign_id"]] = spend.get((hour - T0, r["campaign_id"]), 0.0) + r["spend"]
        served[r["campaign_id"]] = served.get(r["campaign_id"], 0) + r["impressions"]
    assert spend == pytest.approx(
        {(H, "cpm-client"): 0.002, (2 * H, "cpm-client"): 0.002, (0, "cpm-server"): 0.002, (0, "cpc"): 2.0,
         (0, "legacy"): 2.0, (H, "legacy"): 2.0}
    )  # fmt: skip
    assert served == {"cpm-client": 3, "cpm-server": 1, "cpc": 2, "legacy": 2}  # served, as before


def _hour(h: Any) -> int:
    return int(
        (h if isinstance(h, datetime) else datetime.fromisoformat(str(h))).replace(tzinfo=UTC).timestamp()
    )


def test_shown_counts_served_impressions_in_the_hour_they_were_shown(backend: Backend) -> None:  # noqa: F811
    """Migration 010: a client-rendered impression is shown at its view (whatever its bid type),
    a server-rendered one and one from before render beacons when served; served-only and the
    holdout are not shown. Clicks over shown is the CTR; rows rolled up before 010 (shown NULL)
    read their impressions."""
    from schemas.holdout import HOLDOUT_AD_ID

    holdout = imp("h", T0, "cpc", "cpc", "server").model_copy(update={"ad_id": HOLDOUT_AD_ID})
    insert(
        backend,
        [
            imp("a", T0, "cpm-client", "cpm", "client"),  # viewed an hour later: shown then
            imp("b", T0, "cpm-client", "cpm", "client"),  # never viewed: served, not shown
            imp("c", T0, "cpm-server", "cpm", "server"),  # shown when served
            imp("d", T0, "cpc", "cpc", "client"),  # clicked, its beacon lost: not shown
            imp("e", T0, "cpc", "cpc", "client"),  # viewed and clicked
            imp("f", T0, "legacy", None, None),  # before render beacons: shown when served
            holdout,
            View(event_id="va", ts=at(T0 + H + 60), user_id="u1", impression_id="a", ad_id="cpm-client_ad"),
            View(event_id="ve", ts=at(T0 + 60), user_id="u1", impression_id="e", ad_id="cpc_ad"),
            View(event_id="vh", ts=at(T0 + 60), user_id="u1", impression_id="h", ad_id=HOLDOUT_AD_ID),
            Click(event_id="k1", ts=at(T0 + 120), user_id="u1", impression_id="d", ad_id="cpc_ad",
                  campaign_id="cpc"),
            Click(event_id="k2", ts=at(T0 + 180), user_id="u1", impression_id="e", ad_id="cpc_ad",
                  campaign_id="cpc"),
        ],
    )  # fmt: skip
    refresh_rollups(backend, T0, T0 + 3 * H)
    shown: dict[tuple[int, str], int] = {}
    served: dict[str, int] = {}
    for r in read_rollups(backend, T0, T0 + 3 * H):
        if r["shown"]:
            key = (_hour(r["hour"]) - T0, r["campaign_id"])
            shown[key] = shown.get(key, 0) + r["shown"]
        served[r["campaign_id"]] = served.get(r["campaign_id"], 0) + r["impressions"]
    assert shown == {(H, "cpm-client"): 1, (0, "cpm-server"): 1, (0, "cpc"): 1, (0, "legacy"): 1}
    assert served == {"cpm-client": 2, "cpm-server": 1, "cpc": 2, "legacy": 1}
    totals = {
        (str(r[0]), str(r[1])): (int(r[2]), int(r[9]), int(r[3]))
        for r in backend.execute(ROLLUP_TOTALS_SQL, {"since": T0, "until": T0 + 3 * H})
    }
    assert totals[("cpc", "feed")] == (2, 1, 2)  # served, shown, clicks
    # a row from before 010 (no shown): read as its impressions
    cols = ("hour", "campaign_id", "advertiser_id", "slot", "impressions", "holdout_impressions", "clicks",
            "spend", "conversions", "value", "dwell_events", "dwell_ms", "version")  # fmt: skip
    backend.insert(
        "rollup_hourly", cols, [(at(T0 + 2 * H), "old", "adv1", "feed", 7, 0, 1, 0.0, 0, 0.0, 0, 0, 1)]
    )
    old = [r for r in read_rollups(backend, T0, T0 + 3 * H) if r["campaign_id"] == "old"]
    assert [(r["impressions"], r["shown"]) for r in old] == [(7, 7)]


def test_roi_spend_is_billed_spend(backend: Backend) -> None:  # noqa: F811
    """The ROI's own-channel spend (attribution.roi) is what the range's served impressions were
    billed, as the rollups' spend: a CPM impression price / 1000 once shown, a CPC one its price
    once clicked (once), one from before bid types its price when served; never shown or clicked,
    nothing."""
    from attribution.roi import channel_spend

    insert(
        backend,
        [
            imp("a", T0, "cpm-client", "cpm", "client"),
            imp("b", T0, "cpm-client", "cpm", "client"),
            imp("c", T0, "cpm-server", "cpm", "server"),
            imp("d", T0, "cpc", "cpc", "client"),
            imp("e", T0, "cpc", "cpc", "client"),
            imp("f", T0, "legacy", None, None),
            imp("f2", T0, "legacy", None, None),  # not clicked: its price all the same
            Click(event_id="kf", ts=at(T0 + 300), user_id="u1", impression_id="f", ad_id="legacy_ad",
                  campaign_id="legacy"),
            View(event_id="va", ts=at(T0 + H + 60), user_id="u1", impression_id="a", ad_id="cpm-client_ad"),
            View(event_id="ve", ts=at(T0 + 60), user_id="u1", impression_id="e", ad_id="cpc_ad"),
            Click(event_id="k1", ts=at(T0 + 120), user_id="u1", impression_id="d", ad_id="cpc_ad",
                  campaign_id="cpc"),
            Click(event_id="k2", ts=at(T0 + 2 * H), user_id="u1", impression_id="d", ad_id="cpc_ad",
                  campaign_id="cpc"),
        ],
    )  # fmt: skip
    spend = channel_spend(backend, "campaign", T0, T0 + 3 * H)
    assert spend == pytest.approx({"cpm-client": 0.002, "cpm-server": 0.002, "cpc": 2.0, "legacy": 4.0})
