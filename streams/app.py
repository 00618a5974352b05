"""The Faust app of the streams worker (`adstream worker`): a thin shell around `Pipeline`.

The four user-event topics (co-partitioned by `user_id`) are read as raw bytes in whole fetched
batches through Faust's own consumer (`streams.engine_faust`: Faust's fetch loop hands each
batch to the pipeline instead of delivering records one by one through an agent's stream, whose
per-record Event, queue, future and ack cost more than everything the pipeline does with a
record). Records are acked only after their batch is committed to ClickHouse, Kafka and Redis,
so Faust's committed offsets never pass the offsets stored in Redis. A task follows `ad.catalog`
from the beginning with a plain consumer (every worker needs the whole catalog) and no batch
touches user state before the catalog is read to its end.

Why no Faust tables: user state, pending labels and the last applied offset of every input
partition live in Redis, written in ONE MULTI/EXEC per batch (`streams.store`); records at or below
the stored offset are skipped on restart (decision and evidence: docs/decisions/0001-user-state-in-redis.md).

Faust provides the consumer group, a co-partitioned assignment (partition p of every input on
one worker), the rebalance protocol and its callbacks, offset commits on its timer (never past
Redis), the monitor and the worker lifecycle; a timer releases and commits what is due.
`adstream worker --engine aiokafka` runs the same pipeline on a bare aiokafka consumer group
(throughput of both, and of a bare Faust agent: benchmarks/results/streams.json).
"""

from __future__ import annotations

import logging
from typing import Any

import faust

from schemas import topics
from schemas.clients import faust_args, fetch_args
from schemas.settings import Settings
from streams.engine_faust import BatchConsumer, install
from streams.runtime import Runtime

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> faust.App:
    """The Faust app: the user-event topics read in batches, a catalog task, a timer."""
    s = settings
    (s.state_dir / "faust").mkdir(parents=True, exist_ok=True)
    app = faust.App(
        f"{s.topic_prefix}adstream-streams",
        **faust_args(s),
        store="memory://",
        web_enabled=False,
        topic_disable_leader=True,
        consumer_auto_offset_reset="earliest",
        broker_commit_interval=1.0,
        broker_max_poll_records=s.streams.fetch_records,
        consumer_max_fetch_size=s.streams.fetch_bytes,
        datadir=str(s.state_dir / "faust"),
    )

    def ack(handles: Any) -> None:
        consumer = app.consumer
        assert isinstance(consumer, BatchConsumer)
        consumer.ack_through(handles)

    rt = Runtime(s, lambda: app.consumer, ack)
    app.runtime = rt  # type: ignore[attr-defined]
    parts = s.kafka.topic_partitions or topics.TOPICS_BY_NAME[topics.IMPRESSIONS].partitions
    source = app.topic(
        *(topics.topic_name(t, s.topic_prefix) for t in topics.USER_INPUTS),
        value_serializer="raw",
        key_serializer="raw",
        partitions=parts,
    )
    app.topics.add(source)  # subscribed by Faust's conductor; read by the batch intake
    install(app, rt.feed, **fetch_args(s))

    @app.task  # type: ignore[untyped-decorator]
    async def catalog() -> None:
        await rt.start()
        await rt.follow_catalog()

    @app.timer(interval=0.1)  # type: ignore[untyped-decorator]
    async def tick() -> None:
        await rt.tick()

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]
    async def on_revoked(app: faust.App, revoked: set[Any], **_: Any) -> None:
        if rt.pipeline is not None:
            # Faust seeks every assigned partition back to its committed offset after a
            # rebalance, so what the merge holds is read again: forget it with the partition
            await rt.pipeline.revoke({tp.partition for tp in revoked if tp.topic in rt.pipeline.base_of})

    return app


def run_worker(settings: Settings, loglevel: str = "info") -> None:
    """Run the worker in the foreground until stopped (SIGTERM/SIGINT), on uvloop if present
    (as the aiokafka engine; Faust's default is asyncio's own loop, slower per callback, and the
    loop of Faust's consumer thread follows the same policy)."""
    try:
        import mode.loop

        mode.loop.use("uvloop")
    except ImportError:  # pragma: no cover - uvloop comes with faust-streaming
        pass
    app = create_app(settings)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()
