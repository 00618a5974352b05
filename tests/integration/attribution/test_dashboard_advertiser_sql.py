"""The page's advertiser view (attribution.dashboard.advertiser) on ClickHouse 18.16 and chDB:
every statement runs with its filters bound (one advertiser, its campaigns, or all), the engines
agree, the filters filter, and the panels have data from the hourly rollups."""

from __future__ import annotations

from typing import Any

import pytest
from test_dashboard_sql import _close, engines, rows  # noqa: F401 (module-scoped fixtures)
from test_grafana_sql import _comparable

from attribution.dashboard import advertiser, panels
from attribution.dashboard import queries as q
from attribution.rollups import refresh_rollups
from attribution.sql import Backend

pytestmark = [pytest.mark.clickhouse, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def rolled(engines: dict[str, Backend]) -> dict[str, Backend]:  # noqa: F811
    for backend in engines.values():
        lo, hi = panels.data_bounds(backend)  # type: ignore[misc]
        refresh_rollups(backend, lo, hi + 1)
    return engines


def _window(backend: Backend, view: q.View) -> q.Window:
    return q.resolve(panels.data_bounds(backend), view=view)


def test_every_statement_filters_alike_on_both_engines(rolled: dict[str, Backend]) -> None:
    choices = advertiser.filter_choices(rolled["clickhouse"])
    assert choices == advertiser.filter_choices(rolled["chdb"]) and len(choices) >= 2
    first, campaigns = next(iter(choices.items()))
    views = {
        "all": q.View("advertiser"),
        "one advertiser": q.View("advertiser", (first,)),
        "one campaign": q.View("advertiser", (first,), tuple(campaigns[:1])),
    }
    for label, view in views.items():
        got: dict[str, dict[str, list[tuple[Any, ...]]]] = {}
        for name, backend in rolled.items():
            params = advertiser.params(_window(backend, view))
            got[name] = {k: backend.execute(sql, params) for k, sql in advertiser.QUERIES.items()}
            totals = {str(r[0]) for r in got[name]["adv_totals"]}
            assert totals, (label, name)
            allowed = set(view.campaigns) or (
                set(campaigns) if view.advertisers else {c for cs in choices.values() for c in cs}
            )
            assert totals <= allowed, (label, name, totals - allowed)
        for k in advertiser.QUERIES:
            server, embedded = (_comparable(got[e][k]) for e in ("clickhouse", "chdb"))
            _close(server, embedded, f"{label}: {k}")


def test_the_advertiser_panels_have_data(rolled: dict[str, Backend]) -> None:
    for backend in rolled.values():
        first = next(iter(advertiser.filter_choices(backend)))
        built = panels.build(backend, _window(backend, q.View("advertiser", (first,), (), "EUR")))
        assert [p["id"] for p in built] == list(panels.ADVERTISER_PANEL_IDS)
        for p in built:
            assert p["figure"] is not None, p
            assert "EUR" in p["title"]
