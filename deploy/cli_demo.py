"""`adstream demo`: run the whole loop once on the local stack, live, and write a report."""

from __future__ import annotations

import math
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from workloads.config import DriftMode

console = Console()


app = typer.Typer(help="The whole loop once, live.")


@app.command()
def demo(
    users: Annotated[int, typer.Option(help="Simulated users")] = 400,
    ads: Annotated[int, typer.Option(help="Ads in the catalog")] = 300,
    history: Annotated[int, typer.Option(help="Impressions of history for offline training")] = 20_000,
    requests: Annotated[int, typer.Option(help="Ad requests in the closed loop")] = 6_000,
    rate: Annotated[float, typer.Option(help="Closed-loop requests per second")] = 30.0,
    seed: Annotated[int, typer.Option(help="Market seed")] = 7,
    drift_mode: Annotated[DriftMode, typer.Option(help="Interest drift half-way")] = DriftMode.handover,
    port: Annotated[int, typer.Option(help="HTTP port of the demo's ad server")] = 8011,
    dashboard_port: Annotated[int, typer.Option(help="HTTP port of the demo's dashboard")] = 8050,
    live: Annotated[bool, typer.Option(help="Keep the live table on screen after the run")] = True,
    cold: Annotated[
        bool, typer.Option(help="Do not produce the history to Kafka (users served with empty state)")
    ] = False,
    cpm_share: Annotated[
        float,
        typer.Option(help="Share of campaigns paying per thousand shown (CPM); the rest pay per click"),
    ] = 0.2,
) -> None:
    """Simulate, train, serve, click and learn: the whole loop on the local stack, shown live."""
    from deploy import stack
    from deploy.demo import DemoSpec, run_demo
    from schemas.settings import Settings

    settings = Settings()
    stack.up(settings)
    spec = DemoSpec(users=users, ads=ads, history=history, requests=requests, rate=rate, seed=seed,
                    port=port, dashboard_port=dashboard_port, drift_mode=drift_mode.value,
                    warm_state=not cold, cpm_share=cpm_share)  # fmt: skip
    report = run_demo(spec, settings, console.print, live=live)
    console.rule("what the loop did")
    console.print(summary_table(report))
    console.print(
        f"report: {report['dir']}/report.md (+ report.json, auc_smoothed.png, auc_over_time.png, latency.png)"
    )


def _f(x: float) -> str:
    return f"{x:.3f}" if isinstance(x, float) and math.isfinite(x) else "n/a"


def summary_table(report: dict[str, Any]) -> Table:
    """The demo's headline figures, one row each."""
    q, loop = report["quality"], report["loop"]
    table = Table("part", "what it did")
    table.add_row(
        "serving",
        f"{loop['requests']:,} requests, {loop['served']:,} ads; P50 {loop['p50_ms']:.1f} / "
        f"P99 {loop['p99_ms']:.1f} ms (client side); errors {loop['errors'] or 'none'}",
    )
    from deploy.demo_live import live_rows

    for name, value in live_rows(report.get("live")):
        table.add_row(name, value)
    table.add_row(
        "trainer's rolling AUC (before drift → end)",
        f"online {_f(q['online_auc']['before_drift'])} → {_f(q['online_auc']['end'])}, "
        f"frozen base {_f(q['base_auc']['before_drift'])} → {_f(q['base_auc']['end'])}",
    )
    table.add_row(
        "served pCTR AUC vs oracle",
        f"{_f(q['served_auc']['before_drift'])} vs {_f(q['oracle_auc']['before_drift'])} before the drift; "
        f"offline holdout {_f(report['offline']['holdout_auc'])}",
    )
    for table_name, n in report["clickhouse"].items():
        table.add_row("ClickHouse", f"{n:,} {table_name}")
    table.add_row(
        "adapters", ", ".join(f"{k}={v}" for k, v in sorted(report["adapters_end"].items())) or "none"
    )
    return table
