"""The `adstream` command line: local stack, producing events, and each room's entry point."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from deploy import (
    cli_ab,
    cli_attribution,
    cli_bench,
    cli_collector,
    cli_creatives,
    cli_dashboard,
    cli_demo,
    cli_ops,
    cli_serving,
    cli_spend,
    cli_streams,
    cli_trainers,
    cli_workloads,
)
from deploy.services import ServiceName
from schemas.errors import AdstreamError
from schemas.settings import Settings

app = typer.Typer(help="adstream: streaming, self-improving ad delivery.", no_args_is_help=True)
console = Console()
err = Console(stderr=True)


def settings() -> Settings:
    return Settings()


@app.command()
def up(
    only: Annotated[list[ServiceName] | None, typer.Option(help="Start only these services")] = None,
) -> None:
    """Start the local stack (broker, Redis, ClickHouse) where nothing answers yet."""
    from deploy import stack

    s = settings()
    wanted = {name.value for name in only} if only else None
    started = stack.up(s, wanted)
    console.print(f"started: {', '.join(started) or 'nothing (all already running)'}")
    if wanted is None or "clickhouse" in wanted:
        from attribution.migrate import migrate

        applied = migrate(s)  # the event, rollup and attribution tables, each migration once
        console.print(f"ClickHouse migrations applied: {', '.join(applied) or 'none (up to date)'}")
    _print_status(stack.status(s))


@app.command()
def down() -> None:
    """Stop exactly the services `adstream up` started."""
    from deploy import stack

    stopped = stack.down(settings())
    console.print(f"stopped: {', '.join(stopped) or 'nothing'}")


def _print_status(rows: list) -> bool:  # type: ignore[type-arg]
    table = Table("service", "address", "state", "version / error", "started by adstream")
    ok = True
    for row in rows:
        ok &= row.probe.up
        state = "[green]up[/]" if row.probe.up else "[red]down[/]"
        detail = row.probe.version if row.probe.up else row.probe.error[:80]
        table.add_row(row.name, row.address, state, detail, "yes" if row.started_by_us else "no")
    console.print(table)
    return ok


@app.command()
def status() -> None:
    """Print each service's address, state and version; exit 1 if any is down."""
    from deploy import stack

    if not _print_status(stack.status(settings())):
        raise typer.Exit(1)


@app.command()
def produce(
    topic: Annotated[str, typer.Argument(help="Contract topic, e.g. ad.impressions")],
    file: Annotated[str, typer.Argument(help="JSON-lines file, or - for standard input")] = "-",
    sign: Annotated[
        bool,
        typer.Option(
            help="Sign impressions and give clicks / dwells their click tokens with the stack's event "
            "key (the worker drops them otherwise); --no-sign sends them as they are"
        ),
    ] = True,
) -> None:
    """Validate JSON lines against the contract and produce the valid ones, keyed per the contract."""
    from deploy.produce import produce_lines
    from schemas.clients import require_kafka

    s = settings()
    require_kafka(s)
    if file == "-":
        lines = sys.stdin.buffer
        report = asyncio.run(produce_lines(s, topic, lines, sign=sign))
    else:
        path = Path(file)
        if not path.is_file():
            raise typer.BadParameter(f"no such file: {file}", param_hint="FILE")
        with path.open("rb") as fh:
            report = asyncio.run(produce_lines(s, topic, fh, sign=sign))
    for number, reason in report.invalid:
        err.print(f"line {number}: {reason}", markup=False, highlight=False)
    console.print(f"{topic}: {report.sent} sent, {len(report.invalid)} invalid, {report.blank} blank")
    if report.invalid:
        raise typer.Exit(1)


# one Typer app per room (`deploy/cli_<room>.py`): its commands at the top level, or a command
# group of its own (`adstream attribution …`, `adstream bench …`)
app.add_typer(cli_workloads.app)
app.add_typer(cli_streams.app)
app.add_typer(cli_trainers.app)
app.add_typer(cli_serving.app)
app.add_typer(cli_collector.app)  # `adstream collector`: POST /v1/events apart from ranking
app.add_typer(cli_attribution.app, name="attribution")
app.add_typer(cli_spend.app, name="spend")  # `adstream spend import FILE.csv`
app.add_typer(cli_ab.app)  # `adstream ab`, `adstream evaluate`
app.add_typer(cli_dashboard.app)
app.add_typer(cli_demo.app)
app.add_typer(cli_bench.app, name="bench")
app.add_typer(cli_creatives.app, name="creatives")
app.add_typer(cli_ops.app)  # `adstream init`, `adstream probe`, `adstream schedule`


def main() -> None:
    """Console-script entry point: AdstreamErrors become a clear message and exit code 2."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # Probing a service that is not up yet is expected; their tracebacks would only be noise.
    logging.getLogger("clickhouse_driver").setLevel(logging.CRITICAL)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    try:
        app()
    except AdstreamError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
