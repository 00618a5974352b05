"""`adstream ab` (the live A/B per arm, with intervals and lifts) and `adstream evaluate` (a known
policy scored off-policy on logged impressions), both over a ClickHouse time range."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from deploy.cli_attribution import DAY, parse_time
from schemas.errors import AdstreamError

app = typer.Typer()
err = Console(stderr=True)


class Method(StrEnum):
    bootstrap = "bootstrap"
    delta = "delta"


@contextmanager
def clean_errors() -> Iterator[None]:
    """An AdstreamError (bad input, no data, an arm without traffic) → its message and exit 2."""
    try:
        yield
    except AdstreamError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        raise typer.Exit(2) from None


def _range(since: str | None, until: str | None) -> tuple[int, int]:
    from attribution.paths import check_range

    t_until = parse_time(until, "--until", int(time.time()))
    t_since = parse_time(since, "--since", t_until - DAY)
    check_range(t_since, t_until)
    return t_since, t_until


def _backend() -> Any:
    from attribution.migrate import migrate
    from attribution.sql import DriverBackend
    from schemas.clients import clickhouse_client, clickhouse_database
    from schemas.settings import Settings

    s = Settings()
    migrate(s)
    return DriverBackend(clickhouse_client(s, clickhouse_database(s)))


def _ci(e: Any, fmt: str) -> str:
    return f"{e.value:{fmt}} ({e.ci_low:{fmt}} … {e.ci_high:{fmt}})"


def _print_ab(report: Any, title: str) -> None:
    console = Console()
    table = Table(title=title)
    for col in ("arm", "users", "requests", "impressions", "CTR", "clicks / request", "revenue / request"):
        table.add_column(col, justify="left" if col == "arm" else "right")
    for name, m in report.arms.items():
        table.add_row(
            name, f"{m.users:,}", f"{m.requests:,}", _ci(m.impressions, ",.0f"), _ci(m.ctr, ".3%"),
            _ci(m.clicks_per_request, ".4f"), _ci(m.revenue_per_request, ".4f"),
        )  # fmt: skip
    console.print(table)
    if report.lifts:
        lifts = Table(title="relative lift (95 % interval)")
        for col in ("arm", "over", "CTR", "clicks / request", "revenue / request"):
            lifts.add_column(col, justify="left" if col in ("arm", "over") else "right")
        pairs: dict[tuple[str, str], dict[str, Any]] = {}
        for x in report.lifts:
            pairs.setdefault((x.arm, x.baseline), {})[x.metric] = x.estimate
        for (a, b), by_metric in pairs.items():
            cells = [_ci(by_metric[m], "+.1%") for m in ("ctr", "clicks_per_request", "revenue_per_request")]
            lifts.add_row(a, b, *cells)
        console.print(lifts)
    for note in report.skipped_pairs:
        console.print(f"[yellow]not compared[/]: {note}")
    how = f"bootstrap over users, {report.n_boot} resamples, seed {report.seed}"
    console.print(f"intervals: {how if report.method == 'bootstrap' else 'delta method over users'}")


def parse_pairs(items: list[str] | None) -> list[tuple[str, str]]:
    """`ARM:BASELINE` pairs."""
    from attribution.paths import AttributionInputError

    out = []
    for item in items or []:
        a, sep, b = item.partition(":")
        if not sep or not a or not b or a == b:
            raise AttributionInputError(f"--pair {item!r} is not ARM:BASELINE (two different arms)")
        out.append((a, b))
    return out


@app.command()
def ab(
    since: Annotated[
        str | None, typer.Option(help="Start (ISO date/time, UTC, or epoch s); default until − 1 d")
    ] = None,
    until: Annotated[str | None, typer.Option(help="End, exclusive; default now")] = None,
    slot: Annotated[str | None, typer.Option(help="Only this slot (feed, search, splash)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON")] = False,
    method: Annotated[Method, typer.Option(help="Interval method")] = Method.bootstrap,
    n_boot: Annotated[int, typer.Option(min=100, help="Bootstrap resamples")] = 2000,
    seed: Annotated[int, typer.Option(help="Bootstrap seed")] = 0,
    refresh: Annotated[bool, typer.Option(help="Rebuild the A/B rollup of the range first")] = True,
    pair: Annotated[
        list[str] | None,
        typer.Option(help="ARM:BASELINE lifts to report (default learning:control, learning:correction)"),
    ] = None,
) -> None:
    """The live A/B per arm (learning, correction, control): impressions, CTR, clicks and revenue
    per request with 95 % intervals over users, and the lifts of learning over the others."""
    from attribution.ab import DEFAULT_PAIRS, compare
    from attribution.ab_rollups import read_arms, refresh_ab_rollups
    from schemas.settings import Settings

    with clean_errors():
        slots = Settings().slots.names
        if slot is not None and slot not in slots:
            from attribution.paths import AttributionInputError

            raise AttributionInputError(f"--slot {slot!r} is not a slot (choose from {', '.join(slots)})")
        t_since, t_until = _range(since, until)
        pairs = parse_pairs(pair)
        backend = _backend()
        if refresh:
            refresh_ab_rollups(backend, t_since, t_until)
        arms = read_arms(backend, t_since, t_until, slot)
        # pairs asked for by name must be comparable; the default ones are skipped with the reason
        report = compare(
            arms, pairs or DEFAULT_PAIRS, method=method.value, n_boot=n_boot, seed=seed, strict=bool(pairs)
        )
    if as_json:
        typer.echo(
            json.dumps({"since": t_since, "until": t_until, "slot": slot, **report.as_dict()}, indent=1)
        )
        return
    _print_ab(report, f"A/B by arm, [{t_since}, {t_until})" + (f", slot {slot}" if slot else ""))


@app.command()
def evaluate(
    policy: Annotated[str, typer.Option(help="logging, greedy or explore:F (0 ≤ F ≤ 1)")],
    since: Annotated[
        str | None, typer.Option(help="Start (ISO date/time, UTC, or epoch s); default until − 1 d")
    ] = None,
    until: Annotated[str | None, typer.Option(help="End, exclusive; default now")] = None,
    arm: Annotated[str | None, typer.Option(help="Only impressions of this arm")] = None,
    slot: Annotated[str | None, typer.Option(help="Only this slot")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the estimates as JSON")] = False,
) -> None:
    """Score a known policy off-policy (IPS, SNIPS, doubly robust) on the impressions logged with
    their propensities in [since, until): the CTR it would have had, with 95 % intervals."""
    from attribution.ope_logs import check_policy, evaluate, read_logged

    with clean_errors():
        check_policy(policy)  # before any connection: a typo is named at once
        t_since, t_until = _range(since, until)
        rounds = read_logged(_backend(), t_since, t_until, arm, slot)
        value = evaluate(rounds, policy)
    if as_json:
        typer.echo(
            json.dumps(
                {"since": t_since, "until": t_until, "arm": arm, "slot": slot, **value.as_dict()}, indent=1
            )
        )
        return
    table = Table(title=f"policy {policy!r}: CTR off-policy, [{t_since}, {t_until})")
    for col in ("estimator", "CTR", "95 % interval"):
        table.add_column(col, justify="left" if col == "estimator" else "right")
    for name, e in value.estimates.items():
        table.add_row(name.upper(), f"{e.value:.3%}", f"{e.ci_low:.3%} … {e.ci_high:.3%}")
    console = Console()
    console.print(table)
    console.print(
        f"{value.rounds:,} logged impressions, logged CTR {value.logged_ctr:.3%}; mean weight "
        f"{value.mean_weight:.3f} (≈ 1 when propensities are right), "
        f"effective rounds {value.effective_rounds:,.0f}"
    )
