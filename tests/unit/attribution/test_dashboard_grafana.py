"""Grafana provisioning and dashboard JSON, checked structurally (no Grafana needed).

The SQL itself is executed on ClickHouse 18.16 and chDB by
tests/integration/attribution/test_grafana_sql.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

GRAFANA = Path(__file__).resolve().parents[3] / "deploy" / "grafana"
PLUGIN = "grafana-clickhouse-datasource"
PANEL_TYPES = {"timeseries": ("timeseries", 0), "table": ("table", 1)}  # queryType, format
# the plugin's macros (pkg/macros); $__timeInterval expands to toStartOfInterval, which 18.16 lacks
MACROS = {"$__timeFilter", "$__fromTime", "$__toTime", "$__interval_s"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads((GRAFANA / "dashboards" / "adstream.json").read_text())


@pytest.fixture(scope="module")
def datasource() -> dict[str, Any]:
    doc = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "clickhouse.yaml").read_text())
    assert doc["apiVersion"] == 1 and len(doc["datasources"]) == 1
    return doc["datasources"][0]


def test_datasource_is_the_clickhouse_plugin_on_the_adstream_database(datasource: dict[str, Any]) -> None:
    assert datasource["type"] == PLUGIN
    assert datasource["uid"] and datasource["name"]
    data = datasource["jsonData"]
    assert data["protocol"] in {"native", "http"}
    assert isinstance(data["port"], int) and data["host"]
    assert data["defaultDatabase"] == "adstream"  # Settings' default clickhouse_url database
    assert "password" not in data, "a password belongs in secureJsonData"


def test_dashboards_provider_loads_files_from_the_mounted_folder() -> None:
    doc = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "adstream.yaml").read_text())
    assert doc["apiVersion"] == 1
    (provider,) = doc["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
    assert provider["allowUiUpdates"] is False  # the JSON in the repository is the source of truth


def test_dashboard_top_level(dashboard: dict[str, Any]) -> None:
    for key, kind in {"uid": str, "title": str, "schemaVersion": int, "panels": list, "time": dict}.items():
        assert isinstance(dashboard[key], kind), key
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dashboard["uid"])
    assert "id" not in dashboard or dashboard["id"] is None  # provisioned dashboards carry no db id
    assert dashboard["timezone"] == "utc"


def test_panels_have_ids_types_and_a_grid_without_overlaps(dashboard: dict[str, Any]) -> None:
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        assert p["type"] in PANEL_TYPES, p["title"]
        g = p["gridPos"]
        assert all(isinstance(g[k], int) and g[k] >= 0 for k in ("x", "y", "w", "h")), p["title"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine


def test_every_target_is_sql_on_the_provisioned_datasource(
    dashboard: dict[str, Any], datasource: dict[str, Any]
) -> None:
    for p in dashboard["panels"]:
        assert p["datasource"] == {"type": PLUGIN, "uid": datasource["uid"]}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(set(refs)) == len(refs), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"], p["title"]
            assert t["editorType"] == "sql" and t["rawSql"].strip(), p["title"]
            assert (t["queryType"], t["format"]) == PANEL_TYPES[p["type"]], p["title"]


def test_sql_uses_only_macros_the_plugin_expands_and_18_16_accepts(dashboard: dict[str, Any]) -> None:
    for p in dashboard["panels"]:
        for t in p["targets"]:
            sql = t["rawSql"]
            used = set(re.findall(r"\$__\w+", sql))
            assert used <= MACROS, f"{p['title']}: {used - MACROS}"
            assert not re.search(r"\$(?!__)", sql), (
                f"{p['title']}: a template variable Grafana may not define"
            )
            assert "toStartOfInterval" not in sql and not re.search(r"\bOVER\s*\(", sql), p["title"]
            assert ";" not in sql, f"{p['title']}: one statement per target"
            reads_events = re.search(r"\bFROM (impressions|clicks|dwell|conversions)\b", sql)
            if reads_events:  # raw events: time-filtered, and deduplicated (ReplacingMergeTree)
                assert "$__timeFilter(ts)" in sql, p["title"]
                for table in re.findall(
                    r"\bFROM (impressions|clicks|dwell|conversions|ads)\b(?! FINAL)", sql
                ):
                    pytest.fail(f"{p['title']}: {table} read without FINAL")
            if p["type"] == "timeseries":
                assert re.match(
                    r"\s*SELECT\s+(toDateTime\(intDiv\(toUInt32\(ts\), \$__interval_s\)|time\b)", sql
                ), f"{p['title']}: a time series starts with its time column"


def test_the_dashboard_covers_what_the_page_shows(dashboard: dict[str, Any]) -> None:
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in (
        "event rates",
        "ctr",
        "pacing",
        "cpa",
        "roas",
        "model comparison",
        "budget moves",
        "auc",
        "adapter",
    ):
        assert topic in titles, topic


def test_served_traffic_panels_leave_holdout_impressions_out(dashboard: dict[str, Any]) -> None:
    from schemas.holdout import HOLDOUT_AD_ID

    for p in dashboard["panels"]:
        sql = p["targets"][0]["rawSql"]
        if re.search(r"\bpctr\b|\bslot\b|adapter_version", sql) and "FROM impressions" in sql:
            assert f"ad_id != '{HOLDOUT_AD_ID}'" in sql, p["title"]


def test_the_advertiser_dashboard_is_apart_from_operations_and_filters_every_panel() -> None:
    adv = json.loads((GRAFANA / "dashboards" / "advertiser.json").read_text())
    ops = json.loads((GRAFANA / "dashboards" / "adstream.json").read_text())
    assert adv["uid"] != ops["uid"] and adv["timezone"] == "utc"
    names = [v["name"] for v in adv["templating"]["list"]]
    assert names == ["advertiser", "campaign", "currency"]
    campaign = adv["templating"]["list"][1]
    assert "${advertiser:singlequote}" in campaign["query"] and campaign["multi"] and campaign["includeAll"]
    for p in adv["panels"]:
        sql = p["targets"][0]["rawSql"]
        assert "${advertiser:singlequote}" in sql and "${campaign:singlequote}" in sql, p["title"]
        assert "$__timeFilter(hour)" in sql and "FROM rollup_hourly FINAL" in sql, p["title"]
        assert "toStartOfInterval" not in sql and "$__timeInterval" not in sql
    money = [p for p in adv["panels"] if "${currency}" in p["title"]]
    assert len(money) >= 2
    assert any("ahead of plan" in p["targets"][0]["rawSql"] for p in adv["panels"])
