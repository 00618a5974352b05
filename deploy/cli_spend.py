"""`adstream spend import FILE.csv`: daily spend per outside channel, for ROI and budget moves."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from attribution.paths import AttributionInputError

app = typer.Typer(help="Spend on channels outside adstream (imported daily per channel).")


@app.callback()
def spend() -> None:
    """Spend on outside channels."""


@app.command("import")
def import_file(
    file: Annotated[Path, typer.Argument(help="CSV: date,advertiser_id,source,medium,campaign,spend")],
) -> None:
    """Check the whole file, then write its rows (a day imported again replaces the earlier one).

    A file with any bad row writes nothing: each is named by its line number (exit 2)."""
    from attribution.spend import import_spend, parse_spend_csv

    if not file.is_file():
        raise AttributionInputError(f"spend file {str(file)!r} does not exist")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise AttributionInputError(f"spend file {str(file)!r} is not UTF-8 text ({exc.reason})") from None
    rows = parse_spend_csv(text, str(file))  # before connecting: a bad file needs no ClickHouse
    from deploy.cli_attribution import _backend

    backend, _ = _backend()
    n = import_spend(backend, rows)
    days = sorted({r.day for r in rows})
    channels = {(r.source, r.medium, r.campaign) for r in rows}
    Console().print(f"{file}: {n} rows imported ({len(channels)} outside channels, {days[0]} … {days[-1]})")
