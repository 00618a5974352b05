"""The trainer's micro-batch rule on the real broker: it closes at `online.micro_batch` records or
when its oldest example is due (`online.max_wait_s` after it was produced), publishes without
waiting for acknowledgements, and never loses an example at shutdown."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from schemas import codec, topics
from schemas.events import AdapterDelta, TrainingExample
from schemas.settings import LoraSettings, OnlineSettings, Settings
from trainers.models.lora import AdapterBank
from trainers.models.ranker import Ranker, RankerConfig
from trainers.online import OnlineTrainer
from trainers.service import Deliveries, TrainerService

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.timeout(180)]

CFG = RankerConfig(
    state_dim=8, ad_buckets=64, advertiser_buckets=16, campaign_buckets=16, category_buckets=8, deep_hidden=16
)


def _examples(n: int, seed: int, adapters: tuple[str, ...] = ("feed", "search")) -> list[TrainingExample]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "trainers"))
    from helpers_trainers import make_examples

    return make_examples(n, seed=seed, dim=8, adapters=adapters)


def _settings(s: Settings, **online: Any) -> Settings:
    return s.model_copy(update={"online": s.online.model_copy(update=online)})


def _service(s: Settings, min_step_examples: int = 16) -> TrainerService:
    torch.manual_seed(0)
    bank = AdapterBank(Ranker(CFG), LoraSettings(rank=4, alpha=8), "ranker-it")
    return TrainerService(
        s, OnlineTrainer(bank, OnlineSettings(lr=0.01, min_step_examples=min_step_examples))
    )


async def _produce(s: Settings, exs: list[TrainingExample]) -> None:
    from aiokafka import AIOKafkaProducer

    p = AIOKafkaProducer(bootstrap_servers=s.kafka.bootstrap, acks="all")
    await p.start()
    try:
        topic = topics.topic_name(topics.TRAINING_EXAMPLES, s.topic_prefix)
        for e in exs:
            await p.send(topic, codec.encode(e), key=e.adapter_id.encode())
        await p.flush()
    finally:
        await p.stop()


async def _deltas(s: Settings) -> list[AdapterDelta]:
    from aiokafka import AIOKafkaConsumer

    c = AIOKafkaConsumer(
        topics.topic_name(topics.ADAPTER_DELTAS, s.topic_prefix),
        bootstrap_servers=s.kafka.bootstrap,
        auto_offset_reset="earliest",
    )
    await c.start()
    out: list[AdapterDelta] = []
    try:
        idle = 0
        while idle < 4:
            batch = await c.getmany(timeout_ms=500)
            got = [r for recs in batch.values() for r in recs]
            idle = 0 if got else idle + 1
            out += [codec.decode(AdapterDelta, r.value) for r in got]  # type: ignore[misc]
    finally:
        await c.stop()
    return out


async def _first_collect(svc: TrainerService, stop: asyncio.Event) -> list[Any]:
    """`_collect` until it returns records (the group join comes first)."""
    while True:
        got = await svc._collect(stop)
        if got:
            return got


def test_a_micro_batch_closes_at_its_size(deployment: Settings) -> None:
    """Records waiting in the broker fill a micro-batch of exactly `micro_batch` records; a
    deadline far away (60 s) is not waited for."""
    s = _settings(deployment, micro_batch=64, max_wait_s=60.0, micro_batch_s=60.0)
    asyncio.run(_produce(s, _examples(200, seed=11)))
    svc = _service(s)

    async def go() -> tuple[int, float]:
        await svc.start()
        try:
            stop = asyncio.Event()
            await _first_collect(svc, stop)  # joining: the first fetch may be partial
            t0 = time.monotonic()
            got = await asyncio.wait_for(svc._collect(stop), timeout=30)
            return len(got), time.monotonic() - t0
        finally:
            await svc.consumer.stop()  # type: ignore[union-attr]
            await svc.producer.stop()  # type: ignore[union-attr]
            await svc._redis.aclose()

    n, _ = asyncio.run(go())
    assert n == 64  # closed on size (wait_for would have raised after 30 s, the deadline is 60 s)


def test_a_micro_batch_closes_when_its_oldest_example_is_due(deployment: Settings) -> None:
    """A few fresh examples never fill a micro-batch: it closes when the oldest of them was
    produced `max_wait_s` ago, long before the idle wake-up (`micro_batch_s`, 60 s); examples
    produced long before they arrive (a backlog) are due at once."""
    s = _settings(deployment, micro_batch=10_000, max_wait_s=0.5, micro_batch_s=60.0)
    svc = _service(s)

    async def go() -> tuple[int, float, int, bool]:
        await svc.start()
        try:
            stop = asyncio.Event()
            # the group join first (a collect with nothing to read ends at micro_batch_s)
            svc.s = _settings(s, micro_batch_s=0.5)
            while not svc.consumer.assignment():  # type: ignore[union-attr]
                await svc._collect(stop)
            svc.s = s
            produced = time.time()
            await _produce(s, _examples(5, seed=12))
            got = await asyncio.wait_for(_first_collect(svc, stop), timeout=30)
            took = time.time() - produced
            # a backlog: produced, then read a second later, is due on arrival
            svc._due = None
            await _produce(s, _examples(5, seed=13))
            await asyncio.sleep(1.0)
            late = await asyncio.wait_for(_first_collect(svc, stop), timeout=30)
            due_on_arrival = svc._due is not None and svc._due <= time.monotonic()
            return len(got), took, len(late), due_on_arrival
        finally:
            await svc.consumer.stop()  # type: ignore[union-attr]
            await svc.producer.stop()  # type: ignore[union-attr]
            await svc._redis.aclose()

    n, took, late, due_on_arrival = asyncio.run(go())
    assert n == 5 and late == 5
    assert took < 30  # closed on the deadline (0.5 s after production), not at micro_batch_s (60 s)
    assert due_on_arrival


def test_nothing_waiting_is_lost_at_shutdown(deployment: Settings) -> None:
    """Examples still waiting in adapter buffers (fewer than `min_step_examples`, not due yet)
    are learned, published and snapshotted by `stop`; every delta is on the topic (its
    acknowledgement was not awaited by `publish`) and the committed offsets cover them all."""
    s = _settings(deployment, micro_batch=64, max_wait_s=60.0, micro_batch_s=0.2)
    exs = _examples(40, seed=14)  # 20 per adapter: under min_step_examples (1,000)
    asyncio.run(_produce(s, exs))
    svc = _service(s, min_step_examples=1_000)

    async def go() -> tuple[int, int, dict[int, int | None]]:
        from aiokafka import TopicPartition

        await svc.start()
        stop = asyncio.Event()
        runner = asyncio.create_task(svc.run(stop))
        try:
            for _ in range(600):  # until every record was taken (waiting in the adapters' buffers)
                if svc.trainer.waiting() == len(exs):
                    break
                await asyncio.sleep(0.05)
            waiting = svc.trainer.waiting()
            stop.set()
            await asyncio.wait_for(runner, timeout=30)
            await svc.stop()
        finally:
            if not runner.done():
                runner.cancel()
        from aiokafka import AIOKafkaConsumer

        topic = topics.topic_name(topics.TRAINING_EXAMPLES, s.topic_prefix)
        c = AIOKafkaConsumer(bootstrap_servers=s.kafka.bootstrap, group_id=svc.group)
        await c.start()
        try:
            parts = c.partitions_for_topic(topic) or set()
            committed = {p: await c.committed(TopicPartition(topic, p)) for p in parts}
        finally:
            await c.stop()
        return waiting, svc.learned, committed

    waiting, learned, committed = asyncio.run(go())
    assert waiting == len(exs)  # they were waiting for a full step when the stop came
    assert learned == len(exs) and svc.trainer.waiting() == 0
    deltas = asyncio.run(_deltas(s))
    assert {d.adapter_id for d in deltas if d.snapshot} == {"feed", "search"}
    learned_offsets: dict[int, int] = {}
    for d in deltas:
        for p, off in (d.learned_offsets or {}).items():
            learned_offsets[p] = max(off, learned_offsets.get(p, -1))
    assert sum(off + 1 for off in learned_offsets.values()) == len(exs)  # every record in a delta
    assert {p: c for p, c in committed.items() if c is not None} == {
        p: o + 1 for p, o in learned_offsets.items()
    }


def test_a_failed_delivery_surfaces_and_stops_publishing() -> None:
    """`publish` does not wait for acknowledgements, but a delivery that fails is raised by the
    next `check` (the loop's next turn) and by `wait` (before any snapshot or offset commit)."""

    async def go() -> None:
        d = Deliveries()
        ok: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        bad: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        d.add(ok)
        d.add(bad)
        d.check()  # nothing settled yet: nothing to raise
        ok.set_result(None)
        await asyncio.sleep(0)
        d.check()
        bad.set_exception(ConnectionError("broker gone"))
        await asyncio.sleep(0)
        with pytest.raises(ConnectionError, match="broker gone"):
            d.check()
        with pytest.raises(ConnectionError, match="broker gone"):
            await d.wait()
        assert d.failed == 1 and not d.pending

    asyncio.run(go())
