"""Load benchmark: how many simulator events per second reach the Kafka broker.

Events are simulated before the clock starts (what is measured is producing, not simulating);
each goes to its contract topic with its contract key, partitioned like the Java client
(murmur2), acks=1; every run writes to fresh topics and is checked by consuming them back.
Three paths are measured:

- `batch`: pre-encoded events grouped per partition into aiokafka `create_batch()` batches
  sent with `send_batch()` (skips the per-message bookkeeping of the accumulator);
- `send`: pre-encoded events through `producer.send()` one by one, large linger and batches;
- `sink`: `workloads.sinks.produce` on the built messages, i.e. what `adstream simulate --kafka`
  does after simulating: route, JSON-encode and batch inside the timed section.

`events_per_s` in the JSON is the best path; every run is listed under `runs`.
Usage: `.venv/bin/python -m benchmarks.produce [--events 500000] [--mode batch|send|sink|all]`.
Prints a table and writes `benchmarks/results/produce.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from deploy.machine import machine, write_result
from deploy.stack import create_topics
from schemas.settings import Settings
from schemas.signing import event_key
from workloads import Market, MarketConfig
from workloads.entities import Event
from workloads.sinks import produce, routed

LABELS = {
    "batch": "aiokafka create_batch/send_batch, pre-encoded",
    "send": "aiokafka send() per event, pre-encoded",
    "sink": "workloads.sinks.produce (CLI path, encodes)",
}
RESULTS = Path(__file__).resolve().parent / "results" / "produce.json"


def simulate(n_impressions: int, seed: int) -> list[Event]:
    """A simulated stream of about 1.08 × n_impressions events."""
    market = Market(MarketConfig(seed=seed, n_users=10_000, n_ads=2000), signing_key=event_key(Settings()))
    return list(market.open_loop(n_impressions))


async def run_sink(settings: Settings, messages: list[Event]) -> float:
    """Seconds for `workloads.sinks.produce` (the CLI's path: route, encode, batch) on built messages."""
    t0 = time.perf_counter()
    await produce(messages, settings)
    return time.perf_counter() - t0


async def _partitions(settings: Settings, topics: set[str]) -> dict[str, list[int]]:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap)
    await producer.start()
    try:
        return {t: sorted(await producer.partitions_for(t)) for t in topics}
    finally:
        await producer.stop()


def assign_partitions(
    events: list[tuple[str, bytes, bytes]], parts: dict[str, list[int]]
) -> dict[tuple[str, int], list[tuple[bytes, bytes]]]:
    """Group events per (topic, partition) with the default (murmur2) key partitioner."""
    from aiokafka.partitioner import DefaultPartitioner

    partitioner = DefaultPartitioner()
    groups: dict[tuple[str, int], list[tuple[bytes, bytes]]] = defaultdict(list)
    for topic, key, value in events:
        p = partitioner(key, parts[topic], parts[topic])
        groups[(topic, p)].append((key, value))
    return groups


async def run_send(
    settings: Settings, events: list[tuple[str, bytes, bytes]], linger_ms: int, batch: int
) -> float:
    """Seconds to produce every event with `send()`."""
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(
        bootstrap_servers=settings.kafka.bootstrap, linger_ms=linger_ms, max_batch_size=batch, acks=1
    )
    await producer.start()
    try:
        t0 = time.perf_counter()
        futures = []
        for i, (topic, key, value) in enumerate(events):
            futures.append(await producer.send(topic, value=value, key=key))
            if i % 50_000 == 49_999:
                await asyncio.gather(*futures)
                futures.clear()
        await asyncio.gather(*futures)
        return time.perf_counter() - t0
    finally:
        await producer.stop()


async def run_batch(
    settings: Settings, groups: dict[tuple[str, int], list[tuple[bytes, bytes]]], batch: int, inflight: int
) -> float:
    """Seconds to produce every event through per-partition `create_batch()`/`send_batch()`."""
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap, max_batch_size=batch, acks=1)
    await producer.start()
    try:
        t0 = time.perf_counter()
        pending: list[asyncio.Future[Any]] = []
        for (topic, partition), records in groups.items():
            b = producer.create_batch()
            for key, value in records:
                if b.append(key=key, value=value, timestamp=None) is None:
                    pending.append(await producer.send_batch(b, topic, partition=partition))
                    b = producer.create_batch()
                    b.append(key=key, value=value, timestamp=None)
                    if len(pending) >= inflight:
                        await asyncio.gather(*pending)
                        pending.clear()
            if b.record_count():
                pending.append(await producer.send_batch(b, topic, partition=partition))
        await asyncio.gather(*pending)
        return time.perf_counter() - t0
    finally:
        await producer.stop()


async def read_back(settings: Settings, topics: set[str], expected: int, idle_s: float = 5.0) -> Counter[str]:
    """Consume the run's topics from the start and count records per topic (stops when the
    expected number has arrived or nothing came for `idle_s`). End offsets are not used: the
    embedded Tansu broker reports them per batch, not per record."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        *topics, bootstrap_servers=settings.kafka.bootstrap, auto_offset_reset="earliest",
        enable_auto_commit=False, group_id=None, fetch_max_bytes=64 * 1024 * 1024,
        max_partition_fetch_bytes=8 * 1024 * 1024,
    )  # fmt: skip
    await consumer.start()
    counts: Counter[str] = Counter()
    last = time.monotonic()
    try:
        while sum(counts.values()) < expected and time.monotonic() - last < idle_s:
            batches = await consumer.getmany(timeout_ms=500, max_records=50_000)
            for tp, records in batches.items():
                counts[tp.topic[len(settings.topic_prefix) :]] += len(records)
                last = time.monotonic()
    finally:
        await consumer.stop()
    return counts


async def _drop_topics(settings: Settings) -> None:
    """Delete this run's topics (the embedded broker keeps everything in memory)."""
    from deploy.stack import delete_topics_async

    try:
        await delete_topics_async(settings)
    except Exception as exc:  # the numbers stand even when the broker cannot delete topics
        Console(stderr=True).print(f"could not delete benchmark topics: {exc}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=500_000, help="impressions to simulate (events ≈ 1.08×)")
    ap.add_argument("--mode", choices=("batch", "send", "sink", "all"), default="all")
    ap.add_argument("--batch-bytes", type=int, default=1024 * 1024)
    ap.add_argument("--linger-ms", type=int, default=50)
    ap.add_argument("--inflight", type=int, default=16, help="batches awaited together (batch mode)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    start = machine()  # the load before this benchmark's own

    base = Settings()
    console = Console()
    t = time.perf_counter()
    messages = simulate(args.events, args.seed)
    encode_s = time.perf_counter() - t
    events = [routed(m, "") for m in messages]
    n_bytes = sum(len(k) + len(v) for _, k, v in events)
    runs: list[dict[str, Any]] = []
    modes = ("batch", "send", "sink") if args.mode == "all" else (args.mode,)
    for mode in modes:
        # a fresh set of topics per run, so the broker's end offsets count exactly this run
        prefix = f"{base.topic_prefix}bench{uuid.uuid4().hex[:6]}."
        settings = base.model_copy(update={"topic_prefix": prefix})
        create_topics(settings)
        mine = [(prefix + topic, key, value) for topic, key, value in events]
        try:
            if mode == "sink":
                secs = asyncio.run(run_sink(settings, messages))
            elif mode == "send":
                secs = asyncio.run(run_send(settings, mine, args.linger_ms, args.batch_bytes))
            else:
                parts = asyncio.run(_partitions(settings, {e[0] for e in mine}))
                groups = assign_partitions(mine, parts)
                secs = asyncio.run(run_batch(settings, groups, args.batch_bytes, args.inflight))
            stored = sum(asyncio.run(read_back(settings, {e[0] for e in mine}, len(events))).values())
        finally:
            asyncio.run(_drop_topics(settings))
        runs.append({"mode": mode, "seconds": secs, "events_per_s": len(events) / secs,
                     "mb_per_s": n_bytes / secs / 1e6, "read_back": stored})  # fmt: skip
        if stored != len(events):
            console.print(f"[red]{mode}: read back {stored} records, expected {len(events)}")

    best = max(runs, key=lambda r: r["events_per_s"])
    table = Table(
        "client / mode", "events", "seconds", "events/s", "MB/s", "read back", title="produce to Kafka"
    )
    for r in runs:
        table.add_row(LABELS[r["mode"]], f"{len(events):,}", f"{r['seconds']:.2f}",
                      f"{r['events_per_s']:,.0f}", f"{r['mb_per_s']:.1f}", f"{r['read_back']:,}")  # fmt: skip
    console.print(table)
    console.print(f"simulating (not timed above): {len(events) / encode_s:,.0f} events/s")
    import aiokafka

    result = {
        "events_per_s": best["events_per_s"],
        "n_events": len(events),
        "seconds": best["seconds"],
        "client": f"aiokafka {aiokafka.__version__} ({best['mode']})",
        "runs": runs,
        "batch_bytes": args.batch_bytes,
        "linger_ms": args.linger_ms,
        "inflight_batches": args.inflight,
        "acks": 1,
        "mean_event_bytes": n_bytes / len(events),
        "simulate_events_per_s": len(events) / encode_s,
        "read_back": best["read_back"],
        "broker": base.kafka.bootstrap,
        "machine": start | {"arch": platform.machine()},
    }
    write_result(RESULTS, result)
    console.print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
