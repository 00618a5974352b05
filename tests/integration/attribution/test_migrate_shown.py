"""Migration 010 (shown impressions in the rollups) over a database an older release migrated
(up to 009) and rolled up, on ClickHouse 18.16 and chDB: it adds `shown` to both rollup tables
once (a second run, or two migrators, skip it: 18.16 has no ADD COLUMN IF NOT EXISTS), the rows
rolled up before it read their impressions as shown until their hour is refreshed, and a refresh
then counts shown impressions."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from attribution.ab_rollups import read_arms, refresh_ab_rollups
from attribution.migrate import MIGRATIONS_DIR, apply_migrations, migration_files
from attribution.rollups import read_rollups, refresh_rollups
from attribution.sql import Backend
from schemas.events import Impression
from streams.sink import COLUMNS, row_of
from tests.support.databases import fresh_database, migrations_upto

pytestmark = [pytest.mark.clickhouse, pytest.mark.timeout(120)]

SHOWN = "010_shown_rollups"
T0 = 1_789_999_200  # on an hour boundary
ROLLUP_COLS = ("hour", "campaign_id", "advertiser_id", "slot", "impressions", "holdout_impressions", "clicks",
               "spend", "conversions", "value", "dwell_events", "dwell_ms", "version")  # fmt: skip
AB_COLS = ("hour", "arm", "slot", "user_id", "requests", "impressions", "clicks", "revenue", "version")


@pytest.fixture(params=["clickhouse", "chdb"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """A fresh database migrated up to 009 with a rollup row of each table from that release."""
    with fresh_database(request.param, request, "sh") as db:
        assert SHOWN not in apply_migrations(db, migrations_upto(tmp_path, SHOWN, inclusive=False))
        hour = datetime.fromtimestamp(T0, UTC)
        db.insert("rollup_hourly", ROLLUP_COLS, [(hour, "old", "adv", "feed", 7, 0, 2, 1.5, 0, 0.0, 0, 0, 1)])
        db.insert("ab_rollup_hourly", AB_COLS, [(hour, "learning", "feed", "u1", 3, 5, 1, 0.5, 1)])
        yield db


def test_010_adds_shown_once_and_older_rows_read_their_impressions(backend: Backend) -> None:
    later = [p.stem for p in migration_files() if p.stem > SHOWN]  # migrations after 010 follow it
    assert apply_migrations(backend, MIGRATIONS_DIR) == [SHOWN, *later]
    assert apply_migrations(backend, MIGRATIONS_DIR) == []
    rows = read_rollups(backend, T0, T0 + 3600)
    assert [(r["campaign_id"], r["impressions"], r["shown"]) for r in rows] == [("old", 7, 7)]
    arm = read_arms(backend, T0, T0 + 3600)["learning"]
    assert arm.impressions.tolist() == [5] and arm.shown.tolist() == [5]


def test_a_refresh_after_010_counts_shown(backend: Backend) -> None:
    apply_migrations(backend, MIGRATIONS_DIR)
    imps = [
        Impression(event_id=f"i{n}", ts=datetime.fromtimestamp(T0 + 60, UTC), user_id="u1", request_id="r",
                   ad_id="a", campaign_id="new", advertiser_id="adv", slot="feed", position=n, price=1.0,
                   pctr=0.1, bid_type="cpc", render=render, ab_arm="learning")
        for n, render in enumerate(["client", "server", "server"])
    ]  # fmt: skip
    table, cols = COLUMNS[Impression]
    backend.insert(
        table, (*cols, "kafka_partition", "kafka_offset"), [row_of(e, 0, i)[1] for i, e in enumerate(imps)]
    )
    refresh_rollups(backend, T0, T0 + 3600)
    refresh_ab_rollups(backend, T0, T0 + 3600)
    new = [r for r in read_rollups(backend, T0, T0 + 3600) if r["campaign_id"] == "new"]
    assert [(r["impressions"], r["shown"]) for r in new] == [(3, 2)]
    arm = read_arms(backend, T0, T0 + 3600)["learning"]
    assert arm.impressions.tolist() == [3] and arm.shown.tolist() == [2]
