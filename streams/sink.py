"""The ClickHouse sink: valid events → rows of the raw tables (see attribution/migrations).

Idempotent by construction: tables are ReplacingMergeTree keyed on `event_id`, so a batch
inserted again after a crash collapses; read them with FINAL or `uniq(event_id)`. The sink is a
Protocol so a different store can stand in; `ClickHouseSink` is the real one.

Tables are partitioned by month (`toYYYYMM(ts)`) and current ClickHouse refuses an INSERT block
that touches more than `max_partitions_per_insert_block` (100) partitions, for good: a batch
spanning more months (old events replayed, a hostile producer) is inserted in blocks of at most
`settings.sink.max_partitions` months each.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from operator import attrgetter
from typing import Any, Protocol

from schemas.events import Message
from schemas.rows import RAW_ROWS
from schemas.settings import Settings

log = logging.getLogger(__name__)

# each event model's table and columns: the contract of the raw tables (`schemas.rows`)
COLUMNS: dict[type[Message], tuple[str, tuple[str, ...]]] = dict(RAW_ROWS)
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


def _month(ts: int) -> int:
    t = time.gmtime(ts)
    return t.tm_year * 12 + t.tm_mon - 1


def month_blocks(batch: list[tuple[Any, ...]], max_months: int) -> list[list[tuple[Any, ...]]]:
    """`batch` (rows of one table, `ts` in column 1) cut into blocks of at most `max_months`
    distinct months each; one block (the batch itself) when it spans fewer."""
    if not batch:
        return []
    lo = min(row[1] for row in batch)
    hi = max(row[1] for row in batch)
    if _month(hi) - _month(lo) < max_months:
        return [batch]
    by_month: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
    for row in batch:
        by_month[_month(row[1])].append(row)
    months = sorted(by_month)
    return [
        [row for mo in months[i : i + max_months] for row in by_month[mo]]
        for i in range(0, len(months), max_months)
    ]


class EventSink(Protocol):
    """Where valid events are written in batches; `write` must be idempotent per event_id."""

    async def write(self, rows: dict[str, list[tuple[Any, ...]]]) -> None: ...

    def close(self) -> None: ...


class ClickHouseSink:
    """Batched inserts into the raw tables over the native protocol (in a worker thread)."""

    def __init__(self, settings: Settings) -> None:
        from schemas.clients import clickhouse_client, clickhouse_database

        # the tables are attribution's (its migrations create them: `adstream migrate`, run by
        # `adstream worker` before it starts); streams only inserts into them
        self._client = clickhouse_client(settings, clickhouse_database(settings))
        self._lock = asyncio.Lock()
        self.max_months = settings.sink.max_partitions

    def _insert(self, rows: dict[str, list[tuple[Any, ...]]]) -> None:
        by_table = {table: cols for _, (table, cols) in COLUMNS.items()}
        for table, batch in rows.items():
            cols = (*by_table[table], "kafka_partition", "kafka_offset")
            for block in month_blocks(batch, self.max_months):
                self.insert_block(table, cols, block)

    def insert_block(self, table: str, cols: Sequence[str], block: list[tuple[Any, ...]]) -> None:
        """One INSERT of rows (in `cols` order) into `table`, on the calling thread, sent in
        columnar form: the driver packs each column whole (given rows, it rebuilds every column
        in Python, one list comprehension per column over the rows; `zip` transposes in C)."""
        if not block:
            return
        # `ts` is epoch seconds: DateTime takes it as is (no tz conversion on the client)
        self._client.execute(
            f"INSERT INTO {table} ({', '.join(cols)}) VALUES",
            list(zip(*block, strict=True)),
            types_check=False,
            columnar=True,
            settings={},
        )

    async def write(self, rows: dict[str, list[tuple[Any, ...]]]) -> None:
        async with self._lock:
            await asyncio.to_thread(self._insert, rows)

    def close(self) -> None:
        self._client.disconnect()


def empty_rows() -> dict[str, list[tuple[Any, ...]]]:
    return defaultdict(list)
