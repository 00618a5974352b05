"""The Faust app of the streams worker (`adstream worker`): a thin shell around `Pipeline`.

One agent consumes the four user-event topics as raw bytes (co-partitioned by `user_id`) with
manual acks: a record is acked only after its batch is committed to ClickHouse, Kafka and Redis,
so Faust's committed offsets never pass the offsets stored in Redis. A task follows `ad.catalog`
from the beginning with a plain consumer (every worker needs the whole catalog) and the agent
waits until the catalog is read to its end before touching user state.

Why no Faust tables (decision and evidence): DESIGN.md records that after `kill -9` on the local
Tansu broker, a Faust worker's table recovery got stuck ("No event received for active tp …
since recovery start") although the changelog had been read to its end, with Tansu reporting a
log-end offset one lower than the records present; and the group waited ~30 s for the dead
member. A changelog recovery that can hang is not a source of truth. So user state, pending
labels and the last applied offset of every input partition live in Redis and are written in ONE
MULTI/EXEC per batch (`streams.store`); on restart records at or below the stored offset are
skipped — exactly-once effect, no changelog, no recovery phase (see the crash test in
tests/integration/streams). Faust provides the consumer group, partition assignment (co-partitioned
topics go to the same worker), offsets, and the worker lifecycle.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

import faust
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas import topics
from schemas.codec import decode
from schemas.errors import SchemaError
from schemas.events import AdCreative
from schemas.settings import Settings
from streams import metrics as m
from streams.pipeline import Pipeline, RawRecord
from streams.processor import Catalog
from streams.sink import ClickHouseSink, empty_rows, row_of
from streams.store import RedisStateStore

log = logging.getLogger(__name__)

FEED_EVERY = 500  # records handed to the pipeline at once (the timer drains the rest)


class Runtime:
    """The worker's connections and pipeline, created when the Faust worker starts."""

    def __init__(self, app: faust.App, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.catalog = Catalog(settings.state_dim)
        self.catalog_ready = asyncio.Event()
        self.incoming: list[RawRecord] = []
        self.pipeline: Pipeline | None = None
        self.producer: AIOKafkaProducer | None = None
        self.positions: dict[tuple[str, int], int] = {}
        self._started = asyncio.Lock()

    async def start(self) -> Pipeline:
        async with self._started:
            if self.pipeline is not None:
                return self.pipeline
            import redis.asyncio as aioredis

            from attribution.migrate import migrate

            s = self.settings
            await asyncio.to_thread(migrate, s)
            self.producer = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap, linger_ms=5, acks=1)
            await self.producer.start()
            store = RedisStateStore(aioredis.Redis.from_url(s.redis_url), s.redis_prefix, s.user_state_ttl_s)
            pipeline = Pipeline(s, store, ClickHouseSink(s), self._send, self._ack, self.catalog)
            pipeline.caught_up = self._caught_up
            m.serve(s.metrics_port)
            self.pipeline = pipeline
            return pipeline

    async def _send(self, topic: str, key: bytes, value: bytes) -> Any:
        assert self.producer is not None
        return await (await self.producer.send(topic, value=value, key=key))

    @staticmethod
    def _ack(handles: Iterable[Any]) -> None:
        for h in handles:
            if h is not None:
                h.ack()

    def _caught_up(self, topic: str, partition: int, last_seen: int | None) -> bool:
        """Whether an input partition has nothing more to read right now (its high watermark)."""
        tp = faust.types.TP(topic, partition)
        consumer = self.app.consumer
        if tp not in consumer.assignment():
            return True  # not ours (or not assigned yet): it cannot hold the merge back
        try:
            hw = consumer.highwater(tp)
        except Exception:
            hw = None
        if hw is None:
            return False
        nxt = last_seen + 1 if last_seen is not None else self.positions.get((topic, partition))
        if nxt is None:
            return hw == 0
        m.LAG.labels(topic.removeprefix(self.settings.topic_prefix)).set(max(0, hw - nxt))
        return nxt >= hw

    async def refresh_positions(self) -> None:
        """Positions of assigned inputs nothing was received from (so their catch-up is known)."""
        if self.pipeline is None:
            return
        consumer = self.app.consumer
        for tp in list(consumer.assignment()):
            if tp.topic not in self.pipeline.base_of:
                continue
            part = self.pipeline.parts.get(tp.partition)
            if part is not None and tp.topic in part.merge.last_seen:
                continue
            try:
                pos = await consumer.position(tp)
            except Exception:
                continue
            if pos is not None:
                self.positions[(tp.topic, tp.partition)] = pos

    async def drain(self) -> None:
        pipeline = await self.start()
        batch, self.incoming = self.incoming, []
        if batch:
            await pipeline.feed(batch)
        else:
            await pipeline.tick()

    async def follow_catalog(self) -> None:
        """Read `ad.catalog` from the beginning; set `catalog_ready` at its end; keep following."""
        s = self.settings
        name = topics.topic_name(topics.CATALOG, s.topic_prefix)
        n_parts = s.topic_partitions or topics.TOPICS_BY_NAME[topics.CATALOG].partitions
        consumer = AIOKafkaConsumer(bootstrap_servers=s.kafka_bootstrap, enable_auto_commit=False)
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
                for tp, records in batches.items():
                    for r in records:
                        m.EVENTS_IN.labels(topics.CATALOG).inc()
                        try:
                            ad = decode(AdCreative, r.value or b"")
                        except SchemaError as exc:
                            m.INVALID.labels(topics.CATALOG, "invalid").inc()
                            log.warning("catalog record %s:%d invalid: %s", tp.partition, r.offset, exc)
                            continue
                        assert isinstance(ad, AdCreative)
                        self.catalog.update(ad)
                        table, row = row_of(ad, tp.partition, r.offset)
                        rows[table].append(row)
                if rows:
                    await sink.write(rows)
                if not self.catalog_ready.is_set():
                    done = all([await consumer.position(tp) >= end[tp] for tp in tps])
                    if done:
                        log.info("catalog loaded: %d ads", len(self.catalog.ads))
                        self.catalog_ready.set()
        finally:
            if sink is not None:
                sink.close()
            await consumer.stop()


def create_app(settings: Settings) -> faust.App:
    """The Faust app: one raw-bytes agent over the user-event topics, a catalog task, a timer."""
    s = settings
    (s.state_dir / "faust").mkdir(parents=True, exist_ok=True)
    app = faust.App(
        f"{s.topic_prefix}adstream-streams",
        broker=[f"kafka://{h.strip()}" for h in s.kafka_bootstrap.split(",")],
        store="memory://",
        web_enabled=False,
        topic_disable_leader=True,
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=10,
        broker_heartbeat_interval=1,
        broker_commit_interval=1.0,
        datadir=str(s.state_dir / "faust"),
        stream_buffer_maxsize=65536,
    )
    rt = Runtime(app, s)
    app.runtime = rt  # type: ignore[attr-defined]
    parts = s.topic_partitions or topics.TOPICS_BY_NAME[topics.IMPRESSIONS].partitions
    source = app.topic(
        *(
            topics.topic_name(t, s.topic_prefix)
            for t in (topics.IMPRESSIONS, topics.CLICKS, topics.DWELL, topics.CONVERSIONS)
        ),
        value_serializer="raw",
        key_serializer="raw",
        partitions=parts,
    )

    @app.agent(source)
    async def ingest(stream: faust.StreamT[bytes]) -> None:
        await rt.start()
        await rt.catalog_ready.wait()
        async for event in stream.noack().events():
            msg = event.message
            rt.incoming.append(
                RawRecord(msg.topic, msg.partition, msg.offset, msg.value, int(msg.timestamp * 1000), event)
            )
            if len(rt.incoming) >= FEED_EVERY:
                await rt.drain()

    @app.task
    async def catalog() -> None:
        await rt.follow_catalog()

    @app.timer(interval=0.1)
    async def tick() -> None:
        if rt.catalog_ready.is_set():
            await rt.refresh_positions()
            await rt.drain()

    @app.on_partitions_revoked.connect
    async def on_revoked(app: faust.App, revoked: set[Any], **_: Any) -> None:
        if rt.pipeline is not None:
            mine = {tp.partition for tp in revoked if tp.topic in rt.pipeline.base_of}
            still = {tp.partition for tp in app.consumer.assignment() if tp.topic in rt.pipeline.base_of}
            await rt.pipeline.revoke(mine - still)

    return app


def run_worker(settings: Settings, loglevel: str = "info") -> None:
    """Run the worker in the foreground until stopped (SIGTERM/SIGINT)."""
    app = create_app(settings)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()
