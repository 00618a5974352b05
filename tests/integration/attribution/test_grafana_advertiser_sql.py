"""The advertiser dashboard (deploy/grafana/dashboards/advertiser.json): its template variables and
every panel's SQL, macros and variables expanded as grafana-clickhouse-datasource expands them, on
seeded events rolled up hourly, on ClickHouse 18.16 (the server) and chDB: it runs, the engines
agree, the filters filter, and the numbers are the rollups' (the counts behind every rate)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from test_dashboard_sql import _close, engines, rows  # noqa: F401 (module-scoped fixtures)
from test_grafana_sql import _comparable, expand

from attribution.dashboard import panels
from attribution.rollups import refresh_rollups
from attribution.sql import Backend

pytestmark = [pytest.mark.clickhouse, pytest.mark.timeout(180)]

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "dashboards" / "advertiser.json"
RAW = ("impressions", "clicks", "dwell", "conversions")


def variables(sql: str, values: dict[str, list[str]]) -> str:
    """`${name:singlequote}` as Grafana formats a multi-value variable: 'a','b'."""

    def one(m: re.Match[str]) -> str:
        return ",".join("'" + v.replace("'", "\\'") + "'" for v in values[m.group(1)])

    return re.sub(r"\$\{(\w+):singlequote\}", one, sql)


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def rolled(engines: dict[str, Backend]) -> dict[str, Backend]:  # noqa: F811
    for backend in engines.values():
        lo, hi = panels.data_bounds(backend)  # type: ignore[misc]
        refresh_rollups(backend, lo, hi + 1)
    return engines


def _run(backend: Backend, sql: str, values: dict[str, list[str]]) -> list[tuple[Any, ...]]:
    lo, hi = panels.data_bounds(backend)  # type: ignore[misc]
    query = variables(expand(sql, lo, hi + 3600, 3600), values)
    assert "$" not in query, query
    return backend.execute(query)


def test_no_panel_reads_a_raw_event_table() -> None:
    for p in _dashboard()["panels"]:
        for t in p["targets"]:
            tables = set(re.findall(r"FROM\s+(\w+)", t["rawSql"]))
            assert tables <= {"rollup_hourly", "ads"}, (p["title"], tables)
            assert not tables & set(RAW)


def test_variables_and_panels_filter_by_advertiser_and_campaign(rolled: dict[str, Backend]) -> None:
    dash = _dashboard()
    var = {v["name"]: v for v in dash["templating"]["list"]}
    assert set(var) == {"advertiser", "campaign", "currency"}
    results: dict[str, dict[str, list[tuple[Any, ...]]]] = {}
    for name, backend in rolled.items():
        advertisers = [r[0] for r in backend.execute(var["advertiser"]["query"])]
        assert len(advertisers) >= 2
        one = {"advertiser": advertisers[:1]}
        campaigns = [r[0] for r in backend.execute(variables(var["campaign"]["query"], one))]
        every = {"advertiser": advertisers}
        all_campaigns = [r[0] for r in backend.execute(variables(var["campaign"]["query"], every))]
        assert campaigns and set(campaigns) < set(all_campaigns)
        values = {"advertiser": advertisers[:1], "campaign": campaigns}
        results[name] = {p["title"]: _run(backend, p["targets"][0]["rawSql"], values) for p in dash["panels"]}
        # CTR and CPA/ROAS: the filtered campaigns only, the counts behind each rate beside it
        (ctr,) = [rs for t, rs in results[name].items() if t.startswith("CTR")]
        assert {r[0] for r in ctr} <= set(campaigns)
        for _, imps, clicks, rate in ctr:
            assert rate == pytest.approx(clicks / imps if imps else 0.0)
        (econ,) = [rs for t, rs in results[name].items() if t.startswith("CPA")]
        for _, spend, conv, value, cpa, roas in econ:
            assert cpa == pytest.approx(spend / conv if conv else 0.0)
            assert roas == pytest.approx(value / spend if spend else 0.0)
    for title in results["clickhouse"]:
        server, embedded = (_comparable(results[e][title]) for e in ("clickhouse", "chdb"))
        _close(server, embedded, title)


def test_the_rollup_numbers_are_the_raw_tables(rolled: dict[str, Backend]) -> None:
    backend = rolled["clickhouse"]
    adv = backend.execute("SELECT DISTINCT advertiser_id FROM rollup_hourly WHERE advertiser_id != ''")
    values = {"advertiser": [r[0] for r in adv], "campaign": []}
    values["campaign"] = [r[0] for r in backend.execute("SELECT DISTINCT campaign_id FROM rollup_hourly")]
    (p,) = [p for p in _dashboard()["panels"] if p["title"].startswith("CTR")]
    got = {r[0]: r[1] for r in _run(backend, p["targets"][0]["rawSql"], values)}
    # the shown impressions (migration 010): server-rendered (or from before render beacons) at
    # once, client-rendered with a view
    raw = backend.execute(
        "SELECT campaign_id, count() FROM impressions FINAL WHERE ad_id != '__holdout__'"
        " AND (ifNull(render, '') != 'client' OR event_id IN (SELECT impression_id FROM views))"
        " GROUP BY campaign_id"
    )
    assert got == {c: n for c, n in raw}
