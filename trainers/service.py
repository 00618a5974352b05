"""`adstream trainer`: the online trainer on Kafka — a thin async shell around `OnlineTrainer`.

Loop: collect a micro-batch from `ad.training-examples` (consumer group `settings.online.group`,
keyed by adapter id, so each adapter has one owner); it closes at `settings.online.micro_batch` records
or when its oldest example is due: `settings.online.max_wait_s` after that example was produced
(its record's timestamp, clamped to [0, max_wait_s] before its arrival here: a skewed clock shortens
or lengthens no wait beyond that); with nothing arriving the loop still wakes every
`settings.online.micro_batch_s` (snapshots). Validate (bad records go to `ad.dlq`, counted); learn;
reserve the deltas' seqs in Redis, then produce them to `ad.adapter-deltas` (key = adapter id)
without waiting for their acknowledgements (`Deliveries`): the next micro-batch is collected and
learned while they travel. A delivery that fails surfaces at the next turn of the loop (`run`
raises it, as an awaited send raised it before) and no further delta is produced after it; every
snapshot, and so every offset commit, first waits for all deliveries (nothing committed passes
a delta that is not on the topic), and so do a revocation and `stop`.
Every `settings.online.snapshot_every_s`, each adapter that learned something is snapshotted: the
snapshot is published (next seq) and written to Redis with the input offsets it covers, and only
then are those offsets committed to Kafka (see `trainers.snapshots` for the key layout).

Delayed feedback: with `settings.online.hold_labels` (default) examples wait in a
`trainers.reorder.DelayBuffer` until the join's clock has passed their impression time plus
`settings.streams.attribution_window_s`, and are learned in impression order (the join emits positives at
the click but negatives only when the window closes; learning in arrival order biases the
adapters and inflates progressive AUC). Offsets are committed only below the oldest held example,
so a crash loses nothing; examples released after it may be learned twice (at-least-once).
Only final labels are held: the fake-negative modes (`settings.online.label_mode`, `streams.join`) emit
examples meant to be learned at once, with the loss that corrects for it (`trainers.online`).

Restart: an adapter seen for the first time is restored from its Redis snapshot with its
highest reserved seq (a fresh snapshot re-aligns replicas when deltas were published after
it); assigned partitions resume after the snapshotted offsets, so nothing is learned twice or
skipped, and no seq is reused. An adapter without a seq record in Redis (new, or a Redis that
lost it) starts a new epoch (`schemas.delta` "Epochs"); when a snapshot survived without its
record, that state is published at once as the new epoch's first snapshot (replicas reset to it).

Bad input: a record that fails the contract (`trainers.intake.ExampleDecoder`: the contract's
rules, checked for a batch at once), or an example the ranker cannot featurize, goes to
`ad.dlq` (its raw bytes capped so the dead letter fits the producer) and the loop goes on; an
example whose `event_id` was taken already (among the last `settings.online.dedupe_ids`: a
streams batch produced again after a retry) is skipped, counted, not learned twice.

Guards: every message is checked before its seq is reserved: a snapshot must pass what a replica
checks (`trainers.snapshots.check_snapshot`: structure, finite values, ΔW norm within
`settings.serving.adapter_max_norm`) and so must the state replicas reach after the batch. A refused
adapter is not published; it is put back to its last Redis snapshot (or to zero when there is no
valid one) and that state is published as a fresh snapshot with a new seq. A stored snapshot
that fails the same checks is not resumed from: the adapter starts at zero, after every seq
Redis records for it.

Redis errors: `SnapshotStore` retries transient errors (`schemas.retry`) with capped exponential
backoff (`settings.online.redis_backoff`; counted in `adstream_trainers_redis_errors_total`). Until
an operation succeeds the loop waits: no seq is produced before it is reserved, and Kafka offsets
are committed only after the snapshots covering them are in Redis. When `give_up_s` runs out,
`run` raises StoreError and `stop` skips the final snapshot: a restart resumes from what Redis holds.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from pydantic import ValidationError
from redis.exceptions import RedisError

from schemas import codec, topics
from schemas.clients import fetch_args, group_args, kafka_args, redis_args
from schemas.delta import describe_epoch, new_epoch
from schemas.errors import SchemaError, StoreError
from schemas.events import AdapterDelta, DeadLetter, TrainingExample, dead_letter_fields
from schemas.retry import Backoff
from schemas.settings import Settings
from trainers import telemetry
from trainers.corrections import CorrectionReader
from trainers.intake import ExampleDecoder, take_ready
from trainers.models.features import RankerBatch, featurize
from trainers.online import OnlineTrainer
from trainers.reorder import DelayBuffer
from trainers.snapshots import (
    Restored,
    ServeBound,
    SnapshotRefused,
    SnapshotStore,
    check_snapshot,
    check_state,
)

log = logging.getLogger(__name__)


def collect_deadline(now: float, micro_batch_s: float, due: float | None) -> float:
    """When a collect started at `now` must return: when the oldest example not learned yet is
    `due`, or after `micro_batch_s` when none waits (the idle wake-up).

    >>> collect_deadline(10.0, 0.5, None), collect_deadline(10.0, 0.5, 10.03)
    (10.5, 10.03)
    """
    return now + micro_batch_s if due is None else min(now + micro_batch_s, due)


def due_at(arrived: float, now_wall: float, produced_ms: int | None, max_wait_s: float) -> float:
    """When an example that arrived at `arrived` (monotonic) must be learned: `max_wait_s` after
    it was produced (`produced_ms`, its record's timestamp), the time it already spent on the way
    (the broker's fetch wait) counted, but clamped to [0, max_wait_s]: a producer's clock ahead
    of ours waits the whole `max_wait_s`, one far behind learns at once, never later or sooner.

    >>> due_at(50.0, 1000.0, 999_750, 0.5), due_at(50.0, 1000.0, 990_000, 0.5)
    (50.25, 50.0)
    >>> due_at(50.0, 1000.0, 1_000_500, 0.5), due_at(50.0, 1000.0, None, 0.5)
    (50.5, 50.5)
    """
    if produced_ms is None or produced_ms <= 0:
        return arrived + max_wait_s
    waited = min(max(now_wall - produced_ms / 1000, 0.0), max_wait_s)
    return arrived + max_wait_s - waited


class Deliveries:
    """Deltas produced but not acknowledged yet (`publish` does not wait for them).

    `add` tracks a send's delivery future; a delivery that fails is kept (`error`) and `check`
    raises it, so the loop stops as an awaited send stopped it; `wait` waits for every one
    (before a snapshot's Redis write and offset commit, a revocation, `stop`) and raises a failure.
    """

    def __init__(self) -> None:
        self.pending: set[asyncio.Future[Any]] = set()
        self.error: BaseException | None = None
        self.failed = 0

    def add(self, future: asyncio.Future[Any]) -> None:
        self.pending.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: asyncio.Future[Any]) -> None:
        self.pending.discard(future)
        if future.cancelled():
            exc: BaseException | None = asyncio.CancelledError("delta delivery cancelled")
        else:
            exc = future.exception()
        if exc is not None:
            self.failed += 1
            if self.error is None:
                self.error = exc
                log.error("a delta was not delivered (%s: %s); the trainer stops", type(exc).__name__, exc)

    def check(self) -> None:
        """Raise the first delivery failure (none: nothing)."""
        if self.error is not None:
            raise self.error

    async def wait(self) -> None:
        """Wait until every tracked delivery is settled; raise the first failure."""
        while self.pending:
            await asyncio.wait(list(self.pending))
        self.check()


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, service: TrainerService) -> None:
        self.service = service

    async def on_partitions_revoked(self, revoked: Sequence[TopicPartition]) -> None:
        await self.service.on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: Sequence[TopicPartition]) -> None:
        await self.service.on_assigned(assigned)


class TrainerService:
    """The online trainer wired to Kafka and Redis (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        trainer: OnlineTrainer,
        *,
        redis: Any = None,
        retry: Backoff | None = None,
    ) -> None:
        """`redis`: a `redis.asyncio.Redis`-like client to use instead of one from `redis.url`;
        `retry`: the Redis backoff instead of `settings.online.redis_backoff`."""
        self.s = settings
        self.trainer = trainer
        self.in_topic = topics.topic_name(topics.TRAINING_EXAMPLES, settings.topic_prefix)
        self.out_topic = topics.topic_name(topics.ADAPTER_DELTAS, settings.topic_prefix)
        self.dlq_topic = topics.topic_name(topics.DLQ, settings.topic_prefix)
        self.group = f"{settings.topic_prefix}{settings.online.group}"
        self.position: dict[int, int] = {}  # partition → last offset processed
        self.adapter_partition: dict[str, int] = {}
        self.dirty: set[str] = set()
        # event ids of examples taken (learned or held), oldest first: a re-delivered example
        # (a streams batch produced again after a retry) is skipped, not learned twice
        self.seen: dict[str, None] = {}
        self.published = 0
        self.learned = 0
        self._last_snapshot = time.monotonic()
        # when the oldest example not learned yet must be (monotonic; None: none waits)
        self._due: float | None = None
        self.deliveries = Deliveries()  # deltas produced, acknowledgements not awaited
        self._redis: Any = redis
        self.retry = retry or settings.online.redis_backoff
        self.correction_reader: CorrectionReader | None = None  # made at the first step (Redis)
        self.failure: StoreError | None = None  # Redis gave up: no final snapshot, `run` re-raises
        bank = trainer.bank
        self.bound = ServeBound(
            bank.base_version,
            bank.spec.rank,
            bank.spec.scaling,
            settings.serving.adapter_max_norm,
            bank.shapes,
        )
        self.decoder = ExampleDecoder()  # the contract's validation, fast (`trainers.intake`)
        self.consumer: AIOKafkaConsumer | None = None
        self.producer: AIOKafkaProducer | None = None
        self.store: SnapshotStore | None = None
        self.held = (
            DelayBuffer(settings.streams.attribution_window_s, settings.streams.watermark_window)
            if settings.online.hold_labels
            else None
        )

    async def start(self) -> None:
        """Connect to Redis and Kafka and join the consumer group."""
        if self._redis is None:
            import redis.asyncio as aredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff

            # the store retries (bounded, counted); the client's own silent retries would hide errors
            self._redis = aredis.Redis.from_url(**redis_args(self.s), retry=Retry(NoBackoff(), 0))
        self.store = SnapshotStore(
            self._redis,
            self.s.redis_prefix,
            self.in_topic,
            self.retry,
            lambda op, outcome: telemetry.REDIS_ERRORS.labels(op, outcome).inc(),
        )
        self.producer = AIOKafkaProducer(**kafka_args(self.s), acks="all")
        await self.producer.start()
        self.consumer = AIOKafkaConsumer(
            **kafka_args(self.s),
            **group_args(self.s),
            **fetch_args(self.s),
            group_id=self.group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        self.consumer.subscribe([self.in_topic], listener=_Rebalance(self))
        await self.consumer.start()

    async def stop(self) -> None:
        """Snapshot and commit what was learned, then disconnect (no snapshot after Redis gave up:
        the offsets stay at the last snapshot, and a restart re-learns from there)."""
        try:
            if self.failure is None and self.deliveries.error is None:
                if self.held is not None and len(self.held):
                    await self._learn(self.held.drain())
                if self.consumer is not None and self.dirty:
                    await self.snapshot_all()
            await self.deliveries.wait()
        except StoreError as exc:
            log.error("final snapshot not written, offsets not committed (a restart re-learns): %s", exc)
        except Exception as exc:  # a delta not delivered: nothing committed past it, a restart re-learns
            log.error("a delta was not delivered, offsets not committed (a restart re-learns): %s", exc)
        finally:
            if self.consumer is not None:
                await self.consumer.stop()
            if self.producer is not None:
                await self.producer.stop()
            if self._redis is not None:
                await self._redis.aclose()

    # -- rebalance -------------------------------------------------------------------------
    async def on_revoked(self, revoked: Sequence[TopicPartition]) -> None:
        """Partitions are leaving: snapshot and commit, then forget their adapters (also when the
        snapshot failed: the new owner resumes from Redis and the committed offsets, realigning
        replicas past any seq we reserved)."""
        if self.dirty and self.failure is None and self.deliveries.error is None:
            try:
                await self.snapshot_all()
            except StoreError as exc:
                log.error("snapshot before revocation failed; the new owner re-learns from Redis: %s", exc)
            except Exception as exc:  # a failed delivery: `run` raises it next
                log.error("snapshot before revocation failed; the new owner re-learns from Redis: %s", exc)
        gone = {tp.partition for tp in revoked}
        for aid, part in list(self.adapter_partition.items()):
            if part in gone:
                self.trainer.forget(aid)  # its PEFT layers too: the bank must not keep growing
                self.adapter_partition.pop(aid)
                self.dirty.discard(aid)
        for p in gone:
            self.position.pop(p, None)
        if self.held is not None:  # the new owner re-reads them from the committed offsets
            keep = []
            for e, pos in self.held.drain():
                if pos[0] in gone:
                    self.seen.pop(e.event_id, None)  # not learned: take it again if it comes back
                else:
                    keep.append((e, pos))
            for e, (part, off) in keep:
                self.held.push(e, part, off)

    async def on_assigned(self, assigned: Sequence[TopicPartition]) -> None:
        """Resume assigned partitions after what the Redis snapshots already contain."""
        assert self.store is not None and self.consumer is not None
        try:
            snap_offsets = await self.store.partition_offsets()
        except StoreError as exc:
            # resuming at the committed offsets could learn twice what a snapshot holds: stop instead
            # (aiokafka swallows listener errors, so `run` raises it)
            log.error("cannot read snapshotted offsets; stopping: %s", exc)
            self.failure = exc
            return
        for tp in assigned:
            if tp.partition in snap_offsets:
                committed = await self.consumer.committed(tp)
                resume = snap_offsets[tp.partition] + 1
                if committed is None or resume > committed:
                    self.consumer.seek(tp, resume)
                    log.info("partition %d resumes at %d (Redis snapshot)", tp.partition, resume)

    # -- the loop --------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event | None = None, max_examples: int | None = None) -> None:
        """Consume, learn and publish until `stop` is set (or `max_examples` were learned)."""
        stop = stop or asyncio.Event()
        assert self.store is not None
        self.store.abort = stop  # a stop request ends Redis retries
        try:
            while not stop.is_set():
                if self.failure is not None:
                    raise self.failure
                self.deliveries.check()
                records = await self._collect(stop)
                if records:
                    await self.process(records)
                await self._learn_waiting()
                if self.dirty and time.monotonic() - self._last_snapshot >= self.s.online.snapshot_every_s:
                    await self.snapshot_all()
                if max_examples is not None and self.learned >= max_examples:
                    break
        except StoreError as exc:
            self.failure = exc
            raise
        finally:
            self.store.abort = None

    async def _collect(self, stop: asyncio.Event) -> list[Any]:
        """A micro-batch: records until there are `micro_batch` of them or the oldest example
        not learned yet is due (`due_at`: `online.max_wait_s` after it was produced), whichever
        comes first; with nothing arriving, an empty one after `micro_batch_s` (the loop's
        wake-up for snapshots). Examples still waiting in adapter buffers count as the oldest."""
        assert self.consumer is not None
        limit, max_wait = self.s.online.micro_batch, self.s.online.max_wait_s
        deadline = collect_deadline(time.monotonic(), self.s.online.micro_batch_s, self._due)
        out: list[Any] = []
        while len(out) < limit and not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            batch = await self.consumer.getmany(
                timeout_ms=max(1, math.ceil(left * 1000)), max_records=limit - len(out)
            )
            if not batch:
                continue
            arrived, wall = time.monotonic(), time.time()
            for records in batch.values():
                if not records:
                    continue
                out.extend(records)
                # records of a partition come in produce order: its first is its oldest
                due = due_at(arrived, wall, getattr(records[0], "timestamp", None), max_wait)
                if self._due is None or due < self._due:
                    self._due = due
            if self._due is not None:
                deadline = min(deadline, self._due)
        return out

    async def process(self, records: Sequence[Any]) -> None:
        """Validate, restore unknown adapters, learn, and publish the resulting deltas."""
        decoded: list[tuple[TrainingExample, tuple[int, int]]] = []
        taken: list[Any] = []
        for r, msg in zip(records, self.decoder.decode([r.value for r in records]), strict=True):
            self.position[r.partition] = max(r.offset, self.position.get(r.partition, -1))
            if isinstance(msg, SchemaError):
                await self._dead_letter(r, str(msg))
                continue
            if msg.event_id in self.seen:
                telemetry.DUPLICATES.inc()
                continue
            self._remember(msg.event_id)
            decoded.append((msg, (r.partition, r.offset)))
            taken.append(r)
        decoded, features = await self._featurizable(decoded, taken)
        decoded, features = take_ready(self.held, decoded, features)
        if self.held is not None:
            telemetry.HELD.set(len(self.held))
        await self._learn(decoded, features)

    def _remember(self, event_id: str) -> None:
        self.seen[event_id] = None
        if len(self.seen) > self.s.online.dedupe_ids:
            del self.seen[next(iter(self.seen))]

    async def _featurizable(
        self, decoded: list[tuple[TrainingExample, tuple[int, int]]], records: list[Any]
    ) -> tuple[list[tuple[TrainingExample, tuple[int, int]]], RankerBatch | None]:
        """The examples the ranker can take, and their features when all of them could (the
        step reuses them); one it cannot (featurize raises) is dead-lettered instead of stopping
        the trainer, which would read it again after every restart."""
        cfg = self.trainer.bank.config
        try:
            return decoded, featurize([ex for ex, _ in decoded], cfg)
        except SchemaError:
            pass
        ok = []
        for (ex, pos), r in zip(decoded, records, strict=True):
            try:
                featurize([ex], cfg)
            except SchemaError as exc:
                await self._dead_letter(r, f"not featurizable: {exc}")
                continue
            ok.append((ex, pos))
        return ok, None

    async def _learn(
        self, batch: Sequence[tuple[TrainingExample, tuple[int, int]]], features: RankerBatch | None = None
    ) -> None:
        # room for this batch's new adapters first (LRU eviction, `online.max_adapters`): the
        # evicted ones' snapshots go to Redis before any of them could be restored again
        self.trainer.make_room(dict.fromkeys(ex.adapter_id for ex, _ in batch))
        await self._publish_all(self.trainer.take_pending())
        realign: list[AdapterDelta] = []
        for ex, (part, _) in batch:
            if ex.adapter_id not in self.trainer.runs:
                snap = await self._restore(ex.adapter_id)
                if snap is not None:
                    realign.append(snap)
            self.adapter_partition[ex.adapter_id] = part
            self.dirty.add(ex.adapter_id)
        if realign:
            await self.publish(realign)
        if not batch:
            return
        examples = [ex for ex, _ in batch]
        offsets = [pos for _, pos in batch]
        before = dict(self.trainer.counts)
        corrections = await self._corrections(examples)
        t0 = time.perf_counter()
        deltas = (
            self.trainer.learn(examples, offsets, features=features, corrections=corrections)
            + self.trainer.take_pending()
        )
        telemetry.STEP.observe(time.perf_counter() - t0)
        telemetry.count_trainer(before, self.trainer.counts)
        telemetry.EXAMPLES.inc(len(examples))
        self.learned += len(examples)
        await self._publish_all(deltas)
        telemetry.export(
            self.trainer.runs, per_adapter_labels=self.s.adapter_scheme == "slot", slots=self.s.slots.names
        )

    async def _corrections(self, examples: Sequence[TrainingExample]) -> np.ndarray | None:
        """The per-user correction each example was served with (`trainers.corrections`), or None
        when the offset is off or Redis did not answer (the step then learns without it: a step is
        not worth a stalled trainer)."""
        if not self.s.online.correction_offset or self.s.state.feedback_lr <= 0:
            return None
        if self.correction_reader is None:
            self.correction_reader = CorrectionReader(
                self._redis, self.s.redis_prefix, self.s.state, self.s.online.dedupe_ids
            )
        try:
            return await self.correction_reader.read(examples)
        except (RedisError, OSError, StoreError) as exc:
            telemetry.REDIS_ERRORS.labels("corrections", "skipped").inc()
            log.warning("per-user corrections not read (%s): this step learns without them", exc)
            return None

    async def _learn_waiting(self) -> None:
        """Freshness: an adapter whose group is smaller than `min_step_examples` waits for more
        examples, but only until the oldest waiting example is due (`online.max_wait_s` after it
        was produced) — then it is learned as it is (a quiet adapter's click reaches replicas in
        tens of milliseconds; the step's size scales with its examples, `trainers.online`)."""
        if not self.trainer.waiting():
            self._due = None
            return
        now = time.monotonic()
        if self._due is None:  # set by _collect when the records arrived
            self._due = now + self.s.online.max_wait_s
        if now < self._due:
            return
        self._due = None
        before = dict(self.trainer.counts)
        t0 = time.perf_counter()
        deltas = self.trainer.flush() + self.trainer.take_pending()
        telemetry.STEP.observe(time.perf_counter() - t0)
        telemetry.count_trainer(before, self.trainer.counts)
        await self._publish_all(deltas)

    async def _restore(self, adapter_id: str) -> AdapterDelta | None:
        known = await self._last_good(adapter_id, "restore")
        snap = known.snapshot
        epoch = known.epoch
        if not known.seq_record:  # the seqs published so far are unknown: a new lineage
            epoch = new_epoch(after=snap.epoch if snap is not None else None)
            if snap is not None or known.last_seq >= 0:
                telemetry.EPOCHS.inc()
                log.warning(
                    "adapter %s: Redis has no seq record (last seq known %d); new epoch %s",
                    adapter_id,
                    known.last_seq,
                    describe_epoch(epoch),
                )
        if snap is None and known.last_seq < 0:
            self.trainer.run_for(adapter_id, epoch=epoch)
            return None
        offsets = known.offsets if snap is not None else {}
        self.trainer.restore(adapter_id, snap, known.last_seq, offsets, epoch=epoch)
        log.info(
            "adapter %s restored (snapshot seq %s, last seq %d, epoch %s)",
            adapter_id,
            snap.seq if snap else None,
            known.last_seq,
            describe_epoch(epoch),
        )
        if snap is None or known.last_seq > snap.seq or epoch != snap.epoch:
            # replicas may hold later deltas, or another epoch: re-align them
            return self.trainer.snapshot(adapter_id)
        return None

    async def _last_good(self, adapter_id: str, stage: str) -> Restored:
        """The adapter's Redis record, its snapshot dropped (logged, counted) if serving would refuse it.

        The seqs stay: a fresh start continues after every seq Redis records, so none is reused."""
        assert self.store is not None
        known = await self.store.read(adapter_id)
        problem, reason = known.invalid, "invalid"
        if known.snapshot is not None:
            try:
                check_snapshot(known.snapshot, adapter_id, self.bound)
            except SnapshotRefused as exc:
                problem, reason = str(exc), exc.reason
        if problem is None:
            return known
        telemetry.REFUSED.labels(stage, reason).inc()
        log.warning("adapter %s: Redis snapshot not used (%s); starting from zero", adapter_id, problem)
        return replace(known, snapshot=None, offsets={}, invalid=problem)

    async def _dead_letter(self, record: Any, error: str) -> None:
        assert self.producer is not None
        reason = "invalid"
        try:
            TrainingExample.model_validate_json(record.value)
        except ValidationError as exc:
            reason = codec.error_reason(exc)
        except (TypeError, ValueError):  # not JSON at all (or no value): bad data, the expected case
            reason = "bad_json"
        telemetry.INVALID.labels(reason).inc()
        now = datetime.now(UTC)
        dl = DeadLetter(
            event_id=f"dlq-{record.partition}-{record.offset}"[:64],
            ts=now,
            source_topic=self.in_topic,
            partition=record.partition,
            offset=record.offset,
            **dead_letter_fields(bytes(record.value or b""), error),
        )
        await self.producer.send_and_wait(self.dlq_topic, codec.encode(dl), key=self.in_topic.encode())

    async def _publish_all(self, deltas: Sequence[AdapterDelta]) -> list[AdapterDelta]:
        """`publish`, then store the final snapshots of adapters the trainer evicted meanwhile
        (Redis is where `_restore` finds them when their examples come back)."""
        published = await self.publish(deltas)
        evicted = {d.adapter_id for d in self.trainer.take_evicted()}
        if evicted:
            assert self.store is not None
            await self.deliveries.wait()  # their last snapshots are on the topic before Redis has them
            last = {d.adapter_id: d for d in published if d.snapshot and d.adapter_id in evicted}
            await self.store.write([(d, d.learned_offsets or {}) for d in last.values()], {})
            for aid in evicted:
                self.adapter_partition.pop(aid, None)
                self.dirty.discard(aid)
            telemetry.EVICTIONS.inc(len(evicted))
        return published

    async def publish(self, deltas: Sequence[AdapterDelta]) -> list[AdapterDelta]:
        """Guard, reserve the seqs in Redis, then produce the deltas in order (acks=all) without
        waiting for the acknowledgements (`Deliveries`: a failure surfaces at the next turn of
        the loop, and every snapshot waits for them all); returns what was produced (an adapter
        serving would refuse is replaced by a rollback snapshot). Nothing more is produced once a
        delivery failed: the trainer stops, and its restart re-aligns replicas from Redis."""
        if not deltas:
            return []
        assert self.store is not None and self.producer is not None
        self.deliveries.check()
        deltas = await self._guard(deltas)
        await self.store.reserve(
            {d.adapter_id: d.seq for d in deltas}, {d.adapter_id: d.epoch for d in deltas}
        )
        for d in deltas:
            payload = codec.encode(d)
            self.deliveries.add(await self.producer.send(self.out_topic, payload, key=d.adapter_id.encode()))
            telemetry.DELTAS.labels("snapshot" if d.snapshot else "delta").inc()
            telemetry.DELTA_BYTES.observe(len(d.payload))
        self.published += len(deltas)
        return deltas

    async def _guard(self, deltas: Sequence[AdapterDelta]) -> list[AdapterDelta]:
        """Check each adapter's messages (snapshots) and the state they bring replicas to; an
        adapter that fails loses its messages and is rolled back (`_roll_back`)."""
        out = list(deltas)
        for aid in dict.fromkeys(d.adapter_id for d in deltas):
            mine = [d for d in out if d.adapter_id == aid]
            try:
                for d in mine:
                    if d.snapshot:
                        check_snapshot(d, aid, self.bound)
                run = self.trainer.runs.get(aid)
                if run is not None:
                    check_state(run.published.tensors, self.bound)
            except SnapshotRefused as exc:
                telemetry.REFUSED.labels("publish", exc.reason).inc()
                log.warning("adapter %s: seq(s) %s not published: %s", aid, [d.seq for d in mine], exc)
                out = [d for d in out if d.adapter_id != aid]
                out.append(await self._roll_back(aid, max(d.seq for d in mine)))
        return out

    async def _roll_back(self, adapter_id: str, refused_seq: int) -> AdapterDelta:
        """Put a refused adapter back to its last Redis snapshot (zero when there is no valid one);
        returns a snapshot of that state with a seq past `refused_seq`.

        Why not zero (the base) every time: an out-of-bound ΔW is one bad stretch of training, and
        the last snapshot is what replicas serve now and what a restart would resume from, so an
        advertiser keeps its learned lift and serving sees no jump; resetting to the base is the
        quality guard's call (rolling AUC below the base). The examples learned since that
        snapshot are dropped, not re-learned: they led the adapter out of bounds. A fresh
        optimizer is used (its moments belong to the refused trajectory).
        """
        known = await self._last_good(adapter_id, "rollback")
        last = max(known.last_seq, refused_seq)  # refused seqs are skipped, never reused
        run = self.trainer.runs.get(adapter_id)  # the lineage replicas follow now goes on
        epoch = run.published.epoch if run is not None else known.epoch
        self.trainer.restore(adapter_id, known.snapshot, last, known.offsets, epoch=epoch)
        to = "last_snapshot" if known.snapshot is not None else "zero"
        telemetry.ROLLBACKS.labels(to).inc()
        log.warning(
            "adapter %s rolled back to %s (seq %s)",
            adapter_id,
            to,
            known.snapshot.seq if known.snapshot is not None else None,
        )
        return self.trainer.snapshot(adapter_id)

    async def snapshot_all(self) -> None:
        """Snapshot every adapter that learned since the last time; store in Redis; commit offsets."""
        assert self.store is not None and self.consumer is not None
        t0 = time.perf_counter()
        await self.publish(self.trainer.flush() + self.trainer.take_pending())
        made = [self.trainer.snapshot(aid) for aid in sorted(self.dirty) if aid in self.trainer.runs]
        snaps = await self.publish(made)  # guarded: rolled-back adapters come back as their new snapshot
        await self.deliveries.wait()  # every delta and snapshot on the topic before Redis and Kafka commit
        low = self.held.low_offsets() if self.held is not None else {}
        commit = {p: min(o + 1, low.get(p, o + 1)) for p, o in self.position.items()}
        covered = {p: c - 1 for p, c in commit.items()}
        await self.store.write([(s, self.trainer.runs[s.adapter_id].offsets) for s in snaps], covered)
        if commit:
            await self.consumer.commit({TopicPartition(self.in_topic, p): c for p, c in commit.items()})
        self.dirty.clear()
        self._last_snapshot = time.monotonic()
        telemetry.SNAPSHOT.observe(time.perf_counter() - t0)
        log.info("snapshotted %d adapter(s); committed %s", len(snaps), commit)
