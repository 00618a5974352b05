"""`adstream collector`: the event collector (`POST /v1/events`, `GET /adstream.js`) as its own
Serve application, for deployments that run it apart from ranking."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.console import Console

from schemas.settings import Settings, nested

console = Console()


def collector_cmd(
    port: Annotated[
        int | None, typer.Option(help="HTTP port (default: settings.collector.http_port)")
    ] = None,
    host: Annotated[str | None, typer.Option(help="HTTP host (default: settings.serving.http_host)")] = None,
    replicas: Annotated[int | None, typer.Option(help="Collector replicas")] = None,
) -> None:
    """Deploy the event collector alone and serve until interrupted."""
    overrides: dict[str, Any] = {}
    for key, value in (
        ("collector.http_port", port),
        ("serving.http_host", host),
        ("serving.replicas", replicas),
    ):
        if value is not None:
            overrides[key] = value
    settings = Settings(**nested(overrides))
    # the collector listens where the settings put it: Serve's proxy port is serving.http_port
    settings = settings.model_copy(
        update={"serving": settings.serving.model_copy(update={"http_port": settings.collector.http_port})}
    )
    from deploy.cli_serving import run_until_signalled, start
    from serving.collector_app import build_collector_app

    if not settings.serving.api_keys.get_secret_value():
        console.print("[yellow]no serving.api_keys: /v1/events is open (rate-limited per client address)[/]")
    t0 = time.monotonic()
    ep = start(
        settings, name="adstream-collector", throughput_optimized=False, app=build_collector_app(settings)
    )
    console.print(
        f"adstream collector at [bold]{ep.proxy}[/] (docs: {ep.proxy}/docs) — {time.monotonic() - t0:.1f}s"
    )
    run_until_signalled()


app = typer.Typer(help="The event collector: `adstream collector`.")
app.command("collector")(collector_cmd)
