"""The Faust app of the streams worker (`adstream worker`): a thin shell around `Pipeline`.

One agent consumes the four user-event topics as raw bytes (co-partitioned by `user_id`) with
manual acks: a record is acked only after its batch is committed to ClickHouse, Kafka and Redis,
so Faust's committed offsets never pass the offsets stored in Redis. A task follows `ad.catalog`
from the beginning with a plain consumer (every worker needs the whole catalog) and the agent
waits until the catalog is read to its end before touching user state.

Why no Faust tables: user state, pending labels and the last applied offset of every input
partition live in Redis, written in ONE MULTI/EXEC per batch (`streams.store`); records at or below
the stored offset are skipped on restart (decision and evidence: docs/decisions/0001-user-state-in-redis.md).

Faust provides the consumer group, a co-partitioned assignment (partition p of every input on
one worker), offset commits (never past Redis: records are acked only after their batch
is committed) and the worker lifecycle. `adstream worker --engine aiokafka` runs the same pipeline
on a bare aiokafka consumer group (throughput figures: benchmarks/results/streams.json).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import faust

from schemas import topics
from schemas.clients import faust_args
from schemas.settings import Settings
from streams.pipeline import RawRecord
from streams.runtime import FEED_EVERY, Runtime

log = logging.getLogger(__name__)


def _ack(handles: Iterable[Any]) -> None:
    for h in handles:
        if h is not None:
            h.ack()


def create_app(settings: Settings) -> faust.App:
    """The Faust app: one raw-bytes agent over the user-event topics, a catalog task, a timer."""
    s = settings
    (s.state_dir / "faust").mkdir(parents=True, exist_ok=True)
    app = faust.App(
        f"{s.topic_prefix}adstream-streams",
        **faust_args(s),
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
    rt = Runtime(s, lambda: app.consumer, _ack)
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
        async for event in stream.noack().events():  # type: ignore[attr-defined]
            msg = event.message
            rt.incoming.append(
                RawRecord(msg.topic, msg.partition, msg.offset, msg.value, int(msg.timestamp * 1000), event)
            )
            if len(rt.incoming) >= FEED_EVERY:
                await rt.drain()

    @app.task  # type: ignore[untyped-decorator]
    async def catalog() -> None:
        await rt.follow_catalog()

    @app.timer(interval=0.1)  # type: ignore[untyped-decorator]
    async def tick() -> None:
        if rt.catalog_ready.is_set():
            await rt.drain()
            rt.update_lag()

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]
    async def on_revoked(app: faust.App, revoked: set[Any], **_: Any) -> None:
        if rt.pipeline is not None:
            # Faust seeks every assigned partition back to its committed offset after a
            # rebalance, so what the merge holds is read again: forget it with the partition
            await rt.pipeline.revoke({tp.partition for tp in revoked if tp.topic in rt.pipeline.base_of})

    return app


def run_worker(settings: Settings, loglevel: str = "info") -> None:
    """Run the worker in the foreground until stopped (SIGTERM/SIGINT)."""
    app = create_app(settings)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()
