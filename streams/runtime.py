"""The worker's connections around a `Pipeline`, shared by both consumer shells.

`Runtime` owns the producer (dead letters, training examples), the Redis store, the ClickHouse
sink, the in-memory catalog (followed from `ad.catalog` from the beginning by a plain consumer,
because every worker needs all of it) and the catch-up test the merge asks about: an input
partition has nothing more to read when the offset after the last one received (or, before
any, the last one applied per Redis) reaches the broker's high watermark. The consumer (Faust's
or aiokafka's) is given as a function; both have `assignment()` and `highwater(tp)`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.partitioner import DefaultPartitioner

from schemas import topics
from schemas.clients import fetch_args, kafka_args, redis_args
from schemas.codec import decode, encode, key_of
from schemas.errors import SchemaError
from schemas.events import AdCreative, DeadLetter
from schemas.retry import kafka_errors
from schemas.settings import Settings
from streams import metrics as m
from streams.delivery import produce_all, refused_letter, write_rows
from streams.ingest import Invalid, validate
from streams.pipeline import Pipeline, RawRecord
from streams.processor import AdVectors
from streams.sink import ClickHouseSink, empty_rows, row_of
from streams.store import RedisStateStore

log = logging.getLogger(__name__)
# what asking a consumer about a partition raises when it was just revoked (aiokafka asserts
# the partition is assigned), or the broker's errors; a bug raises as itself
NOT_ASSIGNED: tuple[type[BaseException], ...] = (AssertionError, *kafka_errors())

GC_GEN0 = 200_000
LARGE_MESSAGE_BYTES = 64 * 1024  # a message this large goes through `send` (and its size checks)


async def _ship(
    sending: Awaitable[Any],
    idx: list[int],
    results: list[BaseException | None],
    pending: list[tuple[Any, list[int]]],
) -> None:
    """Await the enqueueing of messages `idx`: their delivery future into `pending`, or the error
    into `results` (handed to produce_all, which classifies it; a bug is raised there)."""
    try:
        pending.append((await sending, idx))
    except Exception as exc:  # see above
        for i in idx:
            results[i] = exc


class Runtime:
    """The worker's connections and pipeline, created when the Faust worker starts."""

    def __init__(
        self,
        settings: Settings,
        consumer: Callable[[], Any],
        ack: Callable[[Iterable[Any]], None] = lambda handles: None,
    ) -> None:
        self.consumer = consumer
        self.ack = ack
        self.settings = settings
        self.catalog = AdVectors(settings.state_dim)
        self.catalog_ready = asyncio.Event()
        self.pipeline: Pipeline | None = None
        self.producer: AIOKafkaProducer | None = None
        self._started = asyncio.Lock()
        self._enqueue = asyncio.Lock()  # one sender at a time inside the producer (see _send)
        self._partitions: dict[str, tuple[list[int], dict[bytes, int]]] = {}  # topic → parts, by key

    async def start(self) -> Pipeline:
        async with self._started:
            if self.pipeline is not None:
                return self.pipeline
            import redis.asyncio as aioredis

            s = self.settings
            # acks=all: a record is durable once the broker's in-sync replicas have it, so a
            # leader failover cannot lose dead letters or examples whose offsets were committed
            # large batches: a commit produces thousands of examples at once (one request per
            # partition instead of one per 16 KiB)
            self.producer = AIOKafkaProducer(
                **kafka_args(s),
                linger_ms=s.streams.produce_linger_ms,
                acks="all",  # not a setting: the exactly-once effect depends on it
                max_batch_size=s.streams.produce_batch_bytes,
            )
            await self.producer.start()
            redis_client = aioredis.Redis.from_url(**redis_args(s))
            store = RedisStateStore(redis_client, s.redis_prefix, s.state.ttl_s)
            pipeline = Pipeline(
                s, store, ClickHouseSink(s), self._send, self.ack, self.catalog, send_many=self._send_many
            )
            pipeline.caught_up = self._caught_up
            m.serve(s.metrics.port, s.metrics.host)
            # Many short-lived objects per record (models, items) over a large live heap (states,
            # pending labels, merge buffers): default GC thresholds spend a large share of the
            # time in collections; collect young objects less often, and freeze start-up objects.
            gc.collect()
            gc.freeze()
            gc.set_threshold(GC_GEN0, 20, 100)
            self.pipeline = pipeline
            return pipeline

    async def _dead_letters(self, dead: list[DeadLetter]) -> None:
        """Send invalid catalog records to `ad.dlq`, like every other input's."""
        await self.start()  # the producer
        dlq = topics.topic_name(topics.DLQ, self.settings.topic_prefix)

        messages = [(dlq, key_of(d), encode(d)) for d in dead]
        await produce_all(
            self._send,
            messages,
            "catalog dead letters",
            dlq,
            self.settings.streams.retry_backoff,
            self._send_many,
        )
        m.EVENTS_OUT.labels(topics.DLQ).inc(len(dead))

    async def _send(self, topic: str, key: bytes, value: bytes) -> Any:
        """Enqueue one message, then wait for its delivery.

        Enqueueing is serialised: a commit sends thousands of messages concurrently, and aiokafka
        wakes EVERY sender blocked on a full batch whenever one batch drains (each retries, one
        fits), so n concurrent senders cost O(n²) wake-ups — minutes of CPU for a 15,000-example
        batch. Behind a lock only one sender waits inside the producer; deliveries still overlap.
        """
        assert self.producer is not None
        async with self._enqueue:
            delivery = await self.producer.send(topic, value=value, key=key)
        return await delivery

    async def _send_many(self, messages: Sequence[tuple[str, bytes, bytes]]) -> list[BaseException | None]:
        """Send messages in record batches per topic partition (aiokafka's batch API), waiting for
        every delivery; per message None or the exception that stopped it.

        The partition is the one the producer's default partitioner gives the key (the same as
        `send`), so consumers keyed by it see no difference. A large message goes through `send`,
        whose size checks raise the errors `produce_all` dead-letters on. A message appended to
        a batch costs a fraction of a `send` (no future, no partitioner, no accumulator wait).
        """
        results: list[BaseException | None] = [None] * len(messages)
        pending: list[tuple[Any, list[int]]] = []  # (delivery future, indices of its messages)
        async with self._enqueue:
            parts = await self._partitions_of(messages, results)
            await self._enqueue_batches(messages, parts, results, pending)
        outcomes = await asyncio.gather(*(fut for fut, _ in pending), return_exceptions=True)
        for (_, idx), outcome in zip(pending, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                for i in idx:
                    results[i] = outcome
        return results

    async def _enqueue_batches(
        self,
        messages: Sequence[tuple[str, bytes, bytes]],
        parts: list[int | None],
        results: list[BaseException | None],
        pending: list[tuple[Any, list[int]]],
    ) -> None:
        """Append each message to its partition's open batch, shipping full ones (a large one
        alone through `send`); their deliveries go to `pending`, errors to `results`."""
        producer = self.producer
        assert producer is not None
        open_batches: dict[tuple[str, int], tuple[Any, list[int]]] = {}
        for i, ((topic, key, value), p) in enumerate(zip(messages, parts, strict=True)):
            if p is None:  # its partition is unknown: the error is in results[i]
                continue
            if len(value) + len(key) >= LARGE_MESSAGE_BYTES:
                await _ship(producer.send(topic, value=value, key=key, partition=p), [i], results, pending)
                continue
            batch, idx = open_batches.get((topic, p)) or (producer.create_batch(), [])
            if batch.append(key=key, value=value, timestamp=None) is None:  # full: ship it
                await _ship(producer.send_batch(batch, topic, partition=p), idx, results, pending)
                batch, idx = producer.create_batch(), []
                batch.append(key=key, value=value, timestamp=None)
            idx.append(i)
            open_batches[topic, p] = (batch, idx)
        for (topic, p), (batch, idx) in open_batches.items():
            await _ship(producer.send_batch(batch, topic, partition=p), idx, results, pending)

    async def _partitions_of(
        self, messages: Sequence[tuple[str, bytes, bytes]], errors: list[BaseException | None]
    ) -> list[int | None]:
        """Per message its partition (`_partition_of`), or None with the error in `errors`;
        keys seen before are looked up without a coroutine each."""
        out: list[int | None] = []
        for i, (topic, key, _) in enumerate(messages):
            known = self._partitions.get(topic)
            p = None if known is None else known[1].get(key)
            if p is None:
                try:
                    p = await self._partition_of(topic, key)
                except Exception as exc:  # handed to produce_all, which classifies it (a bug is raised there)
                    errors[i] = exc
            out.append(p)
        return out

    async def _partition_of(self, topic: str, key: bytes) -> int:
        """The partition the producer's default partitioner picks for `key` (cached per key)."""
        known = self._partitions.get(topic)
        if known is None:
            assert self.producer is not None
            known = self._partitions[topic] = (sorted(await self.producer.partitions_for(topic)), {})
        parts, by_key = known
        p = by_key.get(key)
        if p is None:
            if len(by_key) > 100_000:
                by_key.clear()
            p = by_key[key] = int(DefaultPartitioner()(key, parts, parts))
        return p

    def _caught_up(self, topic: str, partition: int, last_seen: int | None) -> bool:
        """Whether an input partition has nothing more to read right now (its high watermark)."""
        tp = TopicPartition(topic, partition)
        consumer = self.consumer()
        if tp not in consumer.assignment():
            return False  # mid-rebalance: unknown, so wait (co-partitioned assignors give all of p)
        try:
            hw = consumer.highwater(tp)
        except NOT_ASSIGNED:  # aiokafka asserts the partition is assigned: just revoked
            hw = None
        if hw is None:
            return False
        if last_seen is None:
            return bool(hw == 0)
        return bool(last_seen + 1 >= hw)

    def update_lag(self) -> None:
        """Per input topic: high watermark minus the next offset to read, over assigned partitions."""
        if self.pipeline is None:
            return
        consumer = self.consumer()
        lag: dict[str, int] = {}
        for tp in list(consumer.assignment()):
            base = self.pipeline.base_of.get(tp.topic)
            part = self.pipeline.parts.get(tp.partition)
            try:
                hw = consumer.highwater(tp)
            except NOT_ASSIGNED:  # revoked since `assignment()`
                hw = None
            if base is None or hw is None:
                continue
            last = part.merge.last_seen.get(tp.topic, part.applied.get(tp.topic)) if part else None
            lag[base] = lag.get(base, 0) + max(0, hw - ((last if last is not None else -1) + 1))
        for base, n in lag.items():
            m.LAG.labels(base).set(n)

    async def feed(self, records: list[RawRecord]) -> None:
        """Hand consumed records to the pipeline (once the catalog is read to its end)."""
        pipeline = await self.start()
        await self.catalog_ready.wait()
        await pipeline.feed(records)

    async def tick(self) -> None:
        """The timer: release what became certain, commit a due batch, update the lag gauges.

        Skipped while a feed (or another tick) holds the pipeline: that one does the same."""
        pipeline = self.pipeline
        if self.catalog_ready.is_set() and pipeline is not None and not pipeline.lock.locked():
            await pipeline.tick()
            self.update_lag()

    async def follow_catalog(self) -> None:
        """Read `ad.catalog` from the beginning; set `catalog_ready` at its end; keep following."""
        s = self.settings
        name = topics.topic_name(topics.CATALOG, s.topic_prefix)
        n_parts = s.kafka.topic_partitions or topics.TOPICS_BY_NAME[topics.CATALOG].partitions
        consumer = AIOKafkaConsumer(**kafka_args(s), **fetch_args(s), enable_auto_commit=False)
        await consumer.start()
        sink: ClickHouseSink | None = None
        try:
            tps = [TopicPartition(name, p) for p in range(n_parts)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            end = await consumer.end_offsets(tps)
            sink = ClickHouseSink(s)
            while True:
                batches = await consumer.getmany(timeout_ms=200, max_records=5000)
                rows = empty_rows()
                raws: dict[str, list[bytes | None]] = defaultdict(list)
                dead: list[DeadLetter] = []
                for tp, records in batches.items():
                    for r in records:
                        m.EVENTS_IN.labels(topics.CATALOG).inc()
                        try:
                            ad = decode(AdCreative, r.value or b"")
                        except SchemaError as exc:
                            bad = validate(topics.CATALOG, name, tp.partition, r.offset, r.value, r.timestamp)
                            reason = bad.reason if isinstance(bad, Invalid) else "invalid"
                            m.INVALID.labels(topics.CATALOG, reason).inc()
                            log.warning("catalog record %s:%d invalid: %s", tp.partition, r.offset, exc)
                            if isinstance(bad, Invalid):
                                dead.append(bad.dead_letter)
                            continue
                        assert isinstance(ad, AdCreative)
                        self.catalog.update(ad)
                        table, row = row_of(ad, tp.partition, r.offset)
                        rows[table].append(row)
                        raws[table].append(r.value)
                for table, i, error in await write_rows(
                    sink.write, rows, "catalog sink", s.streams.retry_backoff
                ):
                    m.INVALID.labels(topics.CATALOG, "refused").inc()
                    dead.append(refused_letter(s.topic_prefix, table, rows[table][i], raws[table][i], error))
                if dead:  # the catalog is re-read from the start on restart: ids are deterministic
                    await self._dead_letters(dead)
                if not self.catalog_ready.is_set():
                    done = all([await consumer.position(tp) >= end[tp] for tp in tps])
                    if done:
                        log.info("catalog loaded: %d ads", len(self.catalog.ads))
                        self.catalog_ready.set()
        finally:
            if sink is not None:
                sink.close()
            await consumer.stop()
