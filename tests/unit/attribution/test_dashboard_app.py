"""The dashboard app on chDB (embedded ClickHouse, no service): routes, assets, errors, states."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from attribution.dashboard import panels
from attribution.dashboard.app import STATIC, create_app, plotly_js
from attribution.migrate import apply_migrations
from attribution.rollups import refresh_rollups
from attribution.sql import ChdbBackend
from schemas.settings import Settings

T0 = 1767225600  # 2026-01-01T00:00:00Z
IMPRESSION_COLS = ("event_id", "ts", "ts_ms", "user_id", "request_id", "ad_id", "campaign_id",
                   "advertiser_id", "slot", "position", "price", "pctr", "model_version", "adapter_version",
                   "kafka_partition", "kafka_offset")  # fmt: skip


class SharedChdb(ChdbBackend):
    """One in-memory chDB engine for a whole test: the app's per-request close leaves it open
    (an in-memory chDB session forgets its tables when closed)."""

    def close(self) -> None:
        pass

    def really_close(self) -> None:
        super().close()


@pytest.fixture
def backend() -> Iterator[SharedChdb]:
    name = f"dash_app_{uuid.uuid4().hex[:8]}"
    shared = SharedChdb(name)
    apply_migrations(shared)
    yield shared
    shared.execute(f"DROP DATABASE IF EXISTS {name}")
    shared.really_close()


def _client(backend: SharedChdb) -> TestClient:
    settings = Settings(clickhouse={"url": f"clickhouse://default@127.0.0.1:9000/{backend.database}"})
    return TestClient(create_app(settings, connect=lambda: backend))


def _seed(backend: SharedChdb) -> None:
    rows = []
    for i in range(40):
        slot = ("feed", "search")[i % 2]
        rows.append((f"i{i}", T0 + 60 * i, (T0 + 60 * i) * 1000, f"u{i % 7}", f"r{i}", "ad1", f"c{i % 3}",
                     "adv1", slot, 0, 0.5, 0.01 * (i % 10), "m1", ("v1", "v2")[i // 20], 0, i))  # fmt: skip
    backend.insert("impressions", IMPRESSION_COLS, rows)
    clicks = [(f"k{i}", T0 + 60 * i + 5, (T0 + 60 * i + 5) * 1000, f"u{i % 7}", f"i{i}", "ad1",
               f"c{i % 3}", 0, i) for i in range(0, 40, 4)]  # fmt: skip
    backend.insert(
        "clicks",
        (
            "event_id",
            "ts",
            "ts_ms",
            "user_id",
            "impression_id",
            "ad_id",
            "campaign_id",
            "kafka_partition",
            "kafka_offset",
        ),
        clicks,
    )
    # the spend panels read the hourly rollups (the scheduler refreshes them)
    refresh_rollups(backend, T0, T0 + 3600)


def test_page_and_assets_are_served_locally(backend: SharedChdb) -> None:
    client = _client(backend)
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    js = client.get("/static/plotly.min.js")
    assert js.status_code == 200 and js.content == plotly_js().read_bytes()
    for name in ("dashboard.js", "dashboard.css"):
        assert client.get(f"/static/{name}").status_code == 200
    assert "default-src 'self'" in page.headers["content-security-policy"]  # the browser enforces it
    assert client.get("/static/../app.py").status_code == 404
    assert client.get("/static/secrets.txt").status_code == 404


def test_nothing_is_loaded_from_another_host() -> None:
    for path in STATIC.iterdir():
        text = path.read_text()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), (
            f"{path.name} names a remote URL"
        )


def test_the_page_is_read_only() -> None:
    app = create_app(Settings())
    methods = {m for route in app.routes for m in getattr(route, "methods", set())}
    assert methods <= {"GET", "HEAD"}


def test_panels_on_seeded_data(backend: SharedChdb) -> None:
    _seed(backend)
    body = _client(backend).get("/api/panels").json()
    assert body["no_data"] is False and body["database"] == backend.database
    assert body["window"]["since"] == "2026-01-01 00:00:00"
    got = {p["id"]: p for p in body["panels"]}
    assert list(got) == list(panels.PANEL_IDS)
    for pid in ("event_rates", "ctr", "pacing", "spend_budget", "cpa_roas", "adapter_versions", "online_auc"):
        assert got[pid]["figure"] is not None, (pid, got[pid])
    ctr = {t["name"]: t for t in got["ctr"]["figure"]["data"]}
    # feed is the even i (c0: i0, i6, …, i36 = 7; c1: i4 … i34 = 6; c2: i2 … i38 = 7); clicks are
    # on i0, i4, …, i36: c0 gets i0, i12, i24, i36; c1 i4, i16, i28; c2 i8, i20, i32
    assert ctr["search"]["y"] == [0.0, 0.0, 0.0]
    feed = dict(zip(ctr["feed"]["x"], ctr["feed"]["customdata"], strict=True))
    assert feed == {"c0": [7, 4], "c1": [6, 3], "c2": [7, 3]}
    assert "no attribution run" in got["model_comparison"]["empty"]


def test_empty_database_is_a_no_data_state(backend: SharedChdb) -> None:
    body = _client(backend).get("/api/panels").json()
    assert body["no_data"] is True and "no events" in body["message"]
    assert all(p["figure"] is None and p["empty"] and p["error"] is None for p in body["panels"])


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("since=2026-01-02&until=2026-01-01", "must be after since="),
        ("since=tomorrow", "since='tomorrow' is neither epoch seconds nor an ISO 8601 time"),
        ("bucket=0", "bucket=0 must be between"),
        ("top=1000", "top=1000 must be between 1 and 100"),
        ("since=inf", "since='inf' is neither epoch seconds nor an ISO 8601 time"),
    ],
)
def test_bad_parameters_are_400_with_the_value_named(backend: SharedChdb, query: str, message: str) -> None:
    response = _client(backend).get(f"/api/panels?{query}")
    assert response.status_code == 400 and message in response.json()["error"]


def test_missing_tables_are_named_not_a_crash() -> None:
    bare = SharedChdb(f"dash_bare_{uuid.uuid4().hex[:8]}")  # a database without the migrations
    try:
        response = _client(bare).get("/api/panels")
        assert response.status_code == 503
        assert "impressions" in response.json()["error"]
    finally:
        bare.execute(f"DROP DATABASE IF EXISTS {bare.database}")
        bare.really_close()


def test_an_unreachable_clickhouse_is_503_naming_where_without_credentials() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = Settings(clickhouse={"url": f"clickhouse://reader:s3cret@127.0.0.1:{port}/adstream"})
    client = TestClient(create_app(settings))
    response = client.get("/api/panels")
    assert response.status_code == 503
    error = response.json()["error"]
    assert f"127.0.0.1:{port}/adstream" in error and "s3cret" not in error
    assert client.get("/healthz").status_code == 503


def test_static_folder_holds_only_the_page_files() -> None:
    assert sorted(p.name for p in STATIC.iterdir()) == ["dashboard.css", "dashboard.js", "index.html"]
    assert Path(plotly_js()).stat().st_size > 1_000_000  # the full bundle, not a stub


def test_a_non_integer_bucket_is_a_422_naming_the_parameter(backend: SharedChdb) -> None:
    response = _client(backend).get("/api/panels?bucket=abc")
    assert response.status_code == 422
    (detail,) = response.json()["detail"]
    assert detail["loc"][-1] == "bucket" and detail["input"] == "abc"  # what the page shows
