"""`adstream demo`: run the whole loop once on the local stack and report what each part did."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

console = Console()


def register(app: typer.Typer) -> None:
    """Add `adstream demo` to the CLI."""

    @app.command()
    def demo(
        users: Annotated[int, typer.Option(help="Simulated users")] = 400,
        ads: Annotated[int, typer.Option(help="Ads in the catalog")] = 300,
        history: Annotated[int, typer.Option(help="Impressions of history for offline training")] = 20_000,
        requests: Annotated[int, typer.Option(help="Ad requests in the closed loop")] = 600,
        rate: Annotated[float, typer.Option(help="Closed-loop requests per second")] = 20.0,
        seed: Annotated[int, typer.Option(help="Market seed")] = 7,
        port: Annotated[int, typer.Option(help="HTTP port of the demo's ad server")] = 8011,
    ) -> None:
        """Simulate, train, serve, click and learn: the whole loop, on the local stack."""
        from deploy import stack
        from deploy.demo import DemoSpec, run_demo
        from schemas.settings import Settings

        settings = Settings()
        stack.up(settings)
        spec = DemoSpec(
            users=users, ads=ads, history=history, requests=requests, rate=rate, seed=seed, port=port
        )
        report = run_demo(spec, settings, console.print)
        console.rule("what the loop did")
        console.print(summary_table(report))
        console.print(f"full report: {report['dir']}/report.json")


def summary_table(report: dict[str, Any]) -> Table:
    """The demo's figures, one row each."""
    metrics = {k: float(v) for k, v in report["serving_metrics"].items()}
    table = Table("part", "what it did")
    served = metrics.get('adstream_serving_requests_total{status="200"}', 0.0)
    count = metrics.get("adstream_serving_request_latency_seconds_count", 0.0)
    mean_ms = 1000 * metrics.get("adstream_serving_request_latency_seconds_sum", 0.0) / max(count, 1.0)
    table.add_row("serving", f"{served:.0f} requests answered (mean {mean_ms:.1f} ms in the app)")
    for table_name, n in report["clickhouse"].items():
        table.add_row("ClickHouse", f"{n} {table_name}")
    table.add_row("Redis", f"{report['redis_users']} keys of user state")
    applied = metrics.get('adstream_serving_deltas_total{outcome="applied"}', 0.0)
    table.add_row("hot swap", f"{applied:.0f} LoRA deltas applied in the serving replica")
    for info in report["adapters_after"]:
        table.add_row(f"adapter {info['adapter_id']}", f"version {info['version']} (seq {info['seq']})")
    return table
