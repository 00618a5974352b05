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
        producer = rt.producer = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap, acks="all")
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
