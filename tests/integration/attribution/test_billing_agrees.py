"""One billing rule (`schemas.billing`): what the streams worker bills (the label join, in Python)
is what the rollups' spend, the ROI table's spend and the A/B rollup's revenue bill (SQL, on
ClickHouse 18.16 and chDB), computed on the same events: CPM and CPC, client- and server-rendered,
never shown, shown by a click before (or without) its beacon, clicked twice, and impressions from
before bid types (their price when served)."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime

import pytest
from test_paths_hand import backend  # noqa: F401 (the fixture: an empty, migrated database on each engine)
from test_rollup_billing import insert

from attribution.ab_rollups import read_arms, refresh_ab_rollups
from attribution.roi import channel_spend
from attribution.rollups import read_rollups, refresh_rollups
from attribution.sql import Backend
from schemas.events import BidType, Click, Impression, Message, Render, View
from schemas.settings import Settings
from streams.processor import Processor

pytestmark = [pytest.mark.clickhouse, pytest.mark.timeout(120)]

T0 = 1_789_999_200  # on an hour boundary
H = 3600


def at(t: int) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def imp(eid: str, campaign: str, price: float, bid_type: BidType | None, render: Render | None) -> Impression:
    return Impression(
        event_id=eid, ts=at(T0 + 10), user_id="u1", request_id=f"r{eid}", ad_id=f"{campaign}_ad",
        campaign_id=campaign, advertiser_id="adv1", slot="feed", position=0, price=price, pctr=0.05,
        bid_type=bid_type, render=render, ab_arm="learning",
    )  # fmt: skip


def view(eid: str, t: int) -> View:
    return View(event_id=f"v{eid}", ts=at(T0 + t), user_id="u1", impression_id=eid, ad_id="x")


def click(eid: str, t: int, n: int = 0) -> Click:
    return Click(
        event_id=f"k{eid}{n}", ts=at(T0 + t), user_id="u1", impression_id=eid, ad_id="x", campaign_id="x"
    )


EVENTS: list[Message] = [
    imp("m1", "cpm-never", 2000.0, "cpm", "client"),  # served, never shown: nothing
    imp("m2", "cpm-view", 1000.0, "cpm", "client"),  # shown by its beacon, then clicked
    imp("m3", "cpm-server", 3000.0, "cpm", "server"),  # shown when served
    imp("m4", "cpm-click", 4000.0, "cpm", "client"),  # clicked, its beacon lost: the click shows it
    imp("m5", "cpm-click", 500.0, "cpm", "client"),  # clicked before its beacon: billed once
    imp("c1", "cpc-unclicked", 5.0, "cpc", "client"),  # shown, never clicked
    imp("c2", "cpc", 0.7, "cpc", "server"),  # clicked twice: its price once
    imp("c3", "cpc", 0.2, "cpc", "client"),  # clicked without its beacon
    imp("o1", "old", 0.3, None, None),  # before bid types, clicked: its price when served
    imp("o2", "old-unclicked", 0.9, None, None),  # before bid types, never clicked: the same
    view("m2", 60), view("c1", 60),
    click("m2", 120), click("m4", 120), click("m5", 120),
    click("c2", 120), click("c3", 120), click("o1", 120),
    view("m5", 180), click("c2", 240, 1),
]  # fmt: skip


def worker_billed() -> dict[str, float]:
    """What the streams worker's label join bills, per campaign."""
    proc = Processor.from_settings(
        Settings(streams={"attribution_window_s": float(H), "watermark_window": 1})
    )
    proc.on_batch([(e, None, e.ts.timestamp()) for e in EVENTS])
    proc.join.close_all()
    billed: dict[str, float] = defaultdict(float)
    for campaign, _, cost in proc.join.billed:
        billed[campaign] += cost
    return dict(billed)


def test_the_worker_and_the_sql_bill_alike(backend: Backend) -> None:  # noqa: F811
    worker = worker_billed()
    assert worker == pytest.approx(
        {"cpm-view": 1.0, "cpm-server": 3.0, "cpm-click": 4.5, "cpc": 0.9, "old": 0.3, "old-unclicked": 0.9}
    )
    insert(backend, EVENTS)
    refresh_rollups(backend, T0, T0 + H)
    rollups: dict[str, float] = defaultdict(float)
    for r in read_rollups(backend, T0, T0 + H):
        if r["spend"]:
            rollups[r["campaign_id"]] += r["spend"]
    assert dict(rollups) == pytest.approx(worker)
    roi = {c: s for c, s in channel_spend(backend, "campaign", T0, T0 + H).items() if s}
    assert roi == pytest.approx(worker)
    refresh_ab_rollups(backend, T0, T0 + H)
    (arm,) = read_arms(backend, T0, T0 + H).values()
    assert float(arm.revenue.sum()) == pytest.approx(sum(worker.values()))
