"""The same worker with a bare aiokafka consumer group instead of Faust (`--engine aiokafka`).

Why it exists: the same pipeline without Faust, as the yardstick of the Faust engine (which
reads whole fetches through Faust's own consumer, `streams.engine_faust`: an agent's per-record
Event, futures and acks cost more than the pipeline's work; benchmarks/streams.py measures both
engines and both clients' floors). This shell hands whole fetch batches to the same `Pipeline`.

Positions come from Redis, not from Kafka commits: when partitions are assigned the consumer
seeks every input partition to the offset after the last one applied in Redis (the merge's
held-back records and the uncommitted batch are simply read again). Kafka offsets are still
committed after each batch so lag tools see progress.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor

from schemas import topics
from schemas.clients import fetch_args, group_args, kafka_args
from schemas.retry import kafka_errors
from schemas.settings import Settings
from streams.pipeline import INPUTS, Pipeline, RawRecord
from streams.runtime import Runtime

log = logging.getLogger(__name__)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, rt: Runtime, consumer: AIOKafkaConsumer) -> None:
        self.rt = rt
        self.consumer = consumer

    async def on_partitions_revoked(self, revoked: Any) -> None:
        if self.rt.pipeline is not None and revoked:
            await self.rt.pipeline.revoke({tp.partition for tp in revoked})

    async def on_partitions_assigned(self, assigned: Any) -> None:
        pipeline = await self.rt.start()
        for tp in assigned:
            snap = await pipeline.store.load_partition(tp.partition, [tp.topic])
            done = snap.offsets.get(tp.topic)
            if done is not None:
                self.consumer.seek(tp, done + 1)
        log.info("assigned %d input partitions", len(assigned))


async def run(settings: Settings) -> None:
    """Consume the user-event topics until cancelled."""
    s = settings
    names = [topics.topic_name(t, s.topic_prefix) for t in INPUTS]
    consumer = AIOKafkaConsumer(
        **kafka_args(s),
        group_id=f"{s.topic_prefix}adstream-streams-aiokafka",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        **group_args(s),
        **fetch_args(s),
        max_partition_fetch_bytes=s.streams.fetch_bytes,
        # range keeps partition p of every input on one worker (co-partitioning for the merge)
        partition_assignment_strategy=(RangePartitionAssignor,),
    )
    rt = Runtime(s, lambda: consumer)
    pipeline: Pipeline = await rt.start()
    catalog_task = asyncio.create_task(rt.follow_catalog())
    await rt.catalog_ready.wait()
    consumer.subscribe(names, listener=_Rebalance(rt, consumer))
    await consumer.start()
    committed_seen = 0
    try:
        while True:
            batches = await consumer.getmany(timeout_ms=100, max_records=s.streams.fetch_records)
            records = [
                RawRecord(tp.topic, tp.partition, r.offset, r.value, r.timestamp)
                for tp, recs in batches.items()
                for r in recs
            ]
            if records:
                await pipeline.feed(records)
            else:
                await pipeline.tick()
            # batches finish writing in the background: commit Kafka offsets when any has
            if pipeline.counts["committed"] != committed_seen:
                committed_seen = pipeline.counts["committed"]
                await _commit_kafka(consumer, pipeline)
                rt.update_lag()
    finally:
        catalog_task.cancel()
        await consumer.stop()


async def _commit_kafka(consumer: AIOKafkaConsumer, pipeline: Pipeline) -> None:
    offsets = {}
    assigned = consumer.assignment()
    for p, part in pipeline.parts.items():
        for topic, off in part.committed.items():
            tp = TopicPartition(topic, p)
            if tp in assigned:
                offsets[tp] = off + 1
    if offsets:
        try:
            await consumer.commit(offsets)
        except kafka_errors() as exc:  # informational only: positions come from Redis (a bug raises)
            log.warning("Kafka offset commit failed: %s", exc)


def run_worker(settings: Settings) -> None:
    """Run the aiokafka-engine worker in the foreground until interrupted (on uvloop if present)."""
    try:
        import uvloop

        loop_factory: Any = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop comes with faust-streaming
        loop_factory = None
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(run(settings))
    except KeyboardInterrupt:
        pass
