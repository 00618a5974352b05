"""Read raw contract events back from ClickHouse (the streams sink's tables) for offline training.

Tables and columns are those of `attribution/migrations/001_raw_events.sql`; rows are read with
`FINAL` (deduplicated by `event_id`) and rebuilt into contract models, merged in time order.
`iter_events` reads each table in pages of `chunk` rows (keyset pagination on `ts_ms, event_id`,
one query at a time on one connection) and merges them lazily: memory holds one page per table,
not the tables.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from schemas.clients import clickhouse_client, clickhouse_database
from schemas.errors import StoreError
from schemas.events import AdCreative, Click, Conversion, Dwell, Impression, Message
from schemas.retry import clickhouse_errors
from schemas.settings import Settings

_QUERIES: dict[str, tuple[str, str]] = {
    "ads": ("ad_id, campaign_id, advertiser_id, category, title, bid, daily_budget, active", "ad"),
    "impressions": (
        "user_id, request_id, ad_id, campaign_id, advertiser_id, slot, position, price, pctr, "
        "model_version, adapter_version, query_match",  # query_match: the ranker's query feature as served
        "impression",
    ),
    "clicks": ("user_id, impression_id, ad_id, campaign_id", "click"),
    "dwell": ("user_id, impression_id, ad_id, dwell_ms", "dwell"),
    "conversions": ("user_id, campaign_id, advertiser_id, value, ad_id", "conversion"),
}
_MODELS: dict[str, type[Message]] = {
    "ad": AdCreative,
    "impression": Impression,
    "click": Click,
    "dwell": Dwell,
    "conversion": Conversion,
}


def _client(source: Settings | str) -> tuple[Any, str]:
    """A client of the events database, connected as every room connects
    (`schemas.clients.clickhouse_args`: user, password and TLS from the settings, not only
    what the URL holds)."""
    settings = source if isinstance(source, Settings) else Settings(clickhouse={"url": source})
    database = clickhouse_database(settings)
    return clickhouse_client(settings, database), database


def _rows(client: Any, table: str, limit: int | None, chunk: int) -> Iterator[Message]:
    """A table's events in (ts_ms, event_id) order, read `chunk` rows per query."""
    cols, kind = _QUERIES[table]
    names = ["event_id", "ts_ms", *(c.strip() for c in cols.split(","))]
    model = _MODELS[kind]
    after: tuple[int, str] | None = None
    left = limit
    while left is None or left > 0:
        n = chunk if left is None else min(chunk, left)
        where = "" if after is None else "WHERE ts_ms > %(t)s OR (ts_ms = %(t)s AND event_id > %(e)s)"
        sql = f"SELECT event_id, ts_ms, {cols} FROM {table} FINAL {where} ORDER BY ts_ms, event_id LIMIT {n}"
        page = client.execute(sql, {} if after is None else {"t": after[0], "e": after[1]})
        for row in page:
            rec = dict(zip(names, row, strict=True))
            after = (rec["ts_ms"], rec["event_id"])
            rec["ts"] = datetime.fromtimestamp(rec.pop("ts_ms") / 1000, tz=UTC)
            if kind == "ad":
                rec["active"] = bool(rec["active"])
            yield model.model_validate({k: v for k, v in rec.items() if v is not None}, strict=False)
        if left is not None:
            left -= len(page)
        if len(page) < n:
            return


def iter_events(source: Settings | str, limit: int | None = None, chunk: int = 50_000) -> Iterator[Message]:
    """Every event of the raw tables (at most `limit` per table), merged lazily in time order;
    `source` is the settings (or only a `clickhouse.url`)."""
    client, database = _client(source)
    try:
        yield from heapq.merge(*(_rows(client, t, limit, chunk) for t in _QUERIES), key=lambda m: m.ts)
    except clickhouse_errors() as exc:  # the driver's and the network's; a bug here raises as itself
        raise StoreError(f"could not read events from ClickHouse database {database!r}: {exc}") from exc
    finally:
        client.disconnect()


def read_events(source: Settings | str, limit: int | None = None, chunk: int = 50_000) -> list[Message]:
    """`iter_events` as a list (for callers that sort or index all of it anyway)."""
    return list(iter_events(source, limit, chunk))
