"""The online trainer against hostile input on the real broker and Redis: a record it cannot take
is dead-lettered (one that fits the producer) and it goes on; a re-delivered example is learned once."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from test_trainers_service import _examples, _records, _service

from schemas import codec, topics
from schemas.events import DeadLetter
from schemas.settings import Settings
from trainers.service import TrainerService

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.timeout(180)]


async def _produce_raw(s: Settings, values: list[bytes]) -> None:
    from aiokafka import AIOKafkaProducer

    p = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap, acks="all", max_request_size=4 * 1024 * 1024)
    await p.start()
    try:
        topic = topics.topic_name(topics.TRAINING_EXAMPLES, s.topic_prefix)
        for v in values:
            await p.send(topic, v, key=b"feed")
        await p.flush()
    finally:
        await p.stop()


async def _end_offsets(s: Settings) -> dict[int, int]:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    topic = topics.topic_name(topics.TRAINING_EXAMPLES, s.topic_prefix)
    c = AIOKafkaConsumer(bootstrap_servers=s.kafka_bootstrap)
    await c.start()
    try:
        parts = c.partitions_for_topic(topic) or set()
        if not parts:
            await c.force_metadata_update()  # type: ignore[no-untyped-call]
            parts = c.partitions_for_topic(topic) or set()
        ends = await c.end_offsets([TopicPartition(topic, p) for p in parts])
        return {tp.partition: off for tp, off in ends.items() if off > 0}
    finally:
        await c.stop()


async def _run_to_end(svc: TrainerService, s: Settings) -> None:
    """Run the trainer until it has read every record produced and then 3 s more (or it fails)."""
    ends = await _end_offsets(s)
    stop = asyncio.Event()
    await svc.start()
    try:
        task = asyncio.create_task(svc.run(stop))
        last, still = dict(svc.position), 0
        for _ in range(1200):
            if task.done():
                task.result()  # a crash surfaces here
                break
            at_end = all(svc.position.get(p, -1) >= end - 1 for p, end in ends.items())
            still = still + 1 if at_end and svc.position == last else 0
            if still >= 30:
                break
            last = dict(svc.position)
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.wait_for(task, timeout=30)
    finally:
        await svc.stop()


def test_unlearnable_and_oversize_records_are_dead_lettered_learning_goes_on(deployment: Settings) -> None:
    s = deployment
    exs = _examples(200, seed=3)
    good = [codec.encode(e) for e in exs]
    inf32 = json.loads(good[0]) | {"event_id": "x-inf", "intent_score": 1e39}  # finite only in float64
    vec = json.loads(good[1]) | {"event_id": "x-vec", "user_vector": [0.0] * 7 + [3.5e38]}
    huge = b'{"event_id": "' + b"z" * 1_500_000 + b'"}'
    values = [*good[:100], json.dumps(inf32).encode(), json.dumps(vec).encode(), huge, *good[100:]]
    asyncio.run(_produce_raw(s, values))
    svc = _service(s)
    asyncio.run(_run_to_end(svc, s))
    assert svc.learned == len(exs)
    dead = [codec.decode(DeadLetter, r.value) for r in asyncio.run(_records(s, topics.DLQ))]
    kinds = {
        ("intent_score" in d.error, "user_vector" in d.error, d.raw_size == len(huge))
        for d in dead
        if isinstance(d, DeadLetter)
    }
    assert kinds == {(True, False, False), (False, True, False), (False, False, True)}, dead


def test_a_re_delivered_batch_is_learned_once(deployment: Settings, redis_client: Any) -> None:
    s = deployment
    exs = _examples(300, seed=4)
    first, again = [codec.encode(e) for e in exs[:200]], [codec.encode(e) for e in exs[100:200]]
    asyncio.run(_produce_raw(s, first + again + [codec.encode(e) for e in exs[200:]]))
    svc = _service(s)
    asyncio.run(_run_to_end(svc, s))
    assert svc.learned == len(exs)  # 100 re-delivered examples skipped
