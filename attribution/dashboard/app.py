"""The dashboard's FastAPI app: one read-only page, its panels as JSON, and local assets only.

Routes (all GET): `/` the page, `/api/panels` the panels for a window (query parameters
`since`, `until`: ISO 8601 or epoch seconds; `bucket`: seconds; `top`: campaigns per chart;
`run`: an attribution run id), `/healthz`, and `/static/…` (the page's script and style, and
Plotly's `plotly.min.js` as bundled in the installed `plotly` package: no CDN, no network).

Every request opens its own ClickHouse connection with `readonly=2`, so the page can read and
never write, whatever a query says.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.responses import FileResponse, JSONResponse

from attribution.dashboard import advertiser as adv_view
from attribution.dashboard import panels
from attribution.dashboard import queries as q
from attribution.sql import Backend, DriverBackend
from schemas.clients import clickhouse_args, clickhouse_client, clickhouse_database
from schemas.errors import ConfigError, StoreError
from schemas.settings import Settings

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


def plotly_js() -> Path:
    """The `plotly.min.js` shipped inside the installed `plotly` Python package."""
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise ConfigError(f"plotly.min.js not found at {path}: reinstall the `plotly` package")
    return path


def clickhouse_backend(settings: Settings) -> Callable[[], Backend]:
    """A factory of read-only connections to the settings' ClickHouse database."""

    def connect() -> Backend:
        client = clickhouse_client(
            settings, clickhouse_database(settings), settings={"readonly": 2, "max_execution_time": 60}
        )
        return DriverBackend(client)

    return connect


def create_app(settings: Settings, connect: Callable[[], Backend] | None = None) -> FastAPI:
    """The dashboard app reading `settings.clickhouse.url` (or the backends `connect` makes)."""
    connect = connect or clickhouse_backend(settings)
    js = plotly_js()
    app = FastAPI(title="adstream dashboard", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def local_only(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        # the browser itself refuses anything not from this server (Plotly draws with inline styles)
        response = await call_next(request)
        response.headers.update(SECURITY_HEADERS)
        return response

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/static/plotly.min.js", include_in_schema=False)
    def plotly_asset() -> FileResponse:
        return FileResponse(js, media_type="text/javascript", headers={"Cache-Control": "max-age=86400"})

    @app.get("/static/{name}", include_in_schema=False)
    def asset(name: str) -> Any:
        if name not in ASSETS:
            return JSONResponse({"error": f"no asset {name!r}"}, status_code=404)
        return FileResponse(STATIC / name, media_type=ASSETS[name])

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        return health(connect)

    @app.get("/api/panels")
    def api_panels(
        since: str | None = Query(None, max_length=40),
        until: str | None = Query(None, max_length=40),
        bucket: int | None = Query(None),
        top: int = Query(20),
        run: str = Query("", max_length=128),
        view: ViewQuery = Depends(),  # noqa: B008 - FastAPI's way to group query parameters
    ) -> JSONResponse:
        try:
            backend = connect()
        # kept broad: an HTTP boundary that answers 503 with the reason (the driver's connection
        # errors come in many types), instead of a 500 without one
        except Exception as exc:
            return _unavailable(settings, exc)
        try:
            try:
                bounds = panels.data_bounds(backend)
            except StoreError as exc:
                return _unavailable(settings, exc)
            try:
                chosen = q.View.parse(view.view, view.advertiser, view.campaign, view.currency)
                window = q.resolve(bounds, since or None, until or None, bucket, top, run, chosen)
            except ConfigError as exc:
                return JSONResponse({"error": str(exc)}, status_code=400)
            return JSONResponse(finite(_body(settings, backend, bounds, window)))
        finally:
            _close(backend)

    @app.get("/api/filters")
    def api_filters() -> JSONResponse:
        return filters(settings, connect)

    return app


def health(connect: Callable[[], Backend]) -> JSONResponse:
    """`/healthz`: ClickHouse answers (its version), or 503 with why not."""
    try:
        backend = connect()
        try:
            version = backend.execute("SELECT version()")[0][0]
        finally:
            _close(backend)
    except (StoreError, OSError, EOFError) as exc:
        return JSONResponse({"ok": False, "error": str(exc)}, status_code=503)
    return JSONResponse({"ok": True, "clickhouse": version})


def filters(settings: Settings, connect: Callable[[], Backend]) -> JSONResponse:
    """`/api/filters`: the advertisers and their campaigns the advertiser view can filter on."""
    try:
        backend = connect()
    except Exception as exc:  # as /api/panels: a 503 with the reason
        return _unavailable(settings, exc)
    try:
        return JSONResponse({"advertisers": adv_view.filter_choices(backend)})
    except StoreError as exc:
        return _unavailable(settings, exc)
    finally:
        _close(backend)


@dataclass
class ViewQuery:
    """The page's view and the advertiser view's filters, as query parameters."""

    view: str = Query("operations", max_length=20)
    advertiser: str = Query("", max_length=4000)  # `a,b`; empty: all
    campaign: str = Query("", max_length=4000)
    currency: str = Query("USD", max_length=8)


def _body(
    settings: Settings, backend: Backend, bounds: tuple[int, int] | None, window: q.Window
) -> dict[str, Any]:
    """The `/api/panels` answer: the window as resolved, the no-data state, the view's panels."""
    database = clickhouse_database(settings)
    return {
        "database": database,
        "window": {
            "since": panels.stamp(window.since),
            "until": panels.stamp(window.until),
            "bucket": window.bucket,
            "top": window.top,
            "run": window.run_id,
            "view": window.view.name,
            "advertiser": ",".join(window.view.advertisers),
            "campaign": ",".join(window.view.campaigns),
            "currency": window.view.currency,
        },
        "no_data": bounds is None,
        "message": None
        if bounds is not None
        else f"no events in ClickHouse database {database!r} yet: "
        "start the stack and the streams worker (`adstream up`, `adstream worker`) "
        "and send events (`adstream simulate --kafka`)",
        "panels": panels.build(backend, window),
    }


def finite(value: Any) -> Any:
    """`value` with NaN and ±inf floats as None (JSON has neither; browsers reject them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def _unavailable(settings: Settings, exc: BaseException) -> JSONResponse:
    log.warning("dashboard: ClickHouse unavailable: %s", exc)
    return JSONResponse(
        {"error": f"ClickHouse at {clickhouse_where(settings)} is not answering: {exc}"}, status_code=503
    )


def clickhouse_where(settings: Settings) -> str:
    """host:port/database of the ClickHouse URL, without credentials."""
    args = clickhouse_args(settings)
    return f"{args['host']}:{args['port']}/{clickhouse_database(settings)}"


def _close(backend: Backend) -> None:
    client = getattr(backend, "client", None)
    if client is not None:  # clickhouse-driver: one connection per request
        client.disconnect()
    elif callable(close := getattr(backend, "close", None)):  # chDB: one session per request
        close()
