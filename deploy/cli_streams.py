"""`adstream worker` and `adstream migrate`: the streams room's commands."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer


class Engine(StrEnum):
    """How the worker reads Kafka: the Faust app (the design's engine) or a bare aiokafka group."""

    faust = "faust"
    aiokafka = "aiokafka"


def register(app: typer.Typer) -> None:
    """Add the streams commands to the `adstream` CLI."""

    @app.command()
    def worker(
        loglevel: Annotated[str, typer.Option(help="crit, error, warn, info or debug")] = "info",
        engine: Annotated[
            Engine, typer.Option(help="faust (the Faust app, default) or aiokafka (a bare consumer group)")
        ] = Engine.faust,
    ) -> None:
        """Run the streams worker: validation, user state, label join, ClickHouse sink."""
        import logging

        from attribution.migrate import migrate as run_migrations
        from schemas.clients import require_kafka
        from schemas.settings import Settings

        settings = Settings()
        require_kafka(settings)  # a broker that is down is one clear line, not Faust's traceback
        # the ClickHouse tables the worker's sink writes into belong to attribution: migrate first
        run_migrations(settings)
        if engine is Engine.faust:
            from streams.app import run_worker

            run_worker(settings, loglevel=loglevel)
        else:
            from streams.aiokafka_engine import run_worker as run_plain

            logging.getLogger().setLevel(loglevel.upper().replace("CRIT", "CRITICAL"))
            run_plain(settings)

    @app.command()
    def migrate() -> None:
        """Apply the ClickHouse migrations (raw event tables) that are not applied yet."""
        from rich.console import Console

        from attribution.migrate import migrate as run
        from schemas.settings import Settings

        applied = run(Settings())
        Console().print(f"applied: {', '.join(applied) or 'nothing (up to date)'}")
