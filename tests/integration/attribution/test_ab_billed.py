"""The A/B rollup's revenue is what the arm's impressions were billed (`schemas.billing`), on
ClickHouse 18.16 and chDB alike: a CPC impression its price once clicked, a CPM one price / 1000
once shown (a click shows it: its beacon was lost), an impression without a bid type (from before
bid types) its price when served, as the rollups' spend (`schemas.billing`)."""

from __future__ import annotations

import pytest
from test_dashboard_billed import click, imp, view
from test_paths_hand import backend  # noqa: F401 (the fixture: an empty, migrated database on each engine)
from test_rollup_billing import insert

from attribution.ab_rollups import read_arms, refresh_ab_rollups
from attribution.sql import Backend
from schemas.events import Message

pytestmark = [pytest.mark.clickhouse, pytest.mark.timeout(120)]

T0 = 1_789_999_200  # on an hour boundary (the events of test_dashboard_billed are at T0 + seconds)
H = 3600


def test_ab_revenue_is_billed_revenue(backend: Backend) -> None:  # noqa: F811
    arm = {"ab_arm": "learning"}
    events: list[Message] = [
        imp("m1", "cpm", 2000.0, "cpm", "client", **arm),  # served, never shown: nothing
        imp("m2", "cpm", 1000.0, "cpm", "client", **arm),  # shown and clicked: 1000 / 1000
        view("m2"), click("m2", "cpm"),
        imp("m3", "cpm", 3000.0, "cpm", "server", **arm),  # shown when served: 3000 / 1000
        imp("m4", "cpm", 4000.0, "cpm", "client", **arm),  # clicked, its beacon lost: billed shown
        click("m4", "cpm"),
        imp("c1", "cpc", 5.0, "cpc", "client", **arm),  # shown, never clicked: nothing
        view("c1"),
        imp("c2", "cpc", 0.7, "cpc", "server", **arm),  # clicked: its price
        click("c2", "cpc"),
        imp("o1", "old", 0.3, None, None, **arm),  # before bid types, clicked: its price when served
        click("o1", "old"),
        imp("o2", "old", 0.9, None, None, **arm),  # before bid types, not clicked: its price too
    ]  # fmt: skip
    insert(backend, events)
    refresh_ab_rollups(backend, T0, T0 + H)
    (data,) = read_arms(backend, T0, T0 + H).values()
    assert float(data.revenue.sum()) == pytest.approx(1.0 + 3.0 + 4.0 + 0.7 + 0.3 + 0.9)
    assert int(data.clicks.sum()) == 4 and int(data.shown.sum()) == 6 and int(data.impressions.sum()) == 8
