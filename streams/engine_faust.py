"""Batched intake for the Faust app: whole fetches from Faust's own consumer reach the pipeline.

Faust delivers a record to an agent as an `Event` through the conductor, a channel queue and the
stream iterator, with a future, sensors and an ack per record; an agent that only counts raw
records (acks on) iterates a few thousand records a second here, while the consumer under it
fetches hundreds of thousands (benchmarks/streams.py measures both). The pipeline needs none of
that per record: it takes records in batches and acks them after their batch is committed.

`BatchConsumer` is Faust's aiokafka consumer with its fetch loop (`Consumer._drain_messages`,
run by Faust's `Fetcher` service) handing each fetched batch to one callback instead of the
conductor. Everything else stays Faust's: the consumer group and its co-partitioned assignor,
the rebalance protocol and its callbacks (flow stopped, partitions paused, sought back to the
committed offsets on assignment), the commit timer, livelock detection, the worker lifecycle.
The fetch loop keeps the rules of the one it replaces, per batch instead of per record: nothing
is delivered while the flow is stopped (a fetch that returns then seeks back, as Faust's
`getmany` does), only records of active partitions are delivered, records below a partition's
read offset (fetched before a seek) are dropped, and the monitor's read offsets, end offsets and
stream-inbound times (what the livelock detector reads) are kept per batch.

Acks are "through" acks: a handle is `(tp, offset)` and acking it says every record of `tp` up
to `offset` is done. That holds for every ack the pipeline gives (records of a partition are
applied and committed in offset order; a replayed or re-delivered record is acked once the
committed offset passes it), so the offset to commit is the highest acked one plus one, O(1)
per partition, instead of Faust's sorted list of every acked offset. Faust commits it on its
timer as before, never past what Redis holds.

A batch is fed to completion even when the fetch loop is cancelled meanwhile (`asyncio.shield`):
a feed cut in half could lose the records it had taken. A feed that fails is retried with the
same records (the pipeline takes nothing from a feed that raises) unless a rebalance began
meanwhile, after which the partitions are read again from their committed offsets anyway.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from time import monotonic
from typing import Any

import faust
from faust.transport.consumer import CONSUMER_FETCHING
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP

from streams.pipeline import PipelineBroken, RawRecord
from streams.runtime import NOT_ASSIGNED

log = logging.getLogger(__name__)

OnBatch = Callable[[list[RawRecord]], Awaitable[None]]


class BatchConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    """Faust's consumer thread, its aiokafka consumer fetching with the settings' wait
    (`kafka.fetch_max_wait_ms`, from the transport). Faust hard-codes 1,500 ms: the local Tansu
    answers a fetch with nothing new only about then, so a click sat in the broker for up to
    ~0.75 s before the worker saw it (the loop's freshness P99 read 2.2 s on a 2-vCPU EPYC)."""

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        wait_ms = getattr(transport, "fetch_max_wait_ms", None)
        if wait_ms is not None:  # read by aiokafka's fetcher when the consumer starts
            consumer._fetch_max_wait_ms = wait_ms
        return consumer


class BatchConsumer(faust_aiokafka.Consumer):
    """Faust's aiokafka consumer, delivering fetched batches to `on_batch` (see the module)."""

    def __init__(self, transport: Any, *args: Any, **kwargs: Any) -> None:
        self._done: dict[TP, int] = {}  # tp → highest offset acked (every one up to it is done)
        self.on_batch: OnBatch | None = getattr(transport, "on_batch", None)
        super().__init__(transport, *args, **kwargs)

    # -- acks and commits --------------------------------------------------------------------
    def _new_consumer_thread(self) -> BatchConsumerThread:
        return BatchConsumerThread(self, loop=self.loop, beacon=self.beacon)

    def ack_through(self, handles: Iterable[Any]) -> None:
        """Ack `(tp, offset)` handles: all of `tp` up to `offset` is committed downstream."""
        done = self._done
        for h in handles:
            if h is None:
                continue
            tp, offset = h
            if offset > done.get(tp, -1):
                done[tp] = offset

    def _filter_tps_with_pending_acks(self, topics: Any = None) -> Iterator[TP]:
        return (tp for tp in list(self._done) if topics is None or tp in topics or tp.topic in topics)

    def _new_offset(self, tp: TP) -> int | None:
        offset = self._done.get(tp)
        return None if offset is None else offset + 1

    async def on_partitions_assigned(self, assigned: set[TP], generation_id: int = 0) -> None:
        for tp in [tp for tp in self._done if tp not in assigned]:
            del self._done[tp]
        await super().on_partitions_assigned(assigned, generation_id)

    # -- the fetch loop ----------------------------------------------------------------------
    async def _drain_messages(self, fetcher: Any) -> None:  # pragma: no cover - Faust's contract
        if self.on_batch is None:  # nothing to hand batches to: Faust's own per-record path
            await super()._drain_messages(fetcher)
            return
        consumer_should_stop = self._stopped.is_set
        fetcher_should_stop = fetcher._stopped.is_set
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                batch = await self._next_batch()
                if batch:
                    await self._deliver(self.on_batch, batch)
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                log.info("Broker stopped consumer, shutting down...")
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                log.info("Consumer shutting down for user cancel.")
                return
            raise
        finally:
            self.diag.unset_flag(CONSUMER_FETCHING)

    async def _next_batch(self) -> list[RawRecord]:
        """One fetch, as the records to deliver (none while the flow is stopped)."""
        self.diag.set_flag(CONSUMER_FETCHING)
        records, active = await self._wait_next_records(1.0)
        self.diag.unset_flag(CONSUMER_FETCHING)
        await self.sleep(0)
        if not records or self.should_stop:
            return []
        if not self.flow_active:  # as Faust's getmany: back to the committed offsets
            try:
                await self.perform_seek()
            except NOT_ASSIGNED as exc:  # the broker's, or a partition just revoked
                log.warning("seek while the flow is stopped failed: %r", exc)
            return []
        return self.accept(records, active)

    async def _deliver(self, on_batch: OnBatch, batch: list[RawRecord]) -> None:
        """Feed `batch` to completion (shielded from cancellation); retry a feed that fails,
        unless a rebalance began meanwhile (then the partitions are read again anyway)."""
        generation = self.app.consumer_generation_id
        while True:
            try:
                await asyncio.shield(on_batch(batch))
                return
            except asyncio.CancelledError:
                raise
            except PipelineBroken as exc:  # retrying would stall for ever: end the worker instead
                log.error("the pipeline is broken (%s): crashing the worker so it restarts", exc)
                await self.app.crash(exc)
                return
            except Exception as exc:  # the outermost guard of a feed: log with traceback, retry it
                if not self.flow_active or self.app.consumer_generation_id != generation:
                    log.warning("feed failed during a rebalance (%r): the batch is read again", exc)
                    return
                log.exception("feed of %d records failed; retrying it", len(batch))
                await self.sleep(1.0)

    def accept(self, records: Mapping[TP, list[Any]], active: set[TP] | None) -> list[RawRecord]:
        """The fetched records to deliver, as `RawRecord`s with `(tp, offset)` handles; moves the
        read offsets and the monitor's per-partition figures."""
        out: list[RawRecord] = []
        buffered = self._buffered_partitions
        read_offset = self._read_offset
        monitor = self.app.monitor
        now = monotonic()
        for tp, recs in records.items():
            if not recs or (active is not None and tp not in active and tp not in buffered):
                continue
            r_offset = read_offset[tp]
            if r_offset is not None and recs[0].offset < r_offset:
                recs = [r for r in recs if r.offset >= r_offset]  # fetched before a seek
                if not recs:
                    continue
            topic, partition = tp.topic, tp.partition
            out += [RawRecord(topic, partition, r.offset, r.value, r.timestamp, (tp, r.offset)) for r in recs]
            read_offset[tp] = recs[-1].offset
            if monitor is not None:
                monitor.messages_received_total += len(recs)
                monitor.messages_received_by_topic[topic] += len(recs)
                monitor.tp_read_offsets[tp] = recs[-1].offset
                monitor.stream_inbound_time[tp] = now
                monitor.track_tp_end_offset(tp, self.highwater(tp))
        return out


class BatchTransport(faust_aiokafka.Transport):
    """Faust's aiokafka transport whose consumer is a `BatchConsumer` feeding `on_batch`."""

    Consumer = BatchConsumer

    def __init__(
        self,
        *args: Any,
        on_batch: OnBatch | None = None,
        fetch_max_wait_ms: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.on_batch = on_batch
        self.fetch_max_wait_ms = fetch_max_wait_ms  # None: Faust's own (1,500 ms)
        super().__init__(*args, **kwargs)


def install(app: faust.App, on_batch: OnBatch, fetch_max_wait_ms: int | None = None) -> None:
    """Make `app` consume through a `BatchConsumer` that hands its batches to `on_batch`, its
    fetches waiting at most `fetch_max_wait_ms` (`schemas.clients.fetch_args`).

    Call before the app's consumer is first used (the worker creates it when it starts)."""
    app.transport = BatchTransport(
        app.conf.broker_consumer, app, on_batch=on_batch, fetch_max_wait_ms=fetch_max_wait_ms
    )
