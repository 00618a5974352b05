"""`adstream attribution`: credit per channel under each model, ROI and budget moves, stored runs."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Annotated, Any

import typer

from attribution.models import ModelName
from attribution.paths import AttributionInputError, Granularity

DAY = 86400


def parse_time(text: str | None, name: str, default: int) -> int:
    """Epoch seconds from an ISO date/datetime (UTC unless it has an offset) or epoch seconds."""
    if text is None:
        return default
    t = text.strip()
    if t.isdigit():
        return int(t)
    try:
        dt = datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise AttributionInputError(f"{name} {text!r} is not an ISO date/time or epoch seconds") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp())


def parse_bounds(items: list[str] | None) -> dict[str, tuple[float, float]]:
    """`CHANNEL=LO:HI` spend bounds."""
    out: dict[str, tuple[float, float]] = {}
    for item in items or []:
        try:
            name, rng = item.rsplit("=", 1)
            lo, hi = (float(x) for x in rng.split(":"))
        except ValueError:
            raise AttributionInputError(f"--bound {item!r} is not CHANNEL=LO:HI") from None
        out[name] = (lo, hi)
    return out


def _backend() -> Any:
    from attribution.migrate import migrate
    from attribution.sql import DriverBackend
    from schemas.clients import clickhouse_client, clickhouse_database
    from schemas.settings import Settings

    s = Settings()
    migrate(s)
    return DriverBackend(clickhouse_client(s, clickhouse_database(s))), s


def _execute(models: list[str], by: Granularity, since: str | None, until: str | None,
             bootstrap: int | None, seed: int | None, calibrate: bool, bounds: list[str] | None,
             store: bool) -> Any:  # fmt: skip
    from attribution.runs import run_and_store

    now = int(time.time())
    t_until = parse_time(until, "--until", now)
    t_since = parse_time(since, "--since", t_until - 7 * DAY)
    spend_bounds = parse_bounds(bounds)
    backend, s = _backend()
    return run_and_store(
        backend, s, models=models, by=by.value, since=t_since, until=t_until, bootstrap=bootstrap,
        seed=seed, calibrate_holdout=calibrate, bounds=spend_bounds, store=store,
    )  # fmt: skip


def _check_channels(run: Any, channels: list[str] | None) -> list[str]:
    known = next(iter(run.results.values())).channels
    for c in channels or []:
        if c not in known:
            raise AttributionInputError(f"unknown channel {c!r} (known: {', '.join(known)})")
    return list(channels) if channels else list(known)


def _print_model(run: Any, model: str, channels: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    result, plan = run.results[model], {c.channel: c for c in run.plans[model].channels}
    table = Table(title=f"{model} — by {run.by}, run {run.run_id}")
    for col in ("channel", "conversions", "95% CI", "share", "value", "spend", "ROAS", "CPA", "→ spend", ""):
        table.add_column(col, justify="left" if col in ("channel", "") else "right")
    for r in result.rows():
        if r.channel not in channels:
            continue
        c = plan[r.channel]
        ci = f"{r.ci_low:,.1f}–{r.ci_high:,.1f}" if r.ci_low == r.ci_low else "—"
        table.add_row(
            r.channel, f"{r.conversions:,.1f}", ci, f"{r.share:.1%}", f"{r.value:,.2f}", f"{c.spend:,.2f}",
            f"{c.roas:.2f}", f"{c.cpa:,.2f}", f"{c.recommended_spend:,.2f}",
            "low confidence" if c.low_confidence else "",
        )  # fmt: skip
    console = Console()
    console.print(table)
    console.print(f"expected uplift of the budget moves: {run.plans[model].expected_uplift:,.2f} (value)")


app = typer.Typer(help="Attribution: credit per channel, ROI, budget moves (stored in ClickHouse).")


@app.callback(invoke_without_command=True)
def attribution(
    ctx: typer.Context,
    model: Annotated[list[ModelName] | None, typer.Option("--model", "-m", help="Model(s) to run")] = None,
    by: Annotated[Granularity, typer.Option(help="Channel granularity")] = Granularity.campaign,
    since: Annotated[
        str | None, typer.Option(help="Start (ISO date/time, UTC, or epoch s); default until − 7 d")
    ] = None,
    until: Annotated[str | None, typer.Option(help="End, exclusive; default now")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the run as JSON")] = False,
    bootstrap: Annotated[int | None, typer.Option(help="Bootstrap replicates for CIs")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of bootstrap and sampling")] = None,
    calibrate: Annotated[bool, typer.Option(help="Also calibrate credits to holdout lift")] = False,
    channel: Annotated[list[str] | None, typer.Option(help="Show only these channels")] = None,
    bound: Annotated[list[str] | None, typer.Option(help="Spend bounds CHANNEL=LO:HI")] = None,
    store: Annotated[bool, typer.Option(help="Store the run in ClickHouse")] = True,
) -> None:
    """Run attribution models over [since, until) and print credit, ROI and budget moves."""
    if ctx.invoked_subcommand is not None:
        return
    models = [m.value for m in model] if model else [ModelName.shapley.value]
    run = _execute(models, by, since, until, bootstrap, seed, calibrate, bound, store)
    shown = _check_channels(run, channel)
    if as_json:
        typer.echo(json.dumps(run.to_dict(), default=float, indent=1))
        return
    for m in run.results:
        _print_model(run, m, shown)


@app.command()
def compare(
    model: Annotated[
        list[ModelName] | None, typer.Option("--model", "-m", help="Models (default: all)")
    ] = None,
    by: Annotated[Granularity, typer.Option(help="Channel granularity")] = Granularity.campaign,
    since: Annotated[str | None, typer.Option(help="Start (ISO or epoch s)")] = None,
    until: Annotated[str | None, typer.Option(help="End, exclusive")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    bootstrap: Annotated[int | None, typer.Option()] = None,
    seed: Annotated[int | None, typer.Option()] = None,
    calibrate: Annotated[bool, typer.Option(help="Add holdout-calibrated variants")] = False,
    store: Annotated[bool, typer.Option()] = True,
) -> None:
    """Every model side by side (last click vs Shapley and the rest): share of conversions."""
    from rich.console import Console
    from rich.table import Table

    from attribution.models import MODELS

    models = [m.value for m in model] if model else list(MODELS)
    run = _execute(models, by, since, until, bootstrap, seed, calibrate, None, store)
    if as_json:
        typer.echo(json.dumps(run.to_dict(), default=float, indent=1))
        return
    names = list(run.results)
    table = Table(title=f"share of conversions by model — by {by.value}, run {run.run_id}")
    table.add_column("channel")
    for m in names:
        table.add_column(m, justify="right")
    channels = run.results[names[0]].channels
    for i, c in enumerate(channels):
        cells = []
        for m in names:
            r = run.results[m]
            s = r.share[i]
            ci = (
                r.ci_low[i] / max(r.conversions.sum(), 1e-12),
                r.ci_high[i] / max(r.conversions.sum(), 1e-12),
            )
            cells.append(f"{s:.1%}" + (f" ({ci[0]:.0%}–{ci[1]:.0%})" if ci[0] == ci[0] else ""))
        table.add_row(c, *cells)
    Console().print(table)


@app.command()
def rollup(
    since: Annotated[str | None, typer.Option(help="Start (ISO or epoch s); default until − 1 d")] = None,
    until: Annotated[str | None, typer.Option(help="End, exclusive; default now")] = None,
) -> None:
    """Recompute the hourly campaign × slot rollups of [since, until) from deduplicated rows."""
    from attribution.paths import check_range
    from attribution.rollups import refresh_rollups

    t_until = parse_time(until, "--until", int(time.time()))
    t_since = parse_time(since, "--since", t_until - DAY)
    check_range(t_since, t_until)
    backend, _ = _backend()
    refresh_rollups(backend, t_since, t_until)
    typer.echo(f"rollups refreshed for [{t_since}, {t_until})")


@app.command()
def lift(
    since: Annotated[str | None, typer.Option(help="Start (ISO or epoch s)")] = None,
    until: Annotated[str | None, typer.Option(help="End, exclusive")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Holdout lift per campaign: exposed vs held-out conversion rates."""
    from attribution.incrementality import measure_lift
    from attribution.paths import check_range

    t_until = parse_time(until, "--until", int(time.time()))
    t_since = parse_time(since, "--since", t_until - 7 * DAY)
    check_range(t_since, t_until)
    backend, _ = _backend()
    lifts = measure_lift(backend, t_since, t_until)
    if not lifts:
        raise AttributionInputError("no campaign has both exposed and holdout users in that range")
    if as_json:
        typer.echo(
            json.dumps({c: {**lf.__dict__, "relative_lift": lf.relative_lift} for c, lf in lifts.items()})
        )
        return
    for c, lf in lifts.items():
        typer.echo(
            f"{c}: exposed {lf.exposed_rate:.4f} ({lf.exposed_users} users), "
            f"holdout {lf.holdout_rate:.4f} "
            f"({lf.holdout_users}), incremental {lf.incremental_conversions:,.1f} ± {lf.se:,.1f}"
        )


SPLIT_BY_HOLDOUT = "holdout"  # `mmm --split-by holdout`: the holdouts' per-slot lifts split the campaigns


def _holdout_split(backend: Any, since: int, until: int) -> dict[str, dict[str, tuple[float, float]]]:
    """Each campaign's split into slots by its holdout's per-slot lifts, shrunk toward the spend
    split (`attribution.mmm.holdout_split`); an error before any fit when there is none."""
    from attribution.channel_lift import measure_design
    from attribution.mmm import holdout_split
    from attribution.roi import channel_spend

    design = measure_design(backend, since, until)
    split = holdout_split(design, channel_spend(backend, "slot_campaign", since, until))
    if not split:
        raise AttributionInputError(
            "--split-by holdout: no campaign of the range has a holdout measured in each of its slots"
        )
    return split


def _check_split_by(split_by: str, by: Granularity) -> None:
    from attribution.models import check_model

    if split_by != SPLIT_BY_HOLDOUT:
        check_model(split_by)
    if by != Granularity.campaign:
        raise AttributionInputError(
            f"--split-by splits campaigns into slots: it needs --by campaign, not {by.value!r}"
        )


def _split_plan(fit: Any, model: str, by: Granularity, calibrate: bool, since: int, until: int,
                max_change: float, seed: int, split: Any = None) -> Any:  # fmt: skip
    """The media-mix moves per slot: each campaign's curve split by `model`'s credit per slot
    (`split`: already made, by the holdouts' per-slot lifts)."""
    from attribution.mmm import plan_mmm_split, slot_split
    from attribution.runs import run_and_store

    if split is not None:
        return plan_mmm_split(fit, split, max_change)
    backend, s = _backend()
    run = run_and_store(
        backend, s, models=[model], by="slot_campaign", since=since, until=until, seed=seed,
        calibrate_holdout=calibrate, store=False,
    )  # fmt: skip
    result = run.results[f"{model}+holdout" if calibrate else model]
    return plan_mmm_split(fit, slot_split(result, run.spend), max_change)


@app.command()
def mmm(
    by: Annotated[Granularity, typer.Option(help="Channel granularity")] = Granularity.campaign,
    since: Annotated[str | None, typer.Option(help="Start (ISO or epoch s); default until − 56 d")] = None,
    until: Annotated[str | None, typer.Option(help="End, exclusive; default now")] = None,
    advertiser: Annotated[
        str | None, typer.Option(help="Only this advertiser's spend and conversions")
    ] = None,
    calibrate: Annotated[
        bool, typer.Option(help="Calibrate with the holdouts' lift (--by campaign)")
    ] = False,
    lift_file: Annotated[
        str | None,
        typer.Option(
            help="CSV of lift experiments run outside adstream (channel,x,delta_x,delta_y,sigma "
            "a day), calibrating those channels' curves"
        ),
    ] = None,
    split_by: Annotated[
        str | None,
        typer.Option(
            help="Also move budget per slot: each campaign's fitted curve split by this multi-touch "
            "model's credit per slot (holdout-calibrated with --calibrate), or by `holdout`: the "
            "holdouts' own per-slot lifts, shrunk toward the spend split (--by campaign)"
        ),
    ] = None,
    quick: Annotated[bool, typer.Option("--quick/--full", help="ADVI in seconds, or NUTS")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the fit")] = 0,
    max_change: Annotated[
        float, typer.Option(help="Budget moves within ± this share of a channel's spend")
    ] = 0.5,
    meridian: Annotated[
        str | None, typer.Option(help="Also write Meridian's CSV and spec into this folder")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Media-mix model (PyMC-Marketing: adstock, saturation) of daily spend and conversions, with
    response curves and budget moves from the fitted curves."""
    import contextlib
    import sys
    from pathlib import Path

    from attribution.incrementality import measure_lift
    from attribution.mmm import (
        daily_data,
        fit_mmm,
        lift_tests,
        meridian_export,
        parse_lift_csv,
        plan_mmm_budget,
    )

    t_until = parse_time(until, "--until", int(time.time()))
    t_since = parse_time(since, "--since", t_until - 56 * DAY)
    if split_by:
        _check_split_by(split_by, by)
    backend, _ = _backend()
    data = daily_data(backend, by.value, t_since, t_until, advertiser)
    split = _holdout_split(backend, t_since, t_until) if split_by == SPLIT_BY_HOLDOUT else None
    lifts = measure_lift(backend, t_since, t_until) if calibrate or meridian else {}
    tests = lift_tests(data, lifts, by.value) if calibrate else None
    if calibrate and not tests:
        raise AttributionInputError("--calibrate: no channel of the range has a holdout lift")
    notes: list[str] = []
    if lift_file:
        path = Path(lift_file)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise AttributionInputError(f"--lift-file {lift_file!r}: cannot read it ({exc})") from None
        outside_tests, notes = parse_lift_csv(text, data.channels, path.name)
        tests = [*(tests or []), *outside_tests]
        for note in notes:
            typer.echo(f"{path.name}: {note}", err=True)
    with contextlib.redirect_stdout(sys.stderr):  # the libraries' progress lines stay off --json's stdout
        fit = fit_mmm(data, tests, quick=quick, seed=seed)
    plan = plan_mmm_budget(fit, max_change)
    if split_by:
        plan = _split_plan(fit, split_by, by, calibrate, t_since, t_until, max_change, seed, split)
    out = {
        "channels": list(data.channels), "days": data.days, "fit": fit.meta,
        "shares": dict(zip(data.channels, fit.shares().round(4).tolist(), strict=True)),
        "curves": fit.curves(), "budget": plan.to_dict(), "lift_file_notes": notes, "split_by": split_by,
    }  # fmt: skip
    if meridian:
        out["meridian"] = meridian_export(data, lifts, Path(meridian))
    if as_json:
        typer.echo(json.dumps(out, default=float, indent=1))
        return
    g = plan.gain
    typer.echo(f"media-mix model over {data.days} days, {len(data.channels)} channels ({fit.meta['method']})")
    shares = dict(zip(data.channels, fit.shares().tolist(), strict=True))
    rows: list[dict[str, Any]] = plan.to_dict()["channels"]
    for row in rows:
        c = row["channel"]
        share = f"share {shares[c]:.1%}" if c in shares else f"slot of {c.partition(':')[0]}"
        typer.echo(
            f"{c}: {share}, daily spend {row['daily_spend']:,.2f} → "
            f"{row['recommended_daily_spend']:,.2f} ({row['gain']:+.2f} conversions/day, "
            f"90% {row['gain_low']:+.2f}…{row['gain_high']:+.2f})"
        )
    typer.echo(f"budget moves: {g['mean']:+.2f} conversions a day (90% {g['low']:+.2f}…{g['high']:+.2f})")
