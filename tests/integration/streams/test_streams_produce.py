"""The worker's producer path: a commit's thousands of messages reach the broker without a herd.

aiokafka wakes every sender blocked on a full batch each time a batch drains, so senders inside
`AIOKafkaProducer.send` at once cost O(n²) wake-ups (a 15,000-example commit took minutes of CPU).
`Runtime._send` lets one sender at a time in; deliveries still overlap.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from streams_it import consume_all

from schemas import topics
from schemas.settings import Settings
from streams.delivery import produce_all
from streams.runtime import Runtime

pytestmark = [pytest.mark.kafka]


def test_a_commit_of_thousands_of_messages_enters_the_producer_one_sender_at_a_time(
    deployment: Settings,
) -> None:
    s = deployment
    dlq = topics.topic_name(topics.DLQ, s.topic_prefix)
    name = topics.topic_name(topics.TRAINING_EXAMPLES, s.topic_prefix)
    messages = [(name, f"u{i % 97}".encode(), b"x" * 1500 + str(i).encode()) for i in range(4000)]
    peak = inside = 0

    async def go() -> None:
        nonlocal peak, inside
        from aiokafka import AIOKafkaProducer

        rt = Runtime(s, lambda: None)
        # aiokafka's default 16 KiB batches: ten of these messages fill one, so senders block
        producer = rt.producer = AIOKafkaProducer(bootstrap_servers=s.kafka.bootstrap, acks="all")
        await producer.start()
        real = producer.send

        async def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal peak, inside
            inside += 1
            peak = max(peak, inside)
            try:
                return await real(*args, **kwargs)
            finally:
                inside -= 1

        producer.send = counted  # type: ignore[method-assign]
        try:
            assert await produce_all(rt._send, messages, "test produce", dlq) == 0
        finally:
            await producer.stop()

    asyncio.run(asyncio.wait_for(go(), timeout=120))
    assert peak == 1, f"{peak} senders were inside the producer at once"
    got = consume_all(s, topics.TRAINING_EXAMPLES, expect=len(messages))
    assert sorted(r.value for r in got) == sorted(v for _, _, v in messages)


def test_batched_sends_land_where_single_sends_do_and_an_oversized_one_is_dead_lettered(
    deployment: Settings,
) -> None:
    """`Runtime._send_many` (record batches per partition) puts every key on the partition the
    producer's own `send` picks, delivers every message once, and a message the broker can never
    take still becomes a dead letter."""
    s = deployment
    dlq = topics.topic_name(topics.DLQ, s.topic_prefix)
    batched = topics.topic_name(topics.IMPRESSIONS, s.topic_prefix)
    single = topics.topic_name(topics.CLICKS, s.topic_prefix)  # as many partitions as impressions
    keys = [f"user-{i % 211}".encode() for i in range(3000)]
    values = [b"v" * (200 + i % 900) + str(i).encode() for i in range(3000)]
    huge = b"h" * (2 * 1024 * 1024)  # over the producer's 1 MiB request limit

    async def go() -> tuple[int, int]:
        from aiokafka import AIOKafkaProducer

        rt = Runtime(s, lambda: None)
        rt.producer = AIOKafkaProducer(bootstrap_servers=s.kafka.bootstrap, acks="all")
        await rt.producer.start()
        try:
            many = [(batched, k, v) for k, v in zip(keys, values, strict=True)] + [(batched, b"big", huge)]
            replaced = await produce_all(rt._send, many, "test", dlq, send_many=rt._send_many)
            one = [(single, k, b"") for k in sorted(set(keys))]
            replaced_single = await produce_all(rt._send, one, "test", dlq)
        finally:
            await rt.producer.stop()
        return replaced, replaced_single

    replaced, replaced_single = asyncio.run(asyncio.wait_for(go(), timeout=120))
    assert (replaced, replaced_single) == (1, 0)
    got = consume_all(s, topics.IMPRESSIONS, expect=len(values))
    assert sorted(r.value for r in got) == sorted(values)
    want = {r.key: r.partition for r in consume_all(s, topics.CLICKS, expect=len(set(keys)))}
    assert len(set(want.values())) > 1
    assert all(want[r.key] == r.partition for r in got)
    dead = consume_all(s, topics.DLQ, expect=1)
    assert len(dead) == 1 and b"could not be produced" in dead[0].value
