"""Benchmark: soak — the whole loop at a steady rate for a long time; does anything grow?

On the running loop (streams worker, online trainer and Ray Serve ad server as their own
processes, `deploy.demo.Demo`, default settings but for the run's own topics, keys and
database; base model trained on simulator history that also warms the users' state), the
closed-loop simulator sends `--rate` requests/s for `--minutes`. Every `--every-s` seconds it
samples:

- RSS of each process group (worker, trainer, serve — the Serve app's Ray processes included),
  from /proc;
- Redis: keys under the run's prefix and their summed `MEMORY USAGE` (the run's own share; the
  server may hold other tenants' keys);
- consumer lag of the worker's and the trainer's groups (log-end offset − committed offset,
  summed over partitions).

Judged after warm-up (the first `--warmup` share of the run, and at least the label-join window
plus a minute): growth = (mean of the last fifth − mean of the first fifth after warm-up) / the
latter, per series. The worker holds every impression as a pending label until the join window
(`attribution_window_s`) closes, so Redis fills for one window before it can be flat; a soak
shorter than a few windows runs with a shorter window of its own (`--attribution-window-s`,
default 300 s, recorded in the result) rather than judging that fill as growth. Goal: < 10 % for every RSS and
for Redis memory; lag must not trend up (its growth is reported in records, as lag can be 0).

Usage: `.venv/bin/python -m benchmarks.soak [--minutes 30] [--rate 20]` → `benchmarks/results/soak.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from deploy.machine import machine, write_result
from schemas import topics
from schemas.settings import Settings

OUT = Path(__file__).parent / "results" / "soak.json"
ROLES = ("worker", "trainer", "serve")


def group_rss_mb(pgid: int) -> float:
    """Summed resident memory of every process in a process group, MiB."""
    total_kb = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pgid:
                continue
            for line in Path(f"/proc/{entry}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
                    break
        except (OSError, ProcessLookupError, ValueError):
            continue
    return total_kb / 1024


def redis_usage(settings: Settings) -> tuple[int, float]:
    """(keys, MiB) under the run's Redis prefix."""
    import redis

    from schemas.clients import redis_args

    client = redis.Redis.from_url(**redis_args(settings))
    try:
        keys, total = 0, 0
        for key in client.scan_iter(match=f"{settings.redis_prefix}*", count=1000):
            keys += 1
            total += int(client.memory_usage(key) or 0)
        return keys, total / 2**20
    finally:
        client.close()


async def consumer_lag(settings: Settings, groups: dict[str, list[str]]) -> dict[str, int]:
    """Per group: log-end offset − committed offset, summed over its topics' partitions."""
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient

    from schemas.clients import kafka_args

    admin = AIOKafkaAdminClient(**kafka_args(settings))
    consumer = AIOKafkaConsumer(**kafka_args(settings))
    await admin.start()
    await consumer.start()
    await consumer.topics()  # fetches the metadata of every topic
    try:
        out = {}
        for group, names in groups.items():
            tps = [
                TopicPartition(t, p)
                for t in (settings.topic_prefix + n for n in names)
                for p in sorted(consumer.partitions_for_topic(t) or ())
            ]
            ends = await consumer.end_offsets(tps)
            committed = await admin.list_consumer_group_offsets(group, partitions=tps)
            out[group] = int(
                sum(max(0, ends[tp] - (committed[tp].offset if tp in committed else 0)) for tp in tps)
            )
        return out
    finally:
        await consumer.stop()
        await admin.close()


def growth(values: list[float], warmup: float) -> float:
    """(mean of the last fifth − mean of the first fifth after warm-up) / the latter."""
    xs = values[int(len(values) * warmup) :]
    if len(xs) < 5:
        return float("nan")
    k = max(1, len(xs) // 5)
    first, last = float(np.mean(xs[:k])), float(np.mean(xs[-k:]))
    return (last - first) / first if first > 0 else float("nan")


async def soak(args: argparse.Namespace, demo: Any, url: str, samples: list[dict[str, Any]]) -> Any:
    """The steady closed loop, sampled every `every_s` seconds."""
    from workloads import Market, MarketConfig
    from workloads.closed_loop import ClosedLoopReport, run_closed_loop
    from workloads.sinks import KafkaSink

    s = demo.settings
    n_requests = int(args.minutes * 60 * args.rate)
    # steady: the history's world, no drift, no new ads
    cfg = MarketConfig(seed=demo.spec.seed, n_users=demo.spec.users, n_ads=demo.spec.ads, drift_at=None,
                       new_ads_at=None, n_new_ads=0)  # fmt: skip
    market = Market(cfg)
    report = ClosedLoopReport()
    groups = {
        f"{s.topic_prefix}adstream-streams": [
            topics.IMPRESSIONS,
            topics.CLICKS,
            topics.DWELL,
            topics.CONVERSIONS,
        ],
        f"{s.topic_prefix}{s.online.group}": [topics.TRAINING_EXAMPLES],
    }
    t0 = time.monotonic()
    async with KafkaSink(s) as sink:
        loop = asyncio.create_task(
            run_closed_loop(market, url, n_requests, sink.send_many, rate=args.rate, report=report)
        )
        while not loop.done():
            await asyncio.wait([loop], timeout=args.every_s)
            demo.check_children()
            keys, redis_mb = redis_usage(s)
            try:
                lag: dict[str, Any] = await consumer_lag(s, groups)
            except Exception as exc:  # the lag probe must not end the soak; recorded as missing
                lag = {"error": str(exc)[:200]}
            sample = {
                "t_s": round(time.monotonic() - t0, 1),
                "requests": report.requests,
                "errors": sum(report.errors.values()),
                "p99_ms": float(np.percentile(report.latencies_ms[-500:], 99))
                if report.latencies_ms
                else None,
                "rss_mb": {role: round(group_rss_mb(demo.children[role].pid), 1) for role in ROLES},
                "redis_keys": keys,
                "redis_mb": round(redis_mb, 2),
                "lag": lag,
            }
            samples.append(sample)
            print(json.dumps(sample), flush=True)
        await loop
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=20.0, help="closed-loop requests per second")
    ap.add_argument("--every-s", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=0.2, help="share of the run before growth is judged")
    ap.add_argument("--users", type=int, default=400)
    ap.add_argument("--ads", type=int, default=300)
    ap.add_argument("--history", type=int, default=20_000)
    ap.add_argument("--port", type=int, default=8021)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--attribution-window-s", type=float, default=300.0,
        help="the run's label-join window (pending impressions fill Redis for one window)",
    )  # fmt: skip
    args = ap.parse_args()
    start = machine()  # the load before this benchmark's own
    # every child process of the run takes it from the environment, like any other setting
    os.environ["ADSTREAM_STREAMS__ATTRIBUTION_WINDOW_S"] = repr(args.attribution_window_s)
    args.warmup = max(args.warmup, min(0.8, (args.attribution_window_s + 60) / (args.minutes * 60)))

    from deploy import stack
    from deploy.demo import (
        Demo,
        DemoSpec,
        campaigns_file,
        free_port,
        produce_file,
        running,
        wait_rows,
        write_history,
    )

    settings = Settings()
    stack.up(settings)
    console = Console()
    spec = DemoSpec(users=args.users, ads=args.ads, history=args.history, port=args.port,
                    dashboard_port=free_port())  # fmt: skip
    demo = Demo(spec, settings, console.print)
    stack.create_topics(demo.settings)
    history, catalog = demo.dir / "history.jsonl", demo.dir / "catalog.jsonl"
    truth = write_history(spec, history, catalog)
    demo.run("train", "train", "--events", str(history), "--epochs", "2")
    demo.run("catalog", "produce", "ad.catalog", str(catalog))
    demo.run("campaigns", "produce", "ad.campaigns", str(campaigns_file(catalog)))
    samples: list[dict[str, Any]] = []
    with running(demo):
        demo.start("worker", "worker", "--loglevel", "warn")
        demo.start("trainer", "trainer", "--metrics-port", str(demo.trainer_metrics_port))
        demo.start("serve", "serve", "--catalog", str(catalog), "--port", str(spec.port))
        url = f"http://127.0.0.1:{spec.port}"
        demo.wait_http(f"{url}/healthz")
        asyncio.run(produce_file(demo.settings, history))
        wait_rows(demo.settings, "impressions", truth["impressions"], 300, demo)
        report = asyncio.run(soak(args, demo, url, samples))

    series: dict[str, list[float]] = {f"rss_{r}": [s["rss_mb"][r] for s in samples] for r in ROLES}
    series["redis_mb"] = [s["redis_mb"] for s in samples]
    lag_series = {
        g: [float(s["lag"][g]) for s in samples if isinstance(s["lag"].get(g), int)]
        for g in (samples[0]["lag"] if samples else {})
        if g != "error"
    }
    growths = {name: growth(vals, args.warmup) for name, vals in series.items()}
    result = {
        "machine": start,
        "minutes": args.minutes,
        "rate": args.rate,
        "attribution_window_s": args.attribution_window_s,
        "warmup_share": round(args.warmup, 3),
        "requests": report.requests,
        "errors": dict(report.errors),
        "growth": growths,
        "lag_end_records": {g: (v[-1] if v else None) for g, v in lag_series.items()},
        "lag_max_records": {g: (max(v) if v else None) for g, v in lag_series.items()},
        "goal_met": all(g == g and g < 0.10 for g in growths.values()),
        "samples": samples,
    }
    write_result(args.out, result)
    table = Table(
        "series",
        "after warm-up: first → last",
        "growth",
        title=f"soak {args.minutes:g} min @ {args.rate:g}/s",
    )
    for name, vals in series.items():
        xs = vals[int(len(vals) * args.warmup) :]
        table.add_row(name, f"{xs[0]:.1f} → {xs[-1]:.1f}" if xs else "-", f"{growths[name]:+.1%}")
    for g, v in lag_series.items():
        table.add_row(f"lag {g}", f"max {max(v) if v else '-'} / end {v[-1] if v else '-'} records", "")
    console.print(table)
    console.print(
        f"{report.requests:,} requests, errors {dict(report.errors) or 'none'}; "
        f"goal met: {result['goal_met']}"
    )


if __name__ == "__main__":
    main()
