"""The online trainer against hostile input on the real broker and Redis: a record it cannot take
is dead-lettered (one that fits the producer) and it goes on; a re-delivered example is learned once."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch
from test_trainers_service import CFG, _examples, _records, _service

from schemas import codec, topics
from schemas.events import DeadLetter
from schemas.settings import LoraSettings, OnlineSettings, Settings
from trainers.models.lora import AdapterBank
from trainers.models.ranker import Ranker
from trainers.online import OnlineTrainer
from trainers.service import TrainerService
from trainers.snapshots import meta_key, snapshot_key

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.timeout(180)]


async def _produce_raw(s: Settings, values: list[bytes]) -> None:
    from aiokafka import AIOKafkaProducer

    p = AIOKafkaProducer(bootstrap_servers=s.kafka.bootstrap, acks="all", max_request_size=4 * 1024 * 1024)
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
    c = AIOKafkaConsumer(bootstrap_servers=s.kafka.bootstrap)
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


def test_adapters_past_the_limit_evict_the_least_recent_and_come_back_from_redis(
    deployment: Settings, redis_client: Any
) -> None:
    """`online.max_adapters` bounds what the trainer holds by evicting the least recently learned
    adapter (its snapshot stored in Redis first), never by skipping examples: a new advertiser's
    clicks are learned, and an evicted adapter that returns resumes from its eviction snapshot."""
    s = deployment
    phases = [("adv:a", "adv:b"), ("adv:c", "adv:d"), ("adv:a",)]
    exs = [
        e.model_copy(update={"event_id": f"ev-{i}-{e.event_id}", "adapter_id": adapters[j % len(adapters)]})
        for i, adapters in enumerate(phases)
        for j, e in enumerate(_examples(96, seed=10 + i))
    ]
    asyncio.run(_produce_raw(s, [codec.encode(e) for e in exs]))
    torch.manual_seed(0)
    bank = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8), "ranker-it")
    svc = TrainerService(
        s, OnlineTrainer(bank, OnlineSettings(lr=0.01, min_step_examples=16, max_adapters=2))
    )
    asyncio.run(_run_to_end(svc, s))
    assert svc.learned == len(exs)  # nothing skipped
    assert svc.trainer.counts["adapter_limit"] == 0
    assert len(svc.trainer.runs) <= 2 and len(bank.adapters) <= 2
    assert svc.trainer.counts["evictions"] >= 2
    assert set(svc.adapter_partition) <= set(svc.trainer.runs)  # per-adapter maps shrink too
    # adv:a was evicted while c and d learned, then came back from the snapshot it left in Redis
    assert redis_client.exists(snapshot_key(s.redis_prefix, "adv:c"))  # c was evicted: stored
    assert json.loads(redis_client.hget(meta_key(s.redis_prefix, "adv:c"), "offsets"))  # with its offsets
    assert svc.trainer.runs["adv:a"].counts["steps"] > 0


def test_every_class_of_bad_record_on_the_trainer_topic_is_dead_lettered_at_its_offset(
    deployment: Settings,
) -> None:
    """The hostile producer's classes on the trainer's own input (the worker's suite covers the
    worker's topics): garbage, not UTF-8, unknown fields, wrong types, missing fields, a JSON
    array, an empty value and an unknown `kind` among valid examples — each dead-lettered with
    its offset, every valid example learned, the trainer still running."""
    s = deployment
    exs = _examples(120, seed=5)
    good = [codec.encode(e) for e in exs]
    base = json.loads(good[0])
    bad = {
        "garbage": bytes(range(7, 71)),
        "not_utf8": b'{"event_id": "\xff\xfe"}',
        "unknown_field": json.dumps({**base, "event_id": "x-unknown", "admin": True}).encode(),
        "wrong_type": json.dumps({**base, "event_id": "x-type", "click": "yes please"}).encode(),
        "missing_field": json.dumps({k: v for k, v in base.items() if k != "adapter_id"}).encode(),
        "json_array": b"[1, 2, 3]",
        "empty": b"",
        "other_kind": json.dumps({**base, "event_id": "x-kind", "kind": "impression"}).encode(),
    }
    values = [*good[:60], *bad.values(), *good[60:]]
    asyncio.run(_produce_raw(s, values))
    svc = _service(s)
    asyncio.run(_run_to_end(svc, s))
    assert svc.learned == len(exs)
    dead = [d for d in (codec.decode(DeadLetter, r.value) for r in asyncio.run(_records(s, topics.DLQ)))]
    assert all(isinstance(d, DeadLetter) for d in dead)
    assert sorted(d.offset for d in dead if isinstance(d, DeadLetter)) == list(range(60, 60 + len(bad)))
    assert {d.raw for d in dead if isinstance(d, DeadLetter)} == set(bad.values())
