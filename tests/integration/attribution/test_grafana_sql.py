"""Every Grafana panel's SQL, its macros expanded as grafana-clickhouse-datasource expands them,
on seeded events in ClickHouse 18.16 (the server) and current ClickHouse (chDB): it runs, gives
rows, the same rows on both, and time-series panels lead with a DateTime column.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from test_dashboard_sql import _close, engines, rows  # noqa: F401 (module-scoped fixtures)

from attribution.dashboard import panels
from attribution.sql import Backend

pytestmark = [pytest.mark.clickhouse, pytest.mark.timeout(180)]

# Columns each engine has its own values in: a run's id and creation time, and what is drawn from
# its bootstrap, which depends on the order an engine returns the paths in (attribution.paths):
# the engines agree on the point estimates.
ENGINE_SPECIFIC = {"run_id", "created_at", "conversions_ci_low", "conversions_ci_high", "confidence"}
DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "dashboards" / "adstream.json"


def expand(sql: str, start: int, end: int, interval_s: float) -> str:
    """The plugin's macros (pkg/macros of grafana/clickhouse-datasource) for a time range in epoch
    seconds and the panel's interval: $__timeFilter(col), $__fromTime, $__toTime, $__interval_s.
    Anything else starting with `$` is left in place (and fails the test)."""

    def time_filter(m: re.Match[str]) -> str:
        column = m.group(1).strip()
        return f"{column} >= toDateTime({start}) AND {column} <= toDateTime({end})"

    out = re.sub(r"\$__timeFilter\(([^)]*)\)", time_filter, sql)
    out = re.sub(r"\$__fromTime\b(\(\))?", f"toDateTime({start})", out)
    out = re.sub(r"\$__toTime\b(\(\))?", f"toDateTime({end})", out)
    return re.sub(r"\$__interval_s\b(\(\))?", str(max(int(interval_s), 1)), out)


def grafana_targets() -> list[tuple[str, str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], p["type"], t["rawSql"]) for p in dashboard["panels"] for t in p["targets"]]


def test_expand_matches_the_plugins_forms() -> None:
    got = expand("WHERE $__timeFilter(ts) AND x < $__toTime GROUP BY $__interval_s", 10, 20, 0.4)
    assert got == "WHERE ts >= toDateTime(10) AND ts <= toDateTime(20) AND x < toDateTime(20) GROUP BY 1"


@pytest.mark.parametrize(("title", "kind", "sql"), grafana_targets(), ids=lambda v: str(v)[:40])
@pytest.mark.parametrize("interval_s", [60, 900])
def test_panel_sql_runs_on_both_engines_alike(
    title: str,
    kind: str,
    sql: str,
    interval_s: int,
    engines: dict[str, Backend],  # noqa: F811
) -> None:
    lo, hi = panels.data_bounds(engines["clickhouse"])  # type: ignore[misc]
    query = expand(sql, lo, hi + 1, interval_s)
    assert "$" not in query, f"{title}: an unexpanded macro in {query}"
    assert "toStartOfInterval" not in query and "$__timeInterval" not in sql  # 18.16 lacks it
    results = {name: backend.execute(query) for name, backend in engines.items()}
    assert results["clickhouse"], f"{title}: no rows on seeded data"
    client: Any = engines["clickhouse"].client  # type: ignore[attr-defined]
    _, columns = client.execute(query, with_column_types=True)
    keep = [i for i, (column, _) in enumerate(columns) if column not in ENGINE_SPECIFIC]
    server, embedded = ([tuple(r[i] for i in keep) for r in results[e]] for e in ("clickhouse", "chdb"))
    _close(_comparable(server), _comparable(embedded), title)
    if kind == "timeseries":
        assert columns[0][1] == "DateTime", f"{title}: the time column is {columns[0]}"


def _comparable(result: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Rows with times as 'YYYY-MM-DD hh:mm:ss' (chDB's JSON gives strings, the driver datetimes)."""
    return [
        tuple(v.strftime("%Y-%m-%d %H:%M:%S") if hasattr(v, "strftime") else v for v in r) for r in result
    ]
