"""What the multi-node streams test counts: the events on the topics, the rows in ClickHouse, the
states in Redis, the partitions' progress across a rebalance, and the load's outcomes per window."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections import Counter, defaultdict
from datetime import datetime
from typing import Any, NamedTuple

import httpx

from schemas import topics
from schemas.settings import Settings

# the user-event topics and the raw table each lands in (attribution/migrations)
TABLES = {topics.IMPRESSIONS: "impressions", topics.CLICKS: "clicks", topics.DWELL: "dwell",
          topics.CONVERSIONS: "conversions"}  # fmt: skip


class CountingClient(httpx.AsyncClient):
    """The closed loop's HTTP client, logging every `POST`'s outcome with its time."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.log: list[tuple[float, str]] = []

    async def post(self, *args: Any, **kw: Any) -> httpx.Response:
        t = time.monotonic()
        try:
            r = await super().post(*args, **kw)
        except httpx.HTTPError as exc:
            self.log.append((t, type(exc).__name__))
            raise
        self.log.append((t, "2xx" if r.status_code < 300 else str(r.status_code)))
        return r

    def count(self, lo: float, hi: float) -> dict[str, int]:
        return dict(Counter(o for t, o in self.log if lo <= t < hi))


class Record(NamedTuple):
    partition: int
    offset: int
    ts_ms: int  # the record's Kafka timestamp
    value: bytes


def read_topic(s: Settings, base: str) -> list[Record]:
    """Every record of a topic from the beginning, until idle."""
    from aiokafka import AIOKafkaConsumer

    async def go() -> list[Record]:
        c = AIOKafkaConsumer(topics.topic_name(base, s.topic_prefix), bootstrap_servers=s.kafka.bootstrap,
                             auto_offset_reset="earliest", enable_auto_commit=False)  # fmt: skip
        await c.start()
        out: list[Record] = []
        try:
            idle = time.monotonic()
            while time.monotonic() - idle < 4.0:
                for recs in (await c.getmany(timeout_ms=500)).values():
                    out += [Record(r.partition, r.offset, r.timestamp, r.value) for r in recs]
                    idle = time.monotonic()
        finally:
            await c.stop()
        return out

    return asyncio.run(go())


def last_offsets(s: Settings, on_topics: dict[str, list[Record]]) -> dict[str, int]:
    """`{topic}:{partition}` → the last offset read there (the keys of the worker's applied
    offsets in Redis), for every non-empty partition of the topics read."""
    out: dict[str, int] = {}
    for base, records in on_topics.items():
        for rec in records:
            key = f"{topics.topic_name(base, s.topic_prefix)}:{rec.partition}"
            out[key] = max(out.get(key, -1), rec.offset)
    return out


def applied_offsets(r: Any, s: Settings) -> dict[str, int]:
    """The worker's applied offsets in Redis (written in one transaction with the states)."""
    raw = r.hgetall(f"{s.redis_prefix}streams:offsets")
    return {k.decode(): int(v) for k, v in raw.items() if not k.startswith(b"stream_ts:")}


class ProgressWatch:
    """After a kill, per partition of the user topics: how long its first record that arrived
    after the kill waited before a worker applied it. The survivor's partitions wait a batch;
    the dead worker's wait until the group has rebalanced (records that arrive later do not)."""

    def __init__(self, r: Any, s: Settings) -> None:
        self.r, self.s = r, s
        self.t0 = time.monotonic()
        self.at_kill = applied_offsets(r, s)
        self.arrived: dict[str, float] = {}  # first time the partition held a record not applied at the kill
        self.applied: dict[str, float] = {}  # first time that record (or a later one) was applied
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    async def _run(self) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        c = AIOKafkaConsumer(bootstrap_servers=self.s.kafka.bootstrap)
        await c.start()
        try:
            await c.topics()
            names = [topics.topic_name(t, self.s.topic_prefix) for t in TABLES]
            tps = [TopicPartition(n, p) for n in names for p in sorted(c.partitions_for_topic(n) or ())]
            while not self.stop.is_set():
                ends = await c.end_offsets(tps)
                done = applied_offsets(self.r, self.s)
                t = time.monotonic() - self.t0
                for tp, end in ends.items():
                    key, base = (
                        f"{tp.topic}:{tp.partition}",
                        self.at_kill.get(f"{tp.topic}:{tp.partition}", -1),
                    )
                    if key not in self.arrived and end - 1 > base:
                        self.arrived[key] = t
                    if key in self.arrived and key not in self.applied and done.get(key, -1) > base:
                        self.applied[key] = t
                await asyncio.sleep(0.25)
        except BaseException as exc:
            self.error = exc
        finally:
            await c.stop()

    def close(self) -> dict[str, float]:
        """Partition → seconds its first record after the kill waited (longest first)."""
        self.stop.set()
        self.thread.join(15)
        if self.error is not None:
            raise self.error
        waits = {k: round(self.applied[k] - self.arrived[k], 2) for k in self.applied}
        return dict(sorted(waits.items(), key=lambda kv: -kv[1]))


def dead_letters(s: Settings) -> list[dict[str, Any]]:
    """The dead letters: where each came from, why, and the event id when the record had one."""
    out = []
    for rec in read_topic(s, topics.DLQ):
        d = json.loads(rec.value)
        try:
            eid = json.loads(base64.b64decode(d["raw"])).get("event_id")
        except ValueError:
            eid = None
        out.append({"topic": d["source_topic"], "error": d["error"][:300], "event_id": eid})
    return out


def event_ids(records: list[Record]) -> list[str]:
    return [json.loads(r.value)["event_id"] for r in records]


def users_of(records: list[Record]) -> Counter[str]:
    return Counter(json.loads(r.value)["user_id"] for r in records)


def ahead_of_time(records: list[Record], max_skew_s: float) -> set[str]:
    """Event ids of the records whose event time is more than `max_skew_s` after their Kafka
    timestamp: the worker dead-letters them (`streams.ingest`, future_timestamp). The closed
    loop's last flush produces them: the conversions the market has scheduled up to hours ahead."""
    out = set()
    for r in records:
        d = json.loads(r.value)
        if datetime.fromisoformat(d["ts"]).timestamp() > r.ts_ms / 1000 + max_skew_s:
            out.add(d["event_id"])
    return out


def stored(s: Settings, table: str) -> dict[str, int]:
    """A raw table's rows: all of them, after FINAL, distinct event ids."""
    from schemas.clients import clickhouse_client, clickhouse_database

    c = clickhouse_client(s, clickhouse_database(s))
    try:
        return {
            "raw": c.execute(f"SELECT count() FROM {table}")[0][0],
            "final": c.execute(f"SELECT count() FROM {table} FINAL")[0][0],
            "distinct": c.execute(f"SELECT uniqExact(event_id) FROM {table}")[0][0],
        }
    finally:
        c.disconnect()


def stored_ids(s: Settings, table: str, optimize: bool = False) -> Counter[str]:
    """Rows per event id of a raw table (after `OPTIMIZE … FINAL` when `optimize`: the merge that
    collapses a batch inserted again by the worker that took the partition over)."""
    from schemas.clients import clickhouse_client, clickhouse_database

    c = clickhouse_client(s, clickhouse_database(s))
    try:
        if optimize:
            c.execute(f"OPTIMIZE TABLE {table} FINAL")
        return Counter(
            {eid: n for eid, n in c.execute(f"SELECT event_id, count() FROM {table} GROUP BY event_id")}
        )
    finally:
        c.disconnect()


def windows(log: list[tuple[float, str]], t0: float, t1: float, width_s: float) -> list[dict[str, Any]]:
    """Outcomes per window of `width_s` seconds from `t0` to `t1` (times relative to `t0`)."""
    out: dict[int, Counter[str]] = defaultdict(Counter)
    for t, o in log:
        if t0 <= t < t1:
            out[int((t - t0) // width_s)][o] += 1
    return [{"from_s": i * width_s, **dict(out[i])} for i in range(int((t1 - t0) // width_s) + 1)]
