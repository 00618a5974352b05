"""`adstream simulate` and `adstream replay obd`: make event streams to a file or to Kafka."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from schemas.errors import ConfigError
from schemas.events import Message
from schemas.settings import Settings
from workloads.config import DriftMode, LoggingPolicy
from workloads.obd import ObdCampaign, ObdPolicy

console = Console()
replay_app = typer.Typer(help="Replay real logged datasets as contract events.", no_args_is_help=True)

OutOpt = Annotated[Path | None, typer.Option("--out", help="Write JSON lines (one event a line) here")]
KafkaOpt = Annotated[bool, typer.Option("--kafka", help="Produce to the contract topics on Kafka")]
PaceOpt = Annotated[float, typer.Option(help="Wall-clock events/s when producing (0 = as fast as possible)")]


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def _counted(messages: Iterable[Message], counts: Counter[str]) -> Iterator[Message]:
    for msg in messages:
        counts[str(getattr(msg, "kind", type(msg).__name__))] += 1
        yield msg


def _emit(
    messages: Iterable[Message], total: int, out: Path | None, kafka: bool, pace: float, label: str
) -> None:
    """Send a stream to the file or Kafka with a progress bar (advanced in events), signed."""
    if (out is None) == (not kafka):
        raise typer.BadParameter("give exactly one of --out FILE or --kafka", param_hint="--out/--kafka")
    from schemas.signing import event_key, seal
    from workloads import sinks

    # the operator's own streams: impressions signed, clicks and dwells with their click tokens,
    # with the stack's event key (the streams worker drops them otherwise)
    settings = Settings()
    key = event_key(settings)
    messages = (seal(m, key) for m in messages)
    with _progress() as bar:
        task = bar.add_task(label, total=total, rate="")

        def advance(n: int) -> None:
            bar.update(task, advance=n)
            elapsed = bar.tasks[task].elapsed or 0.0
            done = bar.tasks[task].completed
            if elapsed > 0:
                bar.update(task, rate=f"{done / elapsed:,.0f} ev/s")

        if out is not None:
            sinks.write_jsonl(messages, out, advance)
        else:
            from deploy.stack import create_topics

            create_topics(settings)  # with the contract's partition counts, not the broker's default
            asyncio.run(sinks.produce(messages, settings, rate=pace, progress=advance))
        bar.update(task, total=bar.tasks[task].completed)


def _fmt(x: float) -> str:
    return "n/a" if isinstance(x, float) and math.isnan(x) else f"{x:.4f}"


def _events_table(counts: dict[str, int], title: str) -> Table:
    table = Table("event", "count", title=title)
    for kind, n in sorted(counts.items()):
        table.add_row(kind, f"{n:,}")
    table.add_row("[bold]total", f"[bold]{sum(counts.values()):,}")
    return table


def simulate(
    users: Annotated[int, typer.Option(help="Number of users")] = 1000,
    ads: Annotated[int, typer.Option(help="Number of ads at the start")] = 200,
    impressions: Annotated[
        int, typer.Option("--impressions", "--events", help="Impressions to emit")
    ] = 100_000,
    seed: Annotated[int, typer.Option(help="Random seed (same seed, same bytes)")] = 0,
    categories: Annotated[int, typer.Option(help="Number of ad categories")] = 12,
    advertisers: Annotated[int, typer.Option(help="Number of advertisers")] = 20,
    drift_at: Annotated[
        float, typer.Option(help="Drift point: fraction (0,1) or impression index; <=0 off")
    ] = 0.5,
    drift_share: Annotated[float, typer.Option(help="Share of users whose taste changes")] = 0.3,
    drift_mode: Annotated[
        DriftMode,
        typer.Option(
            help="redraw (each drifted user redraws), trend (a shared category shift) or handover "
            "(the in-season categories change)"
        ),
    ] = DriftMode.redraw,
    new_ads: Annotated[int, typer.Option(help="Ads that arrive mid-stream (cold start)")] = 20,
    new_ads_at: Annotated[float, typer.Option(help="Arrival point of new ads, like --drift-at")] = 0.5,
    rate: Annotated[float, typer.Option(help="Ad requests per second of simulated time")] = 100.0,
    policy: Annotated[LoggingPolicy, typer.Option(help="Logging policy")] = LoggingPolicy.random,
    cpm_share: Annotated[
        float,
        typer.Option(
            help="Share of campaigns paying per thousand shown (CPM), the rest per click; above 0 the "
            "stream starts with every campaign's entry (ad.campaigns) and impressions name their bid type"
        ),
    ] = 0.0,
    out: OutOpt = None,
    kafka: KafkaOpt = False,
    pace: PaceOpt = 0.0,
) -> None:
    """Run the market simulator (open loop) and write its events to a file or Kafka.

    With `--cpm-share` the stream starts with the market's `Campaign` entries: a CPM campaign's
    creatives bid per mille (`Market.bid`), so whoever serves this catalog (its `ad.catalog` and
    `ad.campaigns` on Kafka, or the file as `serving.catalog_file`) must know how each campaign
    pays. Its default is 0, not `adstream demo`'s 0.2: at 0 the stream is byte for byte what it
    was (the catalogs benchmarks and tests build with it), with no campaign entries.
    """
    from itertools import chain

    from workloads import Market, MarketConfig

    try:
        cfg = MarketConfig(
            seed=seed, n_users=users, n_ads=ads, n_categories=categories, n_advertisers=advertisers,
            drift_at=drift_at if drift_at > 0 else None, drift_share=drift_share, n_new_ads=new_ads,
            drift_mode=drift_mode.value,
            new_ads_at=new_ads_at if new_ads_at > 0 else None, rate=rate, policy=policy.value,
            cpm_share=cpm_share,
        )  # fmt: skip
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    market = Market(cfg)
    # how each campaign pays (and its targeting), before the ads that bid in its unit
    campaigns = market.campaigns(include_new=True) if cpm_share > 0 else []
    # Impressions drive the bar's total; clicks, dwell and conversions add about 8% on top.
    _emit(chain(campaigns, market.open_loop(impressions)), impressions, out, kafka, pace, "simulate")
    s = market.summary()
    counts = {**s.events, "campaign": len(campaigns)} if campaigns else s.events
    console.print(_events_table(counts, f"simulate seed={seed} → {out or 'kafka'}"))
    table = Table("measure", "value", title="ground truth")
    table.add_row("CTR", _fmt(s.ctr))
    table.add_row("mean oracle pCTR", _fmt(s.mean_oracle_pctr))
    table.add_row("oracle AUC (true model on emitted impressions)", _fmt(s.oracle_auc))
    for ch, share in s.true_channel_credit.items():
        table.add_row(
            f"true credit {ch}",
            f"{share:.3f}  (expected {s.expected_caused_conversions[ch]:.1f}, "
            f"realised {s.realised_caused_conversions[ch]} caused conversions)",
        )
    table.add_row("organic conversions", str(s.organic_conversions))
    table.add_row("drift", f"impression {s.drift_impression} at {s.drift_ts}" if s.drift_ts else "none")
    if s.drift_ts:
        table.add_row("AUC after drift: oracle / frozen pre-drift truth",
                      f"{_fmt(s.oracle_auc_after_drift)} / {_fmt(s.frozen_auc_after_drift)}")  # fmt: skip
    table.add_row("new ads arrive", str(s.new_ads_ts) if s.new_ads_ts else "none")
    console.print(table)


@replay_app.command("obd")
def replay_obd(
    policy: Annotated[ObdPolicy, typer.Option(help="Logging policy of the log")] = ObdPolicy.random,
    campaign: Annotated[ObdCampaign, typer.Option(help="Campaign")] = ObdCampaign.all,
    speedup: Annotated[float, typer.Option(help="Divide time offsets by this factor")] = 1.0,
    start: Annotated[
        str | None, typer.Option(help="Move the first row to this ISO time (with offset) or 'now'")
    ] = None,
    out: OutOpt = None,
    kafka: KafkaOpt = False,
    pace: PaceOpt = 0.0,
) -> None:
    """Replay the Open Bandit Dataset (small, shipped in obp 0.4.1) as contract events."""
    from workloads.obd import obd_files, read_rows
    from workloads.obd import replay_obd as replay

    try:
        origin = None
        if start == "now":
            origin = datetime.now(UTC)
        elif start is not None:
            try:
                origin = datetime.fromisoformat(start)
            except ValueError as exc:
                raise ConfigError(f"start={start!r}: not an ISO 8601 time ({exc})") from exc
        log_csv, _ = obd_files(policy.value, campaign.value)
        messages = list(replay(policy.value, campaign.value, speedup, origin))
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    counts: Counter[str] = Counter()
    label = f"{policy.value}/{campaign.value}"
    _emit(_counted(messages, counts), len(messages), out, kafka, pace, f"replay obd/{label}")
    console.print(_events_table(dict(counts), f"Open Bandit Dataset {label} → {out or 'kafka'}"))
    rows = read_rows(log_csv)
    table = Table("measure", "value", title="dataset")
    table.add_row("rows (impressions)", f"{len(rows):,}")
    table.add_row("clicks in file / replayed", f"{sum(r.click for r in rows)} / {counts.get('click', 0)}")
    table.add_row("CTR", _fmt(counts.get("click", 0) / max(1, counts.get("impression", 0))))
    table.add_row("oracle AUC", "n/a (real log: no ground truth)")
    table.add_row("time span", f"{rows[0].ts} … {rows[-1].ts} (÷{speedup:g})")
    console.print(table)


def closed_loop(
    url: Annotated[str, typer.Option(help="Base URL of the serving endpoint")] = "http://127.0.0.1:8000",
    requests: Annotated[int, typer.Option(help="Ad requests to send")] = 1000,
    rate: Annotated[float, typer.Option(help="Requests per second (0 = back to back)")] = 50.0,
    users: Annotated[int, typer.Option(help="Number of users")] = 1000,
    ads: Annotated[int, typer.Option(help="Number of ads (the catalog serving must know)")] = 200,
    seed: Annotated[int, typer.Option(help="Random seed")] = 0,
    drift_at: Annotated[
        float, typer.Option(help="Drift point (fraction of expected impressions); <=0 off")
    ] = 0.5,
    drift_share: Annotated[float, typer.Option(help="Share of users whose taste changes")] = 0.3,
    drift_mode: Annotated[
        DriftMode,
        typer.Option(
            help="redraw (each drifted user redraws), trend (a shared category shift) or handover "
            "(the in-season categories change)"
        ),
    ] = DriftMode.redraw,
    out: OutOpt = None,
    kafka: KafkaOpt = False,
) -> None:
    """Ask serving for ads and emit the simulated users' clicks, dwell and conversions."""
    from workloads import Market, MarketConfig
    from workloads.closed_loop import ClosedLoopReport, run_closed_loop, served_auc
    from workloads.sinks import KafkaSink

    if (out is None) == (not kafka):
        raise typer.BadParameter("give exactly one of --out FILE or --kafka", param_hint="--out/--kafka")
    try:
        cfg = MarketConfig(seed=seed, n_users=users, n_ads=ads, drift_share=drift_share,
                           drift_at=drift_at if drift_at > 0 else None,
                           drift_mode=drift_mode.value)  # fmt: skip
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    market = Market(cfg)

    async def go() -> ClosedLoopReport:
        if out is not None:
            from schemas.codec import encode

            with out.open("wb") as fh:

                async def to_file(batch: list) -> None:  # type: ignore[type-arg]
                    fh.writelines(encode(m) + b"\n" for m in batch)

                return await run_closed_loop(market, url, requests, to_file, rate=rate)
        from deploy.stack import create_topics_async

        settings = Settings()
        await create_topics_async(settings)
        async with KafkaSink(settings) as sink:
            return await run_closed_loop(market, url, requests, sink.send_many, rate=rate)

    with console.status(f"closed loop against {url} ({requests} requests)"):
        report = asyncio.run(go())
    s = market.summary()
    table = Table("measure", "value", title=f"closed loop → {out or 'kafka'}")
    table.add_row("requests / served ads", f"{report.requests:,} / {report.served:,}")
    table.add_row("errors", str(dict(report.errors)) or "none")
    for kind, n in sorted(report.events.items()):
        table.add_row(f"emitted {kind}", f"{n:,}")
    table.add_row("CTR", _fmt(s.ctr))
    table.add_row("oracle AUC (true model on served impressions)", _fmt(s.oracle_auc))
    table.add_row("served pCTR AUC (the serving model)", _fmt(served_auc(report, market)))
    console.print(table)


app = typer.Typer(help="The workloads room: simulated and replayed event streams, the closed loop.")
app.command("simulate")(simulate)
app.command("closed-loop")(closed_loop)
app.add_typer(replay_app, name="replay")
