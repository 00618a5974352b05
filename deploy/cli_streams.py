"""`adstream worker` and `adstream migrate`: the streams room's commands."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer


class LogLevel(StrEnum):
    """The worker's log level (Faust's names; the aiokafka engine maps them to `logging`'s)."""

    crit = "crit"
    error = "error"
    warn = "warn"
    info = "info"
    debug = "debug"

    @property
    def logging_name(self) -> str:
        """The `logging` level name: `crit` is CRITICAL, `warn` WARNING."""
        return {"crit": "CRITICAL", "warn": "WARNING"}.get(self.value, self.value.upper())


class Engine(StrEnum):
    """How the worker reads Kafka: the Faust app (the design's engine) or a bare aiokafka group."""

    faust = "faust"
    aiokafka = "aiokafka"


app = typer.Typer(help="The streams room: the worker and the ClickHouse migrations.")


@app.command()
def worker(
    loglevel: Annotated[LogLevel, typer.Option(help="Log level")] = LogLevel.info,
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

        run_worker(settings, loglevel=loglevel.value)
    else:
        from streams.engine_aiokafka import run_worker as run_plain

        logging.getLogger().setLevel(loglevel.logging_name)
        run_plain(settings)


@app.command()
def migrate() -> None:
    """Apply the ClickHouse migrations (raw event tables) that are not applied yet."""
    from rich.console import Console

    from attribution.migrate import migrate as run
    from schemas.settings import Settings

    applied = run(Settings())
    Console().print(f"applied: {', '.join(applied) or 'nothing (up to date)'}")
