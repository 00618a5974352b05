"""`adstream creatives build`: assemble products and a tone file into variants on `ad.catalog`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Creative variants: assembled from products and a brand's tone.", no_args_is_help=True)
console = Console()
err = Console(stderr=True, soft_wrap=True)  # one problem per line, never wrapped


def _table(ads: list) -> Table:  # type: ignore[type-arg]
    table = Table("ad_id", "variants", "first headline", "first body", "cta", "disclosure")
    for ad in ads:
        v = ad.variants[0]
        table.add_row(ad.ad_id, str(len(ad.variants)), v.headline, v.body, v.cta, v.disclosure)
    return table


@app.command()
def build(
    products: Annotated[Path, typer.Argument(help="JSON lines: one product per line (creatives.products)")],
    tone: Annotated[Path, typer.Option("--tone", help="The brand's tone file, YAML (creatives.tone)")],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Check and assemble, print the variants, write nothing")
    ] = False,
    out: Annotated[
        Path | None, typer.Option(help="Also write the catalog entries as JSON lines to this file")
    ] = None,
) -> None:
    """Expand every product into its variants (headline × body × cta) and produce one catalog
    entry per product to ad.catalog. Every problem of both files is named by file and line (exit 2)
    and then nothing is written: all products are checked before the first is produced."""
    from creatives import CreativeInputError, build_catalog
    from deploy.produce import produce_lines
    from schemas.clients import require_kafka
    from schemas.codec import encode
    from schemas.settings import Settings
    from schemas.topics import CATALOG

    try:
        ads = build_catalog(products, tone)  # every check passes before anything is written
    except CreativeInputError as exc:
        for problem in exc.problems:
            err.print(f"error: {problem}", markup=False, highlight=False)
        err.print(f"{len(exc.problems)} problem(s); nothing was written", markup=False, highlight=False)
        raise typer.Exit(2) from None
    lines = [encode(ad) for ad in ads]
    console.print(_table(ads))
    n_variants = sum(len(ad.variants) for ad in ads)
    if out is not None:
        out.write_bytes(b"".join(line + b"\n" for line in lines))
        console.print(f"wrote {len(ads)} catalog entries to {out}")
    if dry_run:
        console.print(f"dry run: {len(ads)} ads, {n_variants} variants, nothing produced")
        return
    s = Settings()
    require_kafka(s)
    report = asyncio.run(produce_lines(s, CATALOG, lines, sign=False))
    console.print(f"{CATALOG}: {report.sent} ads ({n_variants} variants) sent")
