"""`adstream dashboard`: serve the read-only attribution dashboard (ClickHouse → Plotly page)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from schemas.settings import Settings

console = Console()


app = typer.Typer(help="The attribution dashboard.")


@app.command()
def dashboard(
    host: Annotated[
        str, typer.Option(help="Address to listen on (loopback: this machine only)")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on")] = 8050,
) -> None:
    """Serve the read-only dashboard: event rates, CTR, pacing, CPA/ROAS, models, budget moves, AUC."""
    import uvicorn

    from attribution.dashboard.app import clickhouse_where, create_app

    _check_bindable(host, port)
    settings = Settings()
    app_ = create_app(settings)
    where = clickhouse_where(settings)
    console.print(f"dashboard on http://{host}:{port}/ (reads ClickHouse {where}; Ctrl-C stops it)")
    uvicorn.run(app_, host=host, port=port, log_level="warning")


def _check_bindable(host: str, port: int) -> None:
    """A clear error (exit 2) for an address in use or not ours, before anything is printed."""
    import socket

    from schemas.errors import ConfigError

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise ConfigError(
            f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})"
        ) from exc
