"""`adstream worker` and `adstream migrate`: the streams room's commands."""

from __future__ import annotations

from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    """Add the streams commands to the `adstream` CLI."""

    @app.command()
    def worker(
        loglevel: Annotated[str, typer.Option(help="crit, error, warn, info or debug")] = "info",
        engine: Annotated[
            str, typer.Option(help="faust (the Faust app, default) or aiokafka (a bare consumer group)")
        ] = "faust",
    ) -> None:
        """Run the streams worker: validation, user state, label join, ClickHouse sink."""
        import logging

        from attribution.migrate import migrate as run_migrations
        from schemas.settings import Settings

        # the ClickHouse tables the worker's sink writes into belong to attribution: migrate first
        run_migrations(Settings())
        if engine == "faust":
            from streams.app import run_worker

            run_worker(Settings(), loglevel=loglevel)
        elif engine == "aiokafka":
            from streams.plain import run_worker as run_plain

            logging.getLogger().setLevel(loglevel.upper().replace("CRIT", "CRITICAL"))
            run_plain(Settings())
        else:
            raise typer.BadParameter(f"unknown engine {engine!r}", param_hint="--engine")

    @app.command()
    def migrate() -> None:
        """Apply the ClickHouse migrations (raw event tables) that are not applied yet."""
        from rich.console import Console

        from attribution.migrate import migrate as run
        from schemas.settings import Settings

        applied = run(Settings())
        Console().print(f"applied: {', '.join(applied) or 'nothing (up to date)'}")
