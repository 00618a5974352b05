"""The creative variants panel on hand-made events in chDB: impressions written through the sink's
row mapping (migration 007's columns), each variant's share and CTR with the Wilson interval
(checked against scipy's), and the Grafana table running the same statement."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from scipy.stats import binomtest

from attribution.dashboard import panels
from attribution.dashboard import queries as q
from attribution.dashboard.variants import VARIANT_CTR_SQL, variant_ctr
from attribution.migrate import apply_migrations
from attribution.sql import ChdbBackend
from schemas.events import Click, Impression, Message
from streams.sink import COLUMNS, row_of

H = 1_767_225_600  # 2026-01-01 00:00:00 UTC
GRAFANA = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "dashboards" / "adstream.json"


@pytest.fixture
def backend() -> Iterator[ChdbBackend]:
    b = ChdbBackend(f"variants_{uuid.uuid4().hex[:6]}")
    apply_migrations(b)
    yield b
    b.execute(f"DROP DATABASE IF EXISTS {b.database}")
    b.close()


def imp(i: int, ad: str, variant: str | None) -> Impression:
    return Impression(
        event_id=f"i{i}", ts=datetime.fromtimestamp(H + i, UTC), user_id=f"u{i % 7}", request_id=f"r{i}",
        ad_id=ad, campaign_id="c1", advertiser_id="adv", slot="feed", position=0, price=0.5,
        variant_id=variant, variant_propensity=None if variant is None else 0.5,
    )  # fmt: skip


def click(i: int, ad: str, n: int = 0) -> Click:
    return Click(
        event_id=f"k{i}-{n}", ts=datetime.fromtimestamp(H + i, UTC) + timedelta(seconds=5),
        user_id=f"u{i % 7}", impression_id=f"i{i}", ad_id=ad, campaign_id="c1",
    )  # fmt: skip


def insert(backend: ChdbBackend, events: list[Message]) -> None:
    by: dict[str, list[tuple[object, ...]]] = {}
    for offset, e in enumerate(events):
        table, row = row_of(e, 0, offset)
        by.setdefault(table, []).append(row)
    for model in (Impression, Click):
        table, cols = COLUMNS[model]
        backend.insert(table, (*cols, "kafka_partition", "kafka_offset"), by[table])


def seed(backend: ChdbBackend) -> None:
    events: list[Message] = []
    # ad A: a 30 impressions (3 clicked, one of them twice), b 10 (0 clicked); ad B: x 5 (5 clicked)
    for i in range(30):
        events.append(imp(i, "A", "a"))
        if i < 3:
            events.append(click(i, "A"))
    events.append(click(0, "A", 1))  # a second click on one impression: still one
    events += [imp(100 + i, "A", "b") for i in range(10)]
    for i in range(5):
        events += [imp(200 + i, "B", "x"), click(200 + i, "B")]
    events += [imp(300 + i, "C", None) for i in range(50)]  # an ad without variants: not shown
    insert(backend, events)


def wilson(k: int, n: int) -> tuple[float, float]:
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    return ci.low, ci.high


def test_share_ctr_and_wilson_interval_by_hand(backend: ChdbBackend) -> None:
    seed(backend)
    got = variant_ctr(backend, q.Window(H, H + 3600, 60))
    (bars, shares) = got["figure"]["data"]
    assert bars["x"] == [["A", "A", "B"], ["a", "b", "x"]]
    assert bars["y"] == pytest.approx([10.0, 0.0, 100.0])
    assert shares["y"] == pytest.approx([75.0, 25.0, 100.0])
    # served, shown (these say nothing of rendering: shown when served), clicks
    assert [c[:3] for c in bars["customdata"]] == [[30, 30, 3], [10, 10, 0], [5, 5, 5]]
    for (n, k), y, up, down in zip(
        [(30, 3), (10, 0), (5, 5)],
        bars["y"],
        bars["error_y"]["array"],
        bars["error_y"]["arrayminus"],
        strict=True,
    ):
        low, high = wilson(k, n)
        assert y - down == pytest.approx(100 * low, abs=1e-4) and y + up == pytest.approx(
            100 * high, abs=1e-4
        )
    assert "variants" in panels.PANEL_IDS


def test_top_keeps_the_ads_with_most_variant_impressions(backend: ChdbBackend) -> None:
    seed(backend)
    got = variant_ctr(backend, q.Window(H, H + 3600, 60, top=1))
    assert set(got["figure"]["data"][0]["x"][0]) == {"A"}


def test_no_variant_impressions_is_an_empty_panel_saying_why(backend: ChdbBackend) -> None:
    insert(backend, [imp(1, "C", None), click(1, "C")])
    got = variant_ctr(backend, q.Window(H, H + 3600, 60))
    assert got["figure"] is None and "no impressions that name a creative variant" in got["empty"]


def grafana_sql() -> str:
    (panel,) = [p for p in json.loads(GRAFANA.read_text())["panels"] if "Creative variants" in p["title"]]
    assert panel["type"] == "table" and panel["targets"][0]["format"] == 1
    sql: str = panel["targets"][0]["rawSql"]
    return sql


def test_grafana_table_is_the_panels_statement(backend: ChdbBackend) -> None:
    page = (
        VARIANT_CTR_SQL.replace(
            "ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)", "$__timeFilter(ts)"
        )
        .replace("ts >= toDateTime(%(since)s)", "ts >= $__fromTime")
        .replace("%(top)s", "20")
        .strip()
    )
    assert grafana_sql() == page
    seed(backend)
    expanded = (
        grafana_sql()
        .replace("$__timeFilter(ts)", f"ts >= toDateTime({H}) AND ts <= toDateTime({H + 3600})")
        .replace("$__fromTime", f"toDateTime({H})")
    )
    rows = backend.execute(expanded)
    assert [(r[0], r[1], int(r[2]), int(r[3]), int(r[4])) for r in rows] == [
        ("A", "a", 30, 30, 3),
        ("A", "b", 10, 10, 0),
        ("B", "x", 5, 5, 5),
    ]
