"""The worker's engine, independent of the Kafka client: records in → state, labels, sinks out.

A source (the Faust app's batched intake, `streams.engine_faust`, or `streams.engine_aiokafka`) feeds
`RawRecord`s; the pipeline validates them (invalid → dead letter), skips records already
applied (offset ≤ the one stored in Redis),
merges each co-partition's inputs by event time (`streams.merge`), applies them to user state
and the label join (`streams.processor`), and every `sink.batch_size` records or `sink.flush_s`
seconds commits a batch in this order:

1. rows → ClickHouse (idempotent: ReplacingMergeTree on event_id) and, at the same time,
   dead letters → Kafka (deterministic ids: a replay re-sends the same); the batch's training
   examples were produced already, as each was made (below), and are waited for here; the dead
   letters of rows ClickHouse refuses for good follow;
2. user states + pending labels + offsets → Redis in one MULTI/EXEC;
3. the records are acked to the source (so Kafka's committed offset never passes Redis's).

A crash before 2 replays the batch with no visible effect but re-sent duplicates downstream
dedupes by id; a crash after 2 skips it on replay. State changes happen exactly once. A step
that fails for a while (a service down) is retried with backoff; one that can never succeed (a
row the event store refuses, a message the broker cannot take) has those records split out and
dead-lettered and the rest written (`streams.delivery`), so one record never stalls the stream.

Records reach the merge only once every user they touch is loaded from Redis (a failed read is
retried), so no record is ever applied to a user's state that was not read.

Training examples do not wait for their batch (freshness: `sink.flush_s` was the worker's share
of click→served): each release's examples are queued at once to a sender that produces them in
order, one round at a time (`_Outbox`, with `delivery.produce_all`'s retries and stand-ins), and
a batch's Redis commit waits until everything queued up to its end is delivered. So they still
reach Kafka before the offsets that pass them are committed; a crash before the commit replays
the batch, which re-sends the same examples (deterministic ids; the trainer skips ids it took),
as a crash between the produce and the commit always did.

The write of a batch overlaps the processing of the next one (its contents are fixed before it
starts, and a batch's write starts only when the previous one has finished, so the order above
holds across batches); nothing is acked before its batch's write is done. The user cache is
trimmed only while no write is in flight, so a user read back from Redis is never stale. While a
write is in flight the open batch keeps growing past `sink.batch_size` (up to `streams.backlog` times
it): a ClickHouse insert costs about the same for 5,000 rows as for 50, so a sink that falls
behind catches up with larger batches instead of stalling the stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from schemas import topics
from schemas.billing import day_of
from schemas.codec import encode, key_of, model_for_topic
from schemas.decode import BatchDecoder
from schemas.errors import StoreError
from schemas.events import DeadLetter, Message, View
from schemas.settings import Settings
from schemas.signing import event_key
from schemas.user_record import UserState
from streams import metrics as m
from streams.delivery import TABLE_TOPIC, SendMany, produce_all, refused_letter, retrying, write_rows
from streams.ingest import Invalid, ahead_of_record, unvouched, validate
from streams.merge import Item, PartitionMerge
from streams.processor import AdVectors, Processor
from streams.sink import EventSink, empty_rows, row_of
from streams.store import Commit, RedisStateStore

log = logging.getLogger(__name__)

INPUTS: tuple[str, ...] = topics.USER_INPUTS  # touches (outside channels) are only sunk

__all__ = ["INPUTS", "Pipeline", "RawRecord", "retrying"]

Send = Callable[[str, bytes, bytes], Awaitable[Any]]  # (physical topic, key, value) → delivery
CaughtUp = Callable[[str, int, int | None], bool]  # (physical topic, partition, last seen offset)


class PipelineBroken(StoreError):
    """A batch write failed for good earlier: nothing more is fed or committed until the worker
    restarts (it resumes from what Redis holds). The engines end the worker on it."""


@dataclass(slots=True)
class RawRecord:
    """A consumed Kafka record, as any client delivers it, with the source's ack handle."""

    topic: str  # physical
    partition: int
    offset: int
    value: bytes | None
    timestamp_ms: int = 0
    handle: Any = None


@dataclass
class _Part:
    proc: Processor
    merge: PartitionMerge
    applied: dict[str, int]  # physical topic → last offset applied in memory
    committed: dict[str, int] = field(default_factory=dict)  # … and committed to Redis
    # re-deliveries of records this part already holds: acked once the original is committed
    redelivered: list[tuple[str, int, Any]] = field(default_factory=list)


@dataclass
class _Batch:
    rows: dict[str, list[tuple[Any, ...]]] = field(default_factory=empty_rows)
    raws: dict[str, list[bytes | None]] = field(default_factory=lambda: defaultdict(list))  # rows' records
    dead: list[DeadLetter] = field(default_factory=list)
    examples: int = 0  # training examples made (queued to the outbox as they were made)
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)  # (topic, partition) → last
    parts: set[int] = field(default_factory=set)
    handles: list[Any] = field(default_factory=list)
    count: int = 0
    started: float = 0.0
    queued: int = 0  # the outbox's count once this batch's examples were queued
    spend: dict[str, dict[str, float]] = field(default_factory=dict)  # day → campaign → billed


class _Outbox:
    """Messages produced as they are made, in order, one `produce_all` round at a time (what
    queues meanwhile goes in the next round); `delivered(n)` waits until the first `n` queued
    are delivered (retried while the broker fails; a message it can never take replaced by its
    dead letter) and raises what stopped the sender (a bug) to every waiter."""

    def __init__(self, produce: Callable[[list[tuple[str, bytes, bytes]]], Awaitable[None]]) -> None:
        self.produce = produce
        self.queue: list[tuple[str, bytes, bytes]] = []
        self.queued = 0  # messages ever queued
        self.done = 0  # … and delivered (in queue order)
        self.task: asyncio.Task[None] | None = None
        self.failed: BaseException | None = None
        self.changed = asyncio.Event()

    def put(self, messages: list[tuple[str, bytes, bytes]]) -> None:
        if not messages:
            return
        self.queue += messages
        self.queued += len(messages)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._send())

    async def _send(self) -> None:
        try:
            while self.queue and self.failed is None:
                round_, self.queue = self.queue, []
                await self.produce(round_)
                self.done += len(round_)
                self.changed.set()
        except BaseException as exc:  # a bug, or a cancelled worker: every waiter gets it
            self.failed = exc
            self.changed.set()
            if not isinstance(exc, Exception):
                raise

    async def delivered(self, upto: int) -> None:
        while self.done < upto:
            if self.failed is not None:
                raise self.failed
            self.changed.clear()
            if self.task is None or self.task.done():  # cannot happen: `put` starts it
                self.task = asyncio.create_task(self._send())
            await self.changed.wait()


class Pipeline:
    """Validation, merge, state, labels and the batched commit of one worker."""

    def __init__(
        self,
        settings: Settings,
        store: RedisStateStore,
        sink: EventSink,
        send: Send,
        ack: Callable[[Iterable[Any]], None],
        catalog: AdVectors | None = None,
        send_many: SendMany | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.sink = sink
        self.send = send
        self.send_many = send_many  # batches of messages at once (see `delivery.produce_all`)
        # transient errors (and a store's StoreError raised from one) are retried, never given up
        self.backoff = settings.streams.retry_backoff
        self.ack = ack
        self.catalog = catalog or AdVectors(settings.state_dim)
        self.cache_users = settings.streams.cache_users
        self.prefix = settings.topic_prefix
        self.inputs = tuple(topics.topic_name(t, self.prefix) for t in INPUTS)
        self.base_of = {topics.topic_name(t, self.prefix): t for t in INPUTS}
        self.decoder_of = {name: BatchDecoder(model_for_topic(base)) for name, base in self.base_of.items()}
        self.dlq_topic = topics.topic_name(topics.DLQ, self.prefix)
        self.examples_topic = topics.topic_name(topics.TRAINING_EXAMPLES, self.prefix)
        # impressions only replicas signed, clicks and dwells echoing a served ad's token (M10)
        verify = settings.streams.verify_impressions or settings.streams.verify_clicks
        self.event_key: bytes | None = event_key(settings) if verify else None
        self.verify_impressions = settings.streams.verify_impressions
        self.verify_clicks = settings.streams.verify_clicks
        self.max_skew_s = settings.streams.max_event_skew_s
        self.parts: dict[int, _Part] = {}
        self.batch = _Batch()
        self.counts: Counter[str] = Counter()
        self.lock = asyncio.Lock()
        self._inflight: asyncio.Task[None] | None = None  # the batch being written
        self._broken: BaseException | None = None  # why a batch write failed for good (`_check`)
        self.caught_up: CaughtUp = lambda topic, partition, last: False
        self._reported: Counter[str] = Counter()
        self.outbox = _Outbox(self._produce_examples)  # examples, produced as they are made

    # -- intake ----------------------------------------------------------------------------
    async def _part(self, p: int) -> _Part:
        part = self.parts.get(p)
        if part is None:
            snaps = []

            async def read() -> None:
                snaps.append(await self.store.load_partition(p, self.inputs))

            await retrying(read, "partition read", self.backoff)
            snap = snaps[-1]
            proc = Processor.from_settings(self.settings, self.catalog)
            proc.join.load(snap.pending)
            proc.join.stream_ts = snap.stream_ts
            merge = PartitionMerge(
                max_idle_s=self.settings.streams.merge_max_idle_s,
                max_buffered=self.settings.streams.merge_max_buffered,
            )
            part = self.parts[p] = _Part(proc, merge, dict(snap.offsets), dict(snap.offsets))
        return part

    async def feed(self, records: Iterable[RawRecord]) -> None:
        """Take consumed records; release what the merge allows; commit when a batch is due."""
        async with self.lock:
            self._check()
            skipped = []
            seen: Counter[str] = Counter()
            latest: dict[tuple[int, str], int] = {}  # offsets staged in this call
            fresh: list[tuple[_Part, RawRecord, str]] = []  # records to judge, in order
            now = time.time()
            for rec in records:
                base = self.base_of.get(rec.topic)
                if base is None:
                    log.warning("record from unexpected topic %s ignored", rec.topic)
                    skipped.append(rec.handle)
                    continue
                seen[base] += 1
                part = self.parts.get(rec.partition) or await self._part(rec.partition)
                if rec.offset <= part.committed.get(rec.topic, -1):  # a replay of committed work
                    m.SKIPPED.inc()
                    skipped.append(rec.handle)
                    continue
                key = (rec.partition, rec.topic)
                last = max(
                    latest.get(key, part.merge.last_seen.get(rec.topic, -1)), part.applied.get(rec.topic, -1)
                )
                if rec.offset <= last:  # a client re-delivered what the merge or batch holds
                    m.SKIPPED.inc()
                    part.redelivered.append((rec.topic, rec.offset, rec.handle))
                    continue
                latest[key] = rec.offset
                fresh.append((part, rec, base))
            staged, missing = self._stage(fresh, now)
            for base, n in seen.items():
                m.EVENTS_IN.labels(base).inc(n)
            if skipped:
                self.ack(skipped)
            # nothing reaches the merge before every user it touches is loaded (a Redis error
            # here is retried; were it to escape, the merge would be as before this call)
            for p, uids in missing.items():
                await self._load_users(self.parts[p], uids)
            for part, item in staged:
                part.merge.push(item)
            await self._release_all()
            if self._due():
                await self._commit()

    def _stage(
        self, fresh: list[tuple[_Part, RawRecord, str]], now: float
    ) -> tuple[list[tuple[_Part, Item]], dict[int, set[str]]]:
        """The merge items of a fetch's new records (judged as a batch), and per partition the
        users they touch that are not loaded yet."""
        staged: list[tuple[_Part, Item]] = []
        missing: dict[int, set[str]] = {}
        for (part, rec, base), result in zip(fresh, self._judge_all(fresh, now), strict=True):
            if isinstance(result, Invalid):
                m.INVALID.labels(base, result.reason).inc()
                self.counts[f"invalid:{result.reason}"] += 1
                staged.append((part, Item(rec.topic, rec.offset, None, 0.0, rec.handle, result.dead_letter)))
                continue
            event, ts = result
            staged.append((part, Item(rec.topic, rec.offset, event, ts, rec.handle, raw=rec.value)))
            uid = getattr(event, "user_id", None)
            if uid is not None and uid not in part.proc.states:
                missing.setdefault(rec.partition, set()).add(uid)
        return staged, missing

    def _judge_all(
        self, records: list[tuple[_Part, RawRecord, str]], now: float
    ) -> list[tuple[Message, float] | Invalid]:
        """`_judge` of a fetch: each input topic's records decoded as one batch."""
        by_topic: dict[str, list[int]] = defaultdict(list)
        for i, (_, rec, _) in enumerate(records):
            by_topic[rec.topic].append(i)
        decoded: list[Message | None] = [None] * len(records)
        for topic, rows in by_topic.items():
            events = self.decoder_of[topic].fast([records[i][1].value for i in rows])
            for i, event in zip(rows, events, strict=True):
                decoded[i] = event
        return [
            self._judge(base, rec, now, event) for (_, rec, base), event in zip(records, decoded, strict=True)
        ]

    def _judge(
        self, base: str, rec: RawRecord, now: float, fast: Message | None = None
    ) -> tuple[Message, float] | Invalid:
        """The record's event and its time (epoch seconds), or its dead letter (contract
        violation, far-future time, an impression no replica signed, a click without its token).

        `fast` is the event the batch decoder's fast path made of it (None: the contract decides).
        `now` is the wall clock when the feed began: a record whose Kafka timestamp is no later
        and whose event time is within the skew of it passes `ahead_of_record` whatever the
        clock says now (it is only later), so only the others ask it."""
        if fast is None:  # anything unusual is decided by `validate`, which dead-letters it
            result = validate(base, rec.topic, rec.partition, rec.offset, rec.value, rec.timestamp_ms)
            if isinstance(result, Invalid):
                return result
            event = result
        else:
            event = fast
        ts = event.ts.timestamp()
        written = rec.timestamp_ms / 1000
        if not (0 < written <= now and ts <= written + self.max_skew_s):
            late = ahead_of_record(
                event, rec.topic, rec.partition, rec.offset, rec.value or b"", rec.timestamp_ms,
                self.max_skew_s, event_ts=ts,
            )  # fmt: skip
            if late is not None:
                return late
        if self.event_key is not None:  # before the join, the state and the sink
            forged = unvouched(
                event, rec.topic, rec.partition, rec.offset, rec.value or b"", rec.timestamp_ms,
                self.event_key, impressions=self.verify_impressions, clicks=self.verify_clicks,
                event_ts=ts,
            )  # fmt: skip
            if forged is not None:
                return forged
        return event, ts

    async def _load_users(self, part: _Part, uids: set[str]) -> None:
        """Read users from Redis into the partition's cache (retried while Redis fails)."""
        loaded: dict[str, UserState] = {}

        async def load() -> None:
            loaded.update(await self.store.load_users(uids))

        await retrying(load, "user read", self.backoff)
        for uid in uids:
            part.proc.states[uid] = loaded.get(uid) or UserState.empty(uid, self.settings.state_dim)

    def _writing(self) -> bool:
        return self._inflight is not None and not self._inflight.done()

    def _full(self) -> bool:
        """The open batch must be committed now (it is big enough and the sink is free, or huge)."""
        n, size = self.batch.count, self.settings.sink.batch_size
        return n >= size and (n >= self.settings.streams.backlog * size or not self._writing())

    def _due(self) -> bool:
        b = self.batch
        if not b.count:
            return False
        if self._writing():  # commit after the write in flight, with what has come until then
            return b.count >= self.settings.streams.backlog * self.settings.sink.batch_size
        return b.count >= self.settings.sink.batch_size or (
            time.monotonic() - b.started >= self.settings.sink.flush_s
        )

    async def tick(self) -> None:
        """Periodic: release what became certain (inputs caught up) and commit a due batch."""
        async with self.lock:
            await self._release_all()
            if self._due():
                await self._commit()

    async def flush(self) -> None:
        """Commit whatever is released now and wait until it is written (shutdown, revocation)."""
        async with self.lock:
            await self._release_all()
            if self.batch.count:
                await self._commit()
            await self._settle()

    async def revoke(self, partitions: Iterable[int]) -> None:
        """Partitions moved away: commit what was released, then forget their state.

        Nothing more is released here: mid-rebalance the assignment cannot say which inputs are
        caught up, and what the merge still holds is read again by whoever gets the partition.
        """
        async with self.lock:
            if self.batch.count:
                await self._commit()
            await self._settle()
            for p in partitions:
                self.parts.pop(p, None)

    # -- processing --------------------------------------------------------------------------
    async def _release_all(self) -> None:
        for p, part in list(self.parts.items()):
            # with nothing received yet from an input, its last applied offset (from Redis) says
            # where it stands; a client's fetch position would not (it runs ahead of delivery)
            def caught_up(topic: str, last: int | None, _p: int = p, _part: _Part = part) -> bool:
                return self.caught_up(topic, _p, last if last is not None else _part.applied.get(topic))

            more = True
            while more:
                more = False
                forced = part.merge.forced
                room, items = self._room(), []
                for item in part.merge.release(caught_up, self.inputs, time.monotonic()):
                    items.append(item)
                    if len(items) >= room:
                        break
                self._process(p, part, items)
                if items and self._full():
                    # keep batches bounded even when a long-blocked merge releases a backlog;
                    # then ask the merge afresh (the broker may have answered meanwhile)
                    await self._commit()
                    more = True
                if part.merge.forced != forced:
                    m.MERGE_FORCED.inc(part.merge.forced - forced)
                    log.warning(
                        "partition %d: an input gave no answer for %.0fs (or %d records waited): "
                        "merging without it",
                        p,
                        self.settings.streams.merge_max_idle_s,
                        part.merge.buffered(),
                    )  # fmt: skip

    def _room(self) -> int:
        """How many records the open batch takes before it is `_full` (at least one)."""
        size = self.settings.sink.batch_size
        limit = self.settings.streams.backlog * size if self._writing() else size
        return max(1, limit - self.batch.count)

    def _process(self, p: int, part: _Part, items: list[Item]) -> None:
        """Released records into the open batch: rows, dead letters, and the events folded into
        user state and the label join as one batch, the examples made as their bytes
        (`Processor.on_batch_json`)."""
        if not items:
            return
        b = self.batch
        if not b.count:
            b.started = time.monotonic()
        b.count += len(items)
        b.parts.add(p)
        events: list[tuple[Message, bytes | None, float]] = []
        views: dict[int, tuple[int, bytes | None]] = {}  # a view's offset and record, by its object
        for item in items:
            b.offsets[item.topic, p] = item.offset
            part.applied[item.topic] = item.offset
            b.handles.append(item.handle)
            if item.event is None:
                b.dead.append(item.dead)
                continue
            events.append((item.event, item.raw, item.ts))
            if isinstance(item.event, View):  # stored only if the join takes it (below)
                views[id(item.event)] = (item.offset, item.raw)
                continue
            table, row = row_of(item.event, p, item.offset, item.ts)
            b.rows[table].append(row)
            b.raws[table].append(item.raw)
        made = part.proc.on_batch_json(events) if events else []
        self._shown(p, part, views)
        if made:
            b.examples += len(made)
            # keyed by adapter_id, as `key_of` keys them (the contract's key of the topic)
            topic = self.examples_topic
            self.outbox.put([(topic, key.encode(), value) for key, value in made])
            b.queued = self.outbox.queued

    def _shown(self, p: int, part: _Part, views: dict[int, tuple[int, bytes | None]]) -> None:
        """The join's shown impressions and billed costs into the open batch: a row per view that
        made an impression shown (offset 0: a view that came in an earlier fetch, before its
        impression) and the costs, summed per UTC day and campaign for the Redis commit."""
        join, b = part.proc.join, self.batch
        for view, ts in join.views:
            offset, raw = views.get(id(view), (0, None))
            table, row = row_of(view, p, offset, ts)
            b.rows[table].append(row)
            b.raws[table].append(raw)
        for campaign_id, ts, cost in join.billed:
            day = b.spend.setdefault(day_of(ts), {})
            day[campaign_id] = day.get(campaign_id, 0.0) + cost
        join.views.clear()
        join.billed.clear()

    def _check(self) -> None:
        """Refuse to go on after a batch write failed with a non-transient error (a bug, a store
        refusing every write): a later commit would move Redis's offsets past the lost batch.
        The worker must restart; it resumes from what Redis holds (nothing of the batch)."""
        if self._broken is not None:
            exc = self._broken
            raise PipelineBroken(
                f"a batch write failed ({type(exc).__name__}: {exc}); nothing more is committed "
                "until the worker restarts (it resumes from Redis)"
            ) from exc

    async def _settle(self) -> None:
        """Wait until the batch being written (if any) is written and acked."""
        task, self._inflight = self._inflight, None
        if task is not None:
            await task  # a write that failed for good raises its own error here, once …
        self._check()  # … and every later call this one

    async def _commit(self) -> None:
        """Fix the batch's writes, then write them while the next batch is processed."""
        if self._over_cache():
            await self._settle()
            self._trim_cache()
        b, self.batch = self.batch, _Batch()
        # everything the batch will write is fixed first, so a retry writes exactly the same
        commit = Commit(offsets={f"{t}:{p}": off for (t, p), off in b.offsets.items()}, spend=b.spend)
        for p in b.parts:
            proc = self.parts[p].proc
            commit.users += [proc.states[u] for u in proc.dirty_users]
            proc.dirty_users.clear()
            join = proc.join
            commit.pending_put[p] = {
                iid: join.pending[iid].to_bytes() for iid in join.dirty if iid in join.pending
            }
            commit.pending_del[p] = list(join.removed)
            join.dirty.clear()
            join.removed.clear()
            commit.stream_ts[p] = join.stream_ts
        messages = [(self.dlq_topic, key_of(d), encode(d)) for d in b.dead]  # the examples: `outbox`
        await self._settle()
        self._inflight = asyncio.create_task(self._finish(b, commit, messages))

    async def _finish(self, b: _Batch, commit: Commit, messages: list[tuple[str, bytes, bytes]]) -> None:
        try:
            await self._write(b, commit, messages)  # transient errors are retried in there
        except Exception as exc:  # re-raised: recorded only so that nothing commits past this batch
            self._broken = exc
            raise
        if b.dead:
            m.EVENTS_OUT.labels(topics.DLQ).inc(len(b.dead))
        if b.examples:
            m.EVENTS_OUT.labels(topics.TRAINING_EXAMPLES).inc(b.examples)
        self.ack(b.handles)
        for (topic, p), off in b.offsets.items():
            part = self.parts.get(p)
            if part is not None:
                part.committed[topic] = off
        for p in b.parts:
            part = self.parts[p]
            if part.redelivered:
                done = [h for t, o, h in part.redelivered if o <= part.committed.get(t, -1)]
                part.redelivered = [r for r in part.redelivered if r[1] > part.committed.get(r[0], -1)]
                self.ack(done)
        m.BATCH.observe(b.count)
        self.counts["committed"] += b.count
        self.counts["examples"] += b.examples
        self.counts["dead_letters"] += len(b.dead)
        self._gauges()

    async def _write(self, b: _Batch, commit: Commit, messages: list[tuple[str, bytes, bytes]]) -> None:
        """ClickHouse and Kafka at once, then Redis: each step idempotent and retried while it
        fails for a while; rows the store refuses for good and messages the broker can never take
        become dead letters (sent before the offsets that pass them are committed). The examples
        reach the trainer without waiting for the event store's insert (freshness); both writes
        come before the Redis commit, so a crash still replays the whole batch."""
        t0 = time.perf_counter()

        async def rows() -> list[tuple[str, int, str]]:
            refused = await write_rows(self.sink.write, b.rows, "batch sink", self.backoff)
            m.SINK_LATENCY.observe(time.perf_counter() - t0)
            return refused

        async def produce(batch: list[tuple[str, bytes, bytes]]) -> None:
            if batch:
                self.counts["unsendable"] += await produce_all(
                    self.send, batch, "batch produce", self.dlq_topic, self.backoff, send_many=self.send_many
                )

        try:
            async with asyncio.TaskGroup() as group:  # one failing for good cancels the others
                inserted = group.create_task(rows())
                group.create_task(produce(messages))
                group.create_task(self.outbox.delivered(b.queued))  # examples, sent as they were made
        except BaseExceptionGroup as failed:  # the error itself, as a sequential write raised it
            raise failed.exceptions[0] from None
        letters = []
        for table, i, error in inserted.result():
            row = b.rows[table][i]
            m.INVALID.labels(TABLE_TOPIC[table], "refused").inc()
            self.counts["invalid:refused"] += 1
            log.warning("%s row at offset %s refused by the event store: %s", table, row[-1], error)
            letter = refused_letter(self.prefix, table, row, b.raws[table][i], error)
            letters.append((self.dlq_topic, key_of(letter), encode(letter)))
        await produce(letters)
        t1 = time.perf_counter()
        await retrying(lambda: self.store.commit(commit), "batch commit", self.backoff)
        m.COMMIT_LATENCY.observe(time.perf_counter() - t1)

    async def _produce_examples(self, messages: list[tuple[str, bytes, bytes]]) -> None:
        self.counts["unsendable"] += await produce_all(
            self.send, messages, "examples produce", self.dlq_topic, self.backoff, send_many=self.send_many
        )

    def _over_cache(self) -> bool:
        limit = self.cache_users // max(1, len(self.parts))
        return any(len(part.proc.states) > limit for part in self.parts.values())

    def _trim_cache(self) -> None:
        """Forget cached users that Redis has (not changed in the open batch, nothing queued).

        Called with no write in flight: every other cached user equals its Redis record.
        """
        limit = self.cache_users // max(1, len(self.parts))
        for part in self.parts.values():
            states = part.proc.states
            if len(states) <= limit:
                continue
            keep = set(part.proc.dirty_users)
            for q in part.merge.queues.values():  # loaded for records not released yet
                keep.update(uid for it in q if (uid := getattr(it.event, "user_id", None)) is not None)
            kept = {u: states[u] for u in keep if u in states}
            states.clear()
            states.update(kept)

    def _gauges(self) -> None:
        users = pending = buffered = 0
        for part in self.parts.values():
            users += len(part.proc.states)
            pending += len(part.proc.join.pending)
            buffered += part.merge.buffered()
        m.STATE_USERS.set(users)
        m.PENDING.set(pending)
        m.BUFFERED.set(buffered)
        outcomes = self.outcome_counts()
        for name, n in outcomes.items():  # duplicate, late, out_of_order, positive, negative…
            delta = n - self._reported.get(name, 0)
            if delta > 0:
                m.JOIN.labels(name).inc(delta)
        self._reported = outcomes

    def outcome_counts(self) -> Counter[str]:
        """State and join counters summed over partitions (duplicates, late, out of order…)."""
        total: Counter[str] = Counter()
        for part in self.parts.values():
            total += part.proc.counts + part.proc.join.counts
        return total
