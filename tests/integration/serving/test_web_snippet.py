"""The web snippet (`GET /adstream.js`) in headless Chromium against the real Serve app, broker,
streams worker and ClickHouse: a publisher page on another origin (CORS) shows the ads; an ad in
view sends one view, an ad below the fold none until scrolled to; two clicks send one click; each
reaches ClickHouse once (the view as the render beacon that makes the served ad an impression, in
`views`)."""

from __future__ import annotations

import contextlib
import http.server
import json
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from schemas.clients import clickhouse_client, clickhouse_database
from schemas.settings import Settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "streams"))  # the worker helpers
from streams_it import Worker, free_port, wait_for

pytestmark = [
    pytest.mark.ray,
    pytest.mark.redis,
    pytest.mark.kafka,
    pytest.mark.clickhouse,
    pytest.mark.timeout(300),
]
CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>publisher</title></head>
<body style="margin:0">
<div id="ads"></div>
<script src="%(endpoint)s/adstream.js"></script>
<script>
  window.beacons = [];
  window.loaded = AdStream.load({
    endpoint: "%(endpoint)s", userId: %(user)s, slot: "feed", k: 2, container: "#ads", viewMs: 300,
    render: function (ad, el) { el.textContent = ad.ad_id; el.style.height = "700px"; },
    onBeacon: function (ev, status) {
      window.beacons.push({kind: ev.kind, id: ev.event_id, status: status});
    },
  }).then(function (r) { window.response = r; return r.ads.length; });
</script>
</body></html>
"""


@pytest.fixture
def worker(serve_settings: Settings, tmp_path: Path) -> Iterator[Worker]:
    """The streams worker on the Serve app's topics and the session's ClickHouse database."""
    s = serve_settings.model_copy(
        update={
            "metrics": serve_settings.metrics.model_copy(update={"port": free_port()}),
            "sink": serve_settings.sink.model_copy(update={"flush_s": 0.3}),
        }
    )
    from attribution.migrate import migrate

    migrate(s)  # the worker migrates too, as it starts: the tables are there before it is up
    w = Worker(s, tmp_path / "worker.log", "aiokafka")
    w.start()
    try:
        yield w
    finally:
        w.stop()


@contextlib.contextmanager
def page_server(origin: str, html: str) -> Iterator[None]:
    """An HTTP server at `origin` answering every GET with `html` (the publisher's site)."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = html.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    host, port = origin.removeprefix("http://").split(":")
    srv = http.server.ThreadingHTTPServer((host, int(port)), Page)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        srv.shutdown()
        srv.server_close()


def beacons(page, kind: str) -> list[dict[str, object]]:  # type: ignore[no-untyped-def]
    return [b for b in page.evaluate("window.beacons") if b["kind"] == kind]


def counts(s: Settings, table: str, ids: list[str]) -> dict[str, int]:
    db = clickhouse_client(s, clickhouse_database(s))
    try:
        rows = db.execute(
            f"SELECT event_id, count() FROM {table} WHERE event_id IN %(ids)s GROUP BY event_id",
            {"ids": tuple(ids)},
        )
    finally:
        db.disconnect()
    return {str(e): int(n) for e, n in rows}


def spend_today(s: Settings) -> dict[str, float]:
    """The day's billed spend per campaign (`schemas.billing`) in Redis."""
    import redis

    from schemas.billing import day_of, spend_key

    r = redis.Redis.from_url(s.redis.url)
    try:
        raw = r.hgetall(spend_key(s.redis_prefix, day_of(time.time())))
    finally:
        r.close()
    return {k.decode(): float(v) for k, v in raw.items()}


def test_snippet_shows_ads_and_its_view_and_click_reach_clickhouse_once(
    server: httpx.Client, serve_settings: Settings, worker: Worker
) -> None:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (deploy/install.sh)")
    from playwright.sync_api import sync_playwright

    user = f"u-web-{uuid.uuid4().hex[:8]}"
    base = str(server.base_url).rstrip("/")
    # the publisher's page on another origin (loopback: Chromium refuses public → loopback calls)
    publisher = serve_settings.collector.cors_origins[0]
    with page_server(publisher, PAGE % {"user": json.dumps(user), "endpoint": base}), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            page = browser.new_context(viewport={"width": 800, "height": 600}).new_page()
            console: list[str] = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"error: {e}"))
            page.on("requestfailed", lambda r: console.append(f"failed: {r.url} {r.failure}"))
            page.goto(f"{publisher}/article.html")
            assert page.evaluate("window.loaded") == 2, console
            shown = page.locator(".adstream-ad")
            assert shown.count() == 2
            resp = page.evaluate("window.response")
            iids = [f"{resp['request_id']}/{i}" for i in range(2)]
            assert shown.nth(0).inner_text() == resp["ads"][0]["ad_id"]

            page.wait_for_function("window.beacons.filter(b => b.kind === 'view').length >= 1")
            shown.nth(0).click()
            shown.nth(0).click()  # a second click on the same ad: no second beacon
            page.wait_for_function("window.beacons.filter(b => b.kind === 'click').length >= 1")
            # the first ad was viewed and clicked; the second, below the fold, not viewed yet
            assert beacons(page, "view") == [{"kind": "view", "id": f"v/{iids[0]}", "status": 200}]
            assert beacons(page, "click") == [{"kind": "click", "id": f"c/{iids[0]}", "status": 200}]
            shown.nth(1).scroll_into_view_if_needed()
            page.wait_for_function("window.beacons.filter(b => b.kind === 'view').length >= 2")
            assert [b["id"] for b in beacons(page, "view")] == [f"v/{i}" for i in iids]
            assert len(beacons(page, "click")) == 1
        finally:
            browser.close()

    views, clicks = [f"v/{i}" for i in iids], [f"c/{iids[0]}"]
    wait_for(
        lambda: len(counts(serve_settings, "views", views)) == 2 and counts(serve_settings, "clicks", clicks),
        120,
        "the view and click events in ClickHouse",
        worker,
    )
    assert counts(serve_settings, "views", views) == dict.fromkeys(views, 1)
    assert counts(serve_settings, "clicks", clicks) == dict.fromkeys(clicks, 1)
    # billed when the worker committed: the clicked ad's campaign (CPC, the default) pays the
    # ad's price for its click (other tests of the session may have clicked its ads too)
    clicked = resp["ads"][0]
    assert spend_today(serve_settings).get(clicked["campaign_id"], 0.0) >= clicked["price"] - 1e-9
