"""The A/B dashboard panel (CTR per arm with its band) on rollup rows in chDB, by hand."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from attribution.dashboard import panels
from attribution.dashboard import queries as q
from attribution.dashboard.arms import ab_ctr
from attribution.migrate import apply_migrations
from attribution.sql import ChdbBackend

H = 1_767_225_600  # 2026-01-01 00:00:00 UTC
COLS = ("hour", "arm", "slot", "user_id", "requests", "impressions", "clicks", "revenue", "version")


@pytest.fixture
def backend() -> Iterator[ChdbBackend]:
    b = ChdbBackend(f"arms_{uuid.uuid4().hex[:6]}")
    apply_migrations(b)
    yield b
    b.execute(f"DROP DATABASE IF EXISTS {b.database}")
    b.close()


def test_ctr_and_band_by_hand(backend: ChdbBackend) -> None:
    from datetime import UTC, datetime

    hour = datetime.fromtimestamp(H, UTC).replace(tzinfo=None)
    backend.insert("ab_rollup_hourly", COLS, [
        (hour, "learning", "feed", "u1", 2, 3, 1, 0.5, 1),
        (hour, "learning", "search", "u1", 1, 1, 0, 0.0, 1),  # u1 over both slots: 4 impressions, 1 click
        (hour, "learning", "feed", "u2", 2, 6, 0, 0.0, 1),
        (hour, "learning", "feed", "u2", 2, 6, 6, 0.0, 0),  # an older refresh of the same key: replaced
        (hour, "control", "feed", "u3", 1, 5, 1, 1.0, 1),
    ])  # fmt: skip
    got = ab_ctr(backend, q.Window(H, H + 1800, 60))
    traces = {t["name"]: t for t in got["figure"]["data"]}
    assert list(traces) == ["learning upper", "learning 95 % band", "learning", "control upper",
                            "control 95 % band", "control"]  # fmt: skip
    # learning: CTR 1/10; y − R·x = [0.6, −0.6] → se = √(0.72 / 50) = 0.12 → ± 1.96 · 12 %
    assert traces["learning"]["y"] == pytest.approx([10.0])
    half = 1.959964 * 12.0
    assert traces["learning"]["error_y"]["array"] == pytest.approx([half], rel=1e-6)
    assert traces["learning upper"]["y"] == pytest.approx([10.0 + half], rel=1e-6)
    assert traces["learning 95 % band"]["y"] == pytest.approx([10.0 - half], rel=1e-6)
    assert traces["learning"]["customdata"] == [[2, 10, 1]]
    # control: one user, no interval (no band, no error bar)
    assert traces["control"]["y"] == pytest.approx([20.0])
    assert traces["control upper"]["y"] == [None] and traces["control"]["error_y"]["array"] == [0.0]
    assert traces["learning"]["x"] == ["2026-01-01 00:00:00"]


def test_no_rollup_rows_is_an_empty_panel_saying_why(backend: ChdbBackend) -> None:
    got = ab_ctr(backend, q.Window(H, H + 3600, 60))
    assert got["figure"] is None and "no A/B rollup rows" in got["empty"]
    assert "ab_ctr" in panels.PANEL_IDS


def _grafana_sql() -> str:
    import json
    from pathlib import Path

    dashboard = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "dashboards" / "adstream.json"
    (panel,) = [p for p in json.loads(dashboard.read_text())["panels"] if "CTR per arm" in p["title"]]
    sql: str = panel["targets"][0]["rawSql"]
    return sql


def test_grafana_panel_is_the_dashboards_statement() -> None:
    from attribution.ab_rollups import HOURLY_CTR_SQL

    inner = HOURLY_CTR_SQL.strip().replace(
        "hour >= toDateTime(%(since)s) AND hour < toDateTime(%(until)s)\n"
        "          AND (%(slot)s = '' OR slot = %(slot)s)",
        "$__timeFilter(hour)",
    )
    inner = inner.replace("SELECT hour, arm,", "SELECT hour AS time, arm,", 1).replace(
        "ORDER BY hour, arm", ""
    )
    want = (
        "SELECT time, arm, ctr, ctr - half_width AS ctr_low, ctr + half_width AS ctr_high\nFROM (\n"
        + inner.rstrip()
        + "\n)\nORDER BY time, arm"
    )
    assert _grafana_sql() == want


def test_grafana_panel_bounds_by_hand(backend: ChdbBackend) -> None:
    from datetime import UTC, datetime

    hour = datetime.fromtimestamp(H, UTC).replace(tzinfo=None)
    backend.insert("ab_rollup_hourly", COLS, [
        (hour, "learning", "feed", "u1", 2, 4, 1, 0.5, 1), (hour, "learning", "feed", "u2", 2, 6, 0, 0.0, 1),
    ])  # fmt: skip
    sql = _grafana_sql().replace(
        "$__timeFilter(hour)", f"hour >= toDateTime({H}) AND hour <= toDateTime({H + 60})"
    )
    ((t, arm, ctr, lo, hi),) = backend.execute(sql)
    assert (t, arm) == ("2026-01-01 00:00:00", "learning")
    assert (ctr, lo, hi) == pytest.approx((0.1, 0.1 - 1.959964 * 0.12, 0.1 + 1.959964 * 0.12), rel=1e-6)
