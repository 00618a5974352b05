"""Training examples leave the worker as they are made, not when their batch commits (freshness:
`sink.flush_s` was the worker's share of click→served), and a batch's Redis commit still waits
until its examples are delivered: the committed offsets never pass an example not on Kafka."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_streams_pipeline_cache import records_of
from test_streams_worker import simulate

from schemas import topics
from schemas.settings import Settings
from schemas.signing import event_key
from streams.pipeline import Pipeline
from streams.processor import AdVectors

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.clickhouse, pytest.mark.timeout(240)]


def test_examples_are_produced_before_their_batch_commits_and_the_commit_waits_for_them(
    deployment: Settings,
) -> None:
    # a batch that commits only when flushed: no size or time trigger during the test
    s = deployment.model_copy(
        update={"sink": deployment.sink.model_copy(update={"flush_s": 3600.0, "batch_size": 1_000_000})}
    )
    catalog, events = simulate(600, seed=21, key=event_key(s))
    records = records_of(s, events)
    examples_topic = topics.topic_name(topics.TRAINING_EXAMPLES, s.topic_prefix)

    async def go() -> tuple[int, int, bool, int, int, dict[bytes, bytes]]:
        import redis.asyncio as aioredis
        from aiokafka import AIOKafkaProducer

        from attribution.migrate import migrate
        from streams.sink import ClickHouseSink
        from streams.store import RedisStateStore

        await asyncio.to_thread(migrate, s)
        producer = AIOKafkaProducer(bootstrap_servers=s.kafka.bootstrap)
        await producer.start()
        gate = asyncio.Event()
        gate.set()
        sent: list[str] = []

        async def send(topic: str, key: bytes, value: bytes) -> Any:
            await gate.wait()  # closed: the broker does not acknowledge
            await (await producer.send(topic, value=value, key=key))
            sent.append(topic)

        client = aioredis.Redis.from_url(s.redis.url)
        cat = AdVectors(s.state_dim)
        for ad in catalog:
            cat.update(ad)
        pipe = Pipeline(s, RedisStateStore(client, s.redis_prefix, s.state.ttl_s), ClickHouseSink(s), send,
                        lambda h: None, cat)  # fmt: skip
        pipe.caught_up = lambda topic, partition, last: True
        try:
            half = len(records) // 2
            await pipe.feed(records[:half])
            for _ in range(200):  # the sender runs beside the feed: its round is delivered soon
                if pipe.outbox.done == pipe.outbox.queued:
                    break
                await asyncio.sleep(0.02)
            early = sent.count(examples_topic)
            committed_early = pipe.counts["committed"]
            # the rest while the broker does not answer: the commit must wait for its examples
            gate.clear()
            await pipe.feed(records[half:])
            flushing = asyncio.create_task(pipe.flush())
            await asyncio.sleep(1.0)
            waited = not flushing.done()
            offsets_meanwhile = await client.hgetall(f"{s.redis_prefix}streams:offsets")
            gate.set()
            await asyncio.wait_for(flushing, timeout=60)
            offsets = await client.hgetall(f"{s.redis_prefix}streams:offsets")
            return early, committed_early, waited, len(offsets_meanwhile), sent.count(examples_topic), offsets
        finally:
            await producer.stop()
            await client.aclose()

    early, committed_early, waited, offsets_meanwhile, total, offsets = asyncio.run(go())
    assert early > 0 and committed_early == 0  # examples on Kafka, their batch not committed
    assert waited and offsets_meanwhile == 0  # no offset committed before its examples are acked
    assert total > early and offsets  # then everything: examples delivered, offsets committed
