"""The pipeline in-process with a tiny user cache: trimming it while writes overlap loses nothing.

Batches are written while the next one is processed; the user cache is trimmed only when no
write is in flight (a user read back from Redis must not be stale) and keeps users whose records
wait in the merge. With a cache of two users per partition it is trimmed at almost every commit,
and every user's state in Redis must still equal the offline replay.
"""

from __future__ import annotations

import asyncio
import zlib

import pytest
import redis
from test_streams_worker import check_state, simulate

from schemas import topics
from schemas.codec import encode, key_of, topic_of
from schemas.settings import Settings
from schemas.signing import event_key
from streams.in_memory import replay
from streams.pipeline import Pipeline, RawRecord
from streams.processor import AdVectors

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.clickhouse]

PARTITIONS = 4


def records_of(s: Settings, events: list) -> list[RawRecord]:
    """The events as a consumer would see them: user-keyed partitions, offsets per topic partition."""
    offsets: dict[tuple[str, int], int] = {}
    out = []
    for e in events:
        p = zlib.crc32(key_of(e)) % PARTITIONS
        name = topics.topic_name(topic_of(e), s.topic_prefix)
        off = offsets.get((name, p), 0)
        offsets[name, p] = off + 1
        out.append(RawRecord(name, p, off, encode(e), 0))
    return out


async def run_pipeline(s: Settings, catalog: list, records: list[RawRecord]) -> Pipeline:
    import redis.asyncio as aioredis
    from aiokafka import AIOKafkaProducer

    from attribution.migrate import migrate
    from streams.sink import ClickHouseSink
    from streams.store import RedisStateStore

    await asyncio.to_thread(migrate, s)
    producer = AIOKafkaProducer(bootstrap_servers=s.kafka.bootstrap)
    await producer.start()

    async def send(topic: str, key: bytes, value: bytes) -> None:
        await (await producer.send(topic, value=value, key=key))

    client = aioredis.Redis.from_url(s.redis.url)
    sink = ClickHouseSink(s)
    cat = AdVectors(s.state_dim)
    for ad in catalog:
        cat.update(ad)
    pipe = Pipeline(
        s, RedisStateStore(client, s.redis_prefix, s.state.ttl_s), sink, send, lambda h: None, cat
    )  # fmt: skip
    pipe.caught_up = lambda topic, partition, last: True  # everything was handed over already
    try:
        for i in range(0, len(records), 250):
            await pipe.feed(records[i : i + 250])
        await pipe.flush()
    finally:
        sink.close()
        await producer.stop()
        await client.aclose()
    return pipe


def test_tiny_user_cache_trimmed_while_writes_overlap(deployment: Settings) -> None:
    s = deployment.model_copy(
        update={
            "sink": deployment.sink.model_copy(update={"batch_size": 300}),
            "streams": deployment.streams.model_copy(update={"cache_users": 2 * PARTITIONS}),
        }
    )
    catalog, events = simulate(3000, seed=11, key=event_key(s))
    pipe = asyncio.run(run_pipeline(s, catalog, records_of(s, events)))
    assert pipe.counts["committed"] == len(events)
    users = {e.user_id for e in events}
    cached = sum(len(part.proc.states) for part in pipe.parts.values())
    assert cached < len(users)  # the cache was trimmed
    r = redis.Redis.from_url(s.redis.url)
    try:
        check_state(r, s, replay([*catalog, *events], s).states)
    finally:
        r.close()
