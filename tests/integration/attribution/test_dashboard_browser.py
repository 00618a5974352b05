"""The dashboard page in headless Chromium (Debian's, through Playwright): seeded ClickHouse,
no console errors, no request leaving the machine, every chart drawn with data; a screenshot.

An empty database gives the page's "no data" state on every panel, not an error.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_dashboard_sql import _database, insert_rows, seed_ab_rollup, seeded_rows, server_backend, store_run

from attribution.dashboard import panels
from schemas.settings import Settings

pytestmark = [pytest.mark.clickhouse, pytest.mark.timeout(120)]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "dashboard.png"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """The dashboard app on a free loopback port in a thread (uvicorn, as `adstream dashboard`)."""

    def __init__(self, settings: Settings) -> None:
        import uvicorn

        from attribution.dashboard.app import create_app

        self.port = _free_port()
        config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the dashboard server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (deploy/install.sh)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        # one context for the module: plotly.min.js (4.6 MB, cacheable) is fetched once
        context = chromium.new_context(viewport={"width": 1400, "height": 900})
        yield context
        context.close()
        chromium.close()


def _open(browser: Any, url: str) -> tuple[Any, list[str], list[str]]:
    """A page loaded until the script says it is done; console errors and off-machine requests."""
    page = browser.new_page()
    errors: list[str] = []
    outside: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))

    def only_local(route: Any) -> None:
        if route.request.url.startswith("http://127.0.0.1:"):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", only_local)
    page.goto(url)
    page.wait_for_selector("body[data-ready]", timeout=60_000)  # a ceiling for a loaded machine
    return page, errors, outside


@pytest.fixture(scope="module")
def seeded(stack: Settings) -> Iterator[Served]:
    """The dashboard serving a database of seeded events and one attribution run."""
    settings = _database(stack, "web")
    gen = server_backend(settings)
    backend = next(gen)
    rows = seeded_rows(4000)
    insert_rows(backend, rows)
    seed_ab_rollup(backend, rows)
    lo, hi = panels.data_bounds(backend)  # type: ignore[misc]
    store_run(backend, lo, hi + 1, bootstrap=10)
    with Served(settings) as served:
        yield served
    gen.close()


def test_every_chart_has_data_and_no_console_errors(browser: Any, seeded: Served) -> None:
    page, errors, outside = _open(browser, seeded.url)
    assert page.evaluate("document.body.dataset.ready") == "1"
    assert errors == [] and outside == []
    states = page.eval_on_selector_all("section.panel", "els => els.map(e => [e.id, e.dataset.state])")
    assert states == [[f"panel-{pid}", "data"] for pid in panels.PANEL_IDS]
    points = page.eval_on_selector_all(
        "div.plot",
        """els => els.map(el => [el.id, el.querySelector('svg.main-svg') !== null,
             (el.data || []).map(t => (t.type === "table" ? t.cells.values[0] : (t.y || []))
                                      .filter(v => v !== null && v !== undefined).length)])""",
    )
    assert [p[0] for p in points] == [f"plot-{pid}" for pid in panels.PANEL_IDS]
    for pid, drawn, per_trace in points:
        assert drawn, f"{pid} has no rendered svg"
        assert per_trace and all(n > 0 for n in per_trace), f"{pid}: points per trace {per_trace}"
    assert "database " in page.inner_text("#status")
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    assert SCREENSHOT.stat().st_size > 50_000
    page.close()


def test_a_bad_window_is_a_clear_error_on_the_page(browser: Any, seeded: Served) -> None:
    page, _, outside = _open(browser, seeded.url + "?since=2026-01-02&until=2026-01-01")
    assert outside == []
    assert page.evaluate("document.body.dataset.ready") == "error"
    assert "must be after since=" in page.inner_text("#status")
    page.close()
    page, _, _ = _open(browser, seeded.url + "?bucket=abc")
    assert page.evaluate("document.body.dataset.ready") == "error"
    assert page.inner_text("#status").startswith('bucket="abc": ')
    page.close()


def test_an_empty_database_shows_no_data_everywhere(browser: Any, stack: Settings) -> None:
    settings = _database(stack, "webempty")
    gen = server_backend(settings)
    next(gen)
    try:
        with Served(settings) as served:
            page, errors, outside = _open(browser, served.url)
            assert errors == [] and outside == []
            assert page.get_attribute("#status", "class") == "no-data"
            assert "no events" in page.inner_text("#status")
            states = page.eval_on_selector_all("section.panel", "els => els.map(e => e.dataset.state)")
            assert states == ["empty"] * len(panels.PANEL_IDS)
            assert page.locator("p.note.empty").count() == len(panels.PANEL_IDS)
            assert page.evaluate("typeof window.Plotly") == "undefined"  # loaded only to draw
            page.close()
    finally:
        gen.close()
