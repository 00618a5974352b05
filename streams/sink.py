"""The ClickHouse sink: valid events → rows of the raw tables (see attribution/migrations).

Idempotent by construction: tables are ReplacingMergeTree keyed on `event_id`, so a batch
inserted again after a crash collapses; read them with FINAL or `uniq(event_id)`. The sink is a
Protocol so a different store can stand in; `ClickHouseSink` is the real one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from operator import attrgetter
from typing import Any, Protocol

from schemas.events import AdCreative, Click, Conversion, Dwell, Impression, Message
from schemas.settings import Settings

log = logging.getLogger(__name__)

COLUMNS: dict[type[Message], tuple[str, tuple[str, ...]]] = {
    Impression: (
        "impressions",
        ("event_id", "ts", "ts_ms", "user_id", "request_id", "ad_id", "campaign_id", "advertiser_id",
         "slot", "position", "price", "pctr", "model_version", "adapter_version"),
    ),
    Click: ("clicks", ("event_id", "ts", "ts_ms", "user_id", "impression_id", "ad_id", "campaign_id")),
    Dwell: ("dwell", ("event_id", "ts", "ts_ms", "user_id", "impression_id", "ad_id", "dwell_ms")),
    Conversion: (
        "conversions",
        ("event_id", "ts", "ts_ms", "user_id", "campaign_id", "advertiser_id", "value", "ad_id"),
    ),
    AdCreative: (
        "ads",
        ("event_id", "ts", "ts_ms", "ad_id", "campaign_id", "advertiser_id", "category", "title",
         "bid", "daily_budget", "active"),
    ),
}  # fmt: skip
TABLES = tuple(table for table, _ in COLUMNS.values())


# every table starts with event_id, ts, ts_ms; the rest are plain attributes (bool → UInt8 is
# done by the driver), read in one C call per event
_REST = {model: attrgetter(*cols[3:]) for model, (_, cols) in COLUMNS.items()}


def row_of(
    event: Message, partition: int, offset: int, ts: float | None = None
) -> tuple[str, tuple[Any, ...]]:
    """The table and row (columns as in COLUMNS, then kafka_partition, kafka_offset) of an event.

    `ts` is `event.ts.timestamp()` when the caller has it already.
    """
    model = type(event)
    t = event.ts.timestamp() if ts is None else ts
    return COLUMNS[model][0], (
        event.event_id,
        int(t),
        round(t * 1000),
        *_REST[model](event),
        partition,
        offset,
    )


class EventSink(Protocol):
    """Where valid events are written in batches; `write` must be idempotent per event_id."""

    async def write(self, rows: dict[str, list[tuple[Any, ...]]]) -> None: ...

    def close(self) -> None: ...


class ClickHouseSink:
    """Batched inserts into the raw tables over the native protocol (in a worker thread)."""

    def __init__(self, settings: Settings) -> None:
        from clickhouse_driver import Client

        from schemas.settings import clickhouse_connect_args, clickhouse_database

        # the tables are attribution's (its migrations create them: `adstream migrate`, run by
        # `adstream worker` before it starts); streams only inserts into them
        self._client = Client(**clickhouse_connect_args(settings, clickhouse_database(settings)))
        self._lock = asyncio.Lock()

    def _insert(self, rows: dict[str, list[tuple[Any, ...]]]) -> None:
        by_table = {table: cols for _, (table, cols) in COLUMNS.items()}
        for table, batch in rows.items():
            if not batch:
                continue
            cols = ", ".join((*by_table[table], "kafka_partition", "kafka_offset"))
            # `ts` is epoch seconds: DateTime takes it as is (no tz conversion on the client)
            self._client.execute(
                f"INSERT INTO {table} ({cols}) VALUES", batch, types_check=False, settings={}
            )

    async def write(self, rows: dict[str, list[tuple[Any, ...]]]) -> None:
        async with self._lock:
            await asyncio.to_thread(self._insert, rows)

    def close(self) -> None:
        self._client.disconnect()


def empty_rows() -> dict[str, list[tuple[Any, ...]]]:
    return defaultdict(list)
