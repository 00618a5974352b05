"""The pipeline's batch commit against records that can never be written as they are, and a Redis
that fails mid-feed: nothing stalls, nothing is lost, every record is in the event store or ad.dlq.

The event store here is ClickHouse 18.16 (the local server) or, where current ClickHouse behaves
differently (it refuses an INSERT block spanning more than 100 partitions; it enforces table
constraints), chDB: ClickHouse 26 in-process, driven through the sink's own insert code.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from streams_it import consume_all
from test_streams_pipeline_cache import records_of
from test_streams_worker import check_state, simulate

from schemas import topics
from schemas.codec import decode, encode
from schemas.errors import StoreError
from schemas.events import DeadLetter, Impression
from schemas.settings import Settings
from schemas.signing import event_key, seal
from schemas.user_record import UserState
from streams.in_memory import replay
from streams.pipeline import Pipeline, RawRecord
from streams.processor import AdVectors
from streams.sink import ClickHouseSink
from streams.store import RedisStateStore

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.clickhouse, pytest.mark.timeout(240)]

_SESSION: Any = None


def _chdb() -> Any:
    """The process's one chDB session (chDB allows one data path per process)."""
    global _SESSION
    if _SESSION is None:
        from chdb import session

        _SESSION = session.Session()
    return _SESSION


class ChdbClient:
    """What ClickHouseSink needs of clickhouse-driver's Client (`execute` of an INSERT … VALUES
    with rows, or with columns when `columnar`), run by chDB with the rows as JSONEachRow."""

    INSERT = re.compile(r"INSERT INTO (\w+) \((.*)\) VALUES")

    def __init__(self, constraints: tuple[str, ...] = ()) -> None:
        from attribution.migrate import apply_migrations
        from attribution.sql import ChdbBackend

        self.db = f"rel_{uuid.uuid4().hex[:8]}"
        self.sess = _chdb()
        self.sess.query(f"CREATE DATABASE {self.db}")
        self.sess.query(f"USE {self.db}")
        # the raw tables as every migration leaves them, applied as `adstream migrate` applies
        # them (its own `REBUILD TABLE` statement included), on the process's one session
        backend = ChdbBackend.__new__(ChdbBackend)
        backend.session, backend.database = self.sess, self.db
        apply_migrations(backend)
        for c in constraints:
            self.sess.query(c)

    def execute(self, sql: str, rows: list[tuple[Any, ...]], *, columnar: bool = False, **_: Any) -> None:
        if columnar:
            rows = list(zip(*rows, strict=True))
        found = self.INSERT.match(sql)
        assert found, sql
        table, cols = found.group(1), [c.strip() for c in found.group(2).split(",")]
        lines = "\n".join(json.dumps(dict(zip(cols, row, strict=True))) for row in rows)
        self.sess.query(f"INSERT INTO {self.db}.{table} ({', '.join(cols)}) FORMAT JSONEachRow\n{lines}")

    def ids(self, table: str) -> set[str]:
        out = self.sess.query(f"SELECT event_id FROM {self.db}.{table} FINAL", "CSV").data()
        return {line.strip('"') for line in out.splitlines() if line}

    def disconnect(self) -> None:
        self.sess.query(f"DROP DATABASE IF EXISTS {self.db}")


def chdb_sink(s: Settings, client: ChdbClient) -> ClickHouseSink:
    """The real ClickHouseSink with chDB in place of its native-protocol connection."""
    sink = ClickHouseSink.__new__(ClickHouseSink)
    sink._client = client  # type: ignore[attr-defined]
    sink._lock = asyncio.Lock()  # type: ignore[attr-defined]
    sink.max_months = s.sink.max_partitions  # type: ignore[attr-defined]
    return sink


class FlakyStore(RedisStateStore):
    """The real Redis store, with Redis failing the user reads numbered in `fail_on` (a fault)."""

    def __init__(self, *args: Any, fail_on: set[int]) -> None:
        super().__init__(*args)
        self.fail_on = fail_on
        self.calls = 0

    async def load_users(self, user_ids: Any) -> dict[str, UserState]:
        self.calls += 1
        if self.calls in self.fail_on:
            reset = ConnectionResetError("Connection reset by peer (injected)")
            raise StoreError(f"Redis MGET failed: {reset}") from reset
        return await super().load_users(user_ids)


async def run(
    s: Settings,
    catalog: list,
    batches: list[list[RawRecord]],
    sink: Any = None,
    store: Callable[..., RedisStateStore] = RedisStateStore,
) -> Pipeline:
    """The pipeline in-process on the real broker and Redis, fed like the Faust shell did: a feed
    that raises is logged and the shell goes on with the next records."""
    import redis.asyncio as aioredis
    from aiokafka import AIOKafkaProducer

    from attribution.migrate import migrate

    if sink is None:
        await asyncio.to_thread(migrate, s)
        sink = ClickHouseSink(s)
    producer = AIOKafkaProducer(bootstrap_servers=s.kafka.bootstrap)  # default max_request_size
    await producer.start()

    async def send(topic: str, key: bytes, value: bytes) -> None:
        await (await producer.send(topic, value=value, key=key))

    client = aioredis.Redis.from_url(s.redis.url)
    cat = AdVectors(s.state_dim)
    for ad in catalog:
        cat.update(ad)
    pipe = Pipeline(s, store(client, s.redis_prefix, s.state.ttl_s), sink, send, lambda h: None, cat)
    pipe.caught_up = lambda topic, partition, last: True
    try:
        for batch in batches:
            try:
                await pipe.feed(batch)
            except StoreError:
                pass  # what the Faust timer did with a failed drain: log, go on
        await asyncio.wait_for(pipe.flush(), timeout=60)
    finally:
        await producer.stop()
        await client.aclose()
    return pipe


def _chunks(records: list[RawRecord], n: int) -> list[list[RawRecord]]:
    return [records[i : i + n] for i in range(0, len(records), n)]


def _dead_letters(s: Settings) -> list[DeadLetter]:
    return [decode(DeadLetter, r.value) for r in consume_all(s, topics.DLQ, idle_s=2.0)]  # type: ignore[misc]


def test_a_batch_spanning_150_months_is_written_in_blocks(deployment: Settings) -> None:
    s = deployment
    catalog, events = simulate(400, seed=5, key=event_key(s))
    template = next(e for e in events if isinstance(e, Impression))
    old = [
        seal(
            template.model_copy(
                update={"event_id": f"old-{i}", "ts": datetime(2000 + i // 12, 1 + i % 12, 3, tzinfo=UTC)}
            ),
            event_key(s),
        )
        for i in range(150)
    ]
    client = ChdbClient()
    try:
        pipe = asyncio.run(
            asyncio.wait_for(run(s, catalog, [records_of(s, old + events)], chdb_sink(s, client)), timeout=90)
        )
        assert pipe.counts["committed"] == len(old) + len(events)
        want = {e.event_id for e in old + events if isinstance(e, Impression)}
        assert client.ids("impressions") == want
    finally:
        client.disconnect()


def test_rows_the_store_refuses_are_dead_lettered_and_the_rest_written(deployment: Settings) -> None:
    s = deployment
    catalog, events = simulate(600, seed=6, key=event_key(s))
    imps = [i for i, e in enumerate(events) if isinstance(e, Impression)]
    poison = set(imps[10:15])
    events = [
        seal(e.model_copy(update={"price": 5000.0}), event_key(s)) if i in poison else e
        for i, e in enumerate(events)
    ]
    client = ChdbClient(("ALTER TABLE impressions ADD CONSTRAINT sane_price CHECK price < 1000",))
    records = records_of(s, events)
    try:
        pipe = asyncio.run(asyncio.wait_for(run(s, catalog, [records], chdb_sink(s, client)), timeout=90))
        assert pipe.counts["committed"] == len(events)
        refused = {events[i].event_id for i in poison}
        want = {e.event_id for e in events if isinstance(e, Impression)} - refused
        assert client.ids("impressions") == want
        dead = [d for d in _dead_letters(s) if "refused by the event store" in d.error]
        assert {json.loads(d.raw)["event_id"] for d in dead} == refused
        by_id = {rec.value: (rec.partition, rec.offset) for rec in records}
        assert all(by_id[d.raw] == (d.partition, d.offset) for d in dead)
        assert pipe.counts["invalid:refused"] == len(poison)
    finally:
        client.disconnect()


def test_an_800_kb_invalid_record_is_dead_lettered_and_the_stream_goes_on(deployment: Settings) -> None:
    s = deployment
    catalog, events = simulate(300, seed=7, key=event_key(s))
    records = records_of(s, events)
    big = b'{"event_id": "' + b"x" * 800_000 + b'"}'
    name = topics.topic_name(topics.IMPRESSIONS, s.topic_prefix)
    last = max(r.offset for r in records if r.topic == name and r.partition == 0)
    records.append(RawRecord(name, 0, last + 1, big, 0))
    pipe = asyncio.run(asyncio.wait_for(run(s, catalog, [records]), timeout=90))
    assert pipe.counts["committed"] == len(events) + 1
    dead = [d for d in _dead_letters(s) if d.raw_size == len(big)]
    assert len(dead) == 1 and big.startswith(dead[0].raw) and dead[0].offset == last + 1
    assert len(encode(dead[0])) < 1024 * 1024


def test_a_redis_error_mid_feed_loses_nothing(deployment: Settings) -> None:
    """Redis fails two user reads; every user's state must still equal the offline replay (the
    records of the failed feeds neither dropped nor applied to users never read)."""
    s = deployment.model_copy(update={"sink": deployment.sink.model_copy(update={"batch_size": 200})})
    catalog, events = simulate(2000, seed=8, key=event_key(s))
    # a first pass writes every user, so a user released against an empty state would show
    asyncio.run(run(s, catalog, _chunks(records_of(s, events[:1000]), 250)))

    flaky = functools.partial(FlakyStore, fail_on={2, 3})
    asyncio.run(run(s, catalog, _chunks(records_of(s, events)[1000:], 250), store=flaky))
    r = redis.Redis.from_url(s.redis.url)
    try:
        check_state(r, s, replay([*catalog, *events], s).states)
    finally:
        r.close()


def test_an_input_that_never_answers_holds_the_others_back_only_merge_max_idle_s(
    deployment: Settings,
) -> None:
    """Dwell partitions give no fetch answer (never caught up): after merge_max_idle_s the merge
    goes on without them, and every record is committed (M12)."""
    s = deployment.model_copy(
        update={"streams": deployment.streams.model_copy(update={"merge_max_idle_s": 1.0})}
    )
    catalog, events = simulate(400, seed=9, key=event_key(s))
    records = [r for r in records_of(s, events) if not r.topic.endswith(topics.DWELL)]

    async def go() -> Pipeline:
        import redis.asyncio as aioredis
        from aiokafka import AIOKafkaProducer

        from attribution.migrate import migrate

        await asyncio.to_thread(migrate, s)
        producer = AIOKafkaProducer(bootstrap_servers=s.kafka.bootstrap)
        await producer.start()

        async def send(topic: str, key: bytes, value: bytes) -> None:
            await (await producer.send(topic, value=value, key=key))

        client = aioredis.Redis.from_url(s.redis.url)
        cat = AdVectors(s.state_dim)
        for ad in catalog:
            cat.update(ad)
        store = RedisStateStore(client, s.redis_prefix, s.state.ttl_s)
        pipe = Pipeline(s, store, ClickHouseSink(s), send, lambda h: None, cat)
        pipe.caught_up = lambda topic, partition, last: not topic.endswith(topics.DWELL)
        try:
            await pipe.feed(records)
            for _ in range(100):  # the worker's timer
                await pipe.tick()
                if pipe.counts["committed"] + pipe.batch.count == len(records):
                    break
                await asyncio.sleep(0.05)
            await pipe.flush()
        finally:
            await producer.stop()
            await client.aclose()
        return pipe

    pipe = asyncio.run(asyncio.wait_for(go(), timeout=60))
    assert pipe.counts["committed"] == len(records)
    assert sum(part.merge.forced for part in pipe.parts.values()) >= 1
