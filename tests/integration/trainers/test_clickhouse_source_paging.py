"""Offline training reads ClickHouse in pages, merged lazily, not whole tables at once (L11)."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections import Counter

import pytest

from schemas.errors import StoreError
from schemas.settings import Settings
from workloads import Market, MarketConfig

pytestmark = [pytest.mark.clickhouse, pytest.mark.timeout(180)]


def test_events_read_in_small_pages_equal_one_read(stack: Settings) -> None:
    from attribution.migrate import migrate
    from schemas.clients import clickhouse_client
    from streams.sink import ClickHouseSink, empty_rows, row_of
    from trainers.clickhouse_source import iter_events, read_events

    base, db = stack.clickhouse.url.rsplit("/", 1)
    s = stack.model_copy(
        update={
            "clickhouse": stack.clickhouse.model_copy(update={"url": f"{base}/{db}_{uuid.uuid4().hex[:6]}"})
        }
    )
    migrate(s)
    events = list(
        Market(MarketConfig(seed=3, n_users=30, n_ads=20, drift_at=None, new_ads_at=None)).open_loop(800)
    )
    rows = empty_rows()
    for i, e in enumerate(events):
        table, row = row_of(e, 0, i)
        rows[table].append(row)
    sink = ClickHouseSink(s)
    try:
        asyncio.run(sink.write(rows))
    finally:
        sink.close()
    try:
        whole = read_events(s.clickhouse.url, chunk=1_000_000)
        paged = read_events(s.clickhouse.url, chunk=7)
        assert [m.event_id for m in paged] == [m.event_id for m in whole]
        assert Counter(m.kind for m in paged) == Counter(m.kind for m in events)
        assert all(a.ts <= b.ts for a, b in itertools.pairwise(paged))
        limited = read_events(s.clickhouse.url, limit=10, chunk=3)
        assert max(Counter(m.kind for m in limited).values()) <= 10
        lazy = iter_events(s.clickhouse.url, chunk=5)
        first = list(itertools.islice(lazy, 3))
        lazy.close()  # type: ignore[attr-defined]
        assert [m.event_id for m in first] == [m.event_id for m in whole[:3]]
        # the settings, not only the URL, say how to connect: a user the server does not know
        # fails (it used to be ignored, and the source connected as the URL's user)
        assert [m.event_id for m in read_events(s)] == [m.event_id for m in whole]
        with pytest.raises(StoreError, match="adstream_nobody"):
            read_events(
                s.model_copy(
                    update={"clickhouse": s.clickhouse.model_copy(update={"user": "adstream_nobody"})}
                )
            )
    finally:
        client = clickhouse_client(s)
        client.execute(f"DROP DATABASE IF EXISTS {s.clickhouse.url.rsplit('/', 1)[1]}")
        client.disconnect()
