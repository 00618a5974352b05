"""`adstream trainer`: the online trainer on Kafka — a thin async shell around `OnlineTrainer`.

Loop: collect a micro-batch from `ad.training-examples` (consumer group `settings.trainer_group`,
keyed by adapter id, so each adapter has one owner) of at most `settings.micro_batch` records or
`settings.micro_batch_s` seconds; validate (bad records go to `ad.dlq`, counted); learn; reserve
the deltas' seqs in Redis, then produce them to `ad.adapter-deltas` (key = adapter id).
Every `settings.snapshot_every_s`, each adapter that learned something is snapshotted: the
snapshot is published (next seq) and written to Redis with the input offsets it covers, and only
then are those offsets committed to Kafka (see `trainers.snapshots` for the key layout).

Delayed feedback: with `settings.trainer_hold_labels` (default) examples wait in a
`trainers.reorder.DelayBuffer` until the join's clock has passed their impression time plus
`settings.attribution_window_s`, and are learned in impression order (the join emits positives at
the click but negatives only when the window closes; learning in arrival order biases the
adapters and inflates progressive AUC). Offsets are committed only below the oldest held example,
so a crash loses nothing; examples released after it may be learned twice (at-least-once).

Restart: an adapter seen for the first time is restored from its Redis snapshot with its
highest reserved seq (a fresh snapshot re-aligns replicas when deltas were published after
it); assigned partitions resume after the snapshotted offsets, so nothing is learned twice or
skipped, and no seq is reused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from pydantic import ValidationError

from schemas import codec, topics
from schemas.errors import SchemaError
from schemas.events import AdapterDelta, DeadLetter, TrainingExample
from schemas.settings import Settings
from trainers import telemetry
from trainers.online import OnlineTrainer
from trainers.reorder import DelayBuffer
from trainers.snapshots import SnapshotStore

log = logging.getLogger(__name__)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, service: TrainerService) -> None:
        self.service = service

    async def on_partitions_revoked(self, revoked: Sequence[TopicPartition]) -> None:
        await self.service.on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: Sequence[TopicPartition]) -> None:
        await self.service.on_assigned(assigned)


class TrainerService:
    """The online trainer wired to Kafka and Redis (see the module docstring)."""

    def __init__(self, settings: Settings, trainer: OnlineTrainer) -> None:
        self.s = settings
        self.trainer = trainer
        self.in_topic = topics.topic_name(topics.TRAINING_EXAMPLES, settings.topic_prefix)
        self.out_topic = topics.topic_name(topics.ADAPTER_DELTAS, settings.topic_prefix)
        self.dlq_topic = topics.topic_name(topics.DLQ, settings.topic_prefix)
        self.group = f"{settings.topic_prefix}{settings.trainer_group}"
        self.position: dict[int, int] = {}  # partition → last offset processed
        self.adapter_partition: dict[str, int] = {}
        self.dirty: set[str] = set()
        self.published = 0
        self.learned = 0
        self._last_snapshot = time.monotonic()
        self._redis: Any = None
        self.consumer: AIOKafkaConsumer | None = None
        self.producer: AIOKafkaProducer | None = None
        self.store: SnapshotStore | None = None
        self.held = DelayBuffer(settings.attribution_window_s) if settings.trainer_hold_labels else None

    async def start(self) -> None:
        """Connect to Redis and Kafka and join the consumer group."""
        import redis.asyncio as aredis

        self._redis = aredis.Redis.from_url(self.s.redis_url)
        self.store = SnapshotStore(self._redis, self.s.redis_prefix, self.in_topic)
        self.producer = AIOKafkaProducer(bootstrap_servers=self.s.kafka_bootstrap, acks="all")
        await self.producer.start()
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=self.s.kafka_bootstrap,
            group_id=self.group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        self.consumer.subscribe([self.in_topic], listener=_Rebalance(self))
        await self.consumer.start()

    async def stop(self) -> None:
        """Snapshot and commit what was learned, then disconnect."""
        try:
            if self.held is not None and len(self.held):
                await self._learn(self.held.drain())
            if self.consumer is not None and self.dirty:
                await self.snapshot_all()
        finally:
            if self.consumer is not None:
                await self.consumer.stop()
            if self.producer is not None:
                await self.producer.stop()
            if self._redis is not None:
                await self._redis.aclose()

    # -- rebalance -------------------------------------------------------------------------
    async def on_revoked(self, revoked: Sequence[TopicPartition]) -> None:
        """Partitions are leaving: snapshot and commit, then forget their adapters."""
        if self.dirty:
            await self.snapshot_all()
        gone = {tp.partition for tp in revoked}
        for aid, part in list(self.adapter_partition.items()):
            if part in gone:
                self.trainer.runs.pop(aid, None)
                self.adapter_partition.pop(aid)
        for p in gone:
            self.position.pop(p, None)
        if self.held is not None:  # the new owner re-reads them from the committed offsets
            keep = [(e, pos) for e, pos in self.held.drain() if pos[0] not in gone]
            for e, (part, off) in keep:
                self.held.push(e, part, off)

    async def on_assigned(self, assigned: Sequence[TopicPartition]) -> None:
        """Resume assigned partitions after what the Redis snapshots already contain."""
        assert self.store is not None and self.consumer is not None
        snap_offsets = await self.store.partition_offsets()
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
        while not stop.is_set():
            records = await self._collect(stop)
            if records:
                await self.process(records)
            if self.dirty and time.monotonic() - self._last_snapshot >= self.s.snapshot_every_s:
                await self.snapshot_all()
            if max_examples is not None and self.learned >= max_examples:
                break

    async def _collect(self, stop: asyncio.Event) -> list[Any]:
        assert self.consumer is not None
        deadline = time.monotonic() + self.s.micro_batch_s
        out: list[Any] = []
        while len(out) < self.s.micro_batch and not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            batch = await self.consumer.getmany(
                timeout_ms=max(1, int(left * 1000)), max_records=self.s.micro_batch - len(out)
            )
            for records in batch.values():
                out.extend(records)
        return out

    async def process(self, records: Sequence[Any]) -> None:
        """Validate, restore unknown adapters, learn, and publish the resulting deltas."""
        decoded: list[tuple[TrainingExample, tuple[int, int]]] = []
        for r in records:
            self.position[r.partition] = max(r.offset, self.position.get(r.partition, -1))
            try:
                msg = codec.decode(TrainingExample, r.value)
            except SchemaError as exc:
                await self._dead_letter(r, str(exc))
                continue
            assert isinstance(msg, TrainingExample)
            decoded.append((msg, (r.partition, r.offset)))
        if self.held is not None:
            for ex, (part, off) in decoded:
                self.held.push(ex, part, off)
            decoded = self.held.pop_ready()
            telemetry.HELD.set(len(self.held))
        await self._learn(decoded)

    async def _learn(self, batch: Sequence[tuple[TrainingExample, tuple[int, int]]]) -> None:
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
        t0 = time.perf_counter()
        deltas = self.trainer.learn(examples, offsets) + self.trainer.take_pending()
        telemetry.STEP.observe(time.perf_counter() - t0)
        telemetry.count_trainer(before, self.trainer.counts)
        telemetry.EXAMPLES.inc(len(examples))
        self.learned += len(examples)
        await self.publish(deltas)
        telemetry.export(self.trainer.runs, per_adapter_labels=self.s.adapter_scheme == "slot")

    async def _restore(self, adapter_id: str) -> AdapterDelta | None:
        assert self.store is not None
        known = await self.store.read(adapter_id)
        if known.snapshot is None and known.last_seq < 0:
            self.trainer.run_for(adapter_id)
            return None
        self.trainer.restore(adapter_id, known.snapshot, known.last_seq, known.offsets)
        log.info(
            "adapter %s restored (snapshot seq %s, last seq %d)",
            adapter_id,
            known.snapshot.seq if known.snapshot else None,
            known.last_seq,
        )
        if known.snapshot is None or known.last_seq > known.snapshot.seq:
            return self.trainer.snapshot(adapter_id)  # replicas may hold later deltas: re-align
        return None

    async def _dead_letter(self, record: Any, error: str) -> None:
        assert self.producer is not None
        reason = "invalid"
        try:
            TrainingExample.model_validate_json(record.value)
        except ValidationError as exc:
            reason = codec.error_reason(exc)
        except Exception:
            reason = "bad_json"
        telemetry.INVALID.labels(reason).inc()
        now = datetime.now(UTC)
        dl = DeadLetter(
            event_id=f"dlq-{record.partition}-{record.offset}"[:64],
            ts=now,
            source_topic=self.in_topic,
            partition=record.partition,
            offset=record.offset,
            error=error[:4096],
            raw=bytes(record.value or b"")[:1_000_000],
        )
        await self.producer.send_and_wait(self.dlq_topic, codec.encode(dl), key=self.in_topic.encode())

    async def publish(self, deltas: Sequence[AdapterDelta]) -> None:
        """Reserve the seqs in Redis, then produce the deltas in order (acks=all)."""
        if not deltas:
            return
        assert self.store is not None and self.producer is not None
        await self.store.reserve({d.adapter_id: d.seq for d in deltas})
        futures = []
        for d in deltas:
            payload = codec.encode(d)
            futures.append(await self.producer.send(self.out_topic, payload, key=d.adapter_id.encode()))
            telemetry.DELTAS.labels("snapshot" if d.snapshot else "delta").inc()
            telemetry.DELTA_BYTES.observe(len(d.payload))
        await asyncio.gather(*futures)
        self.published += len(deltas)

    async def snapshot_all(self) -> None:
        """Snapshot every adapter that learned since the last time; store in Redis; commit offsets."""
        assert self.store is not None and self.consumer is not None
        t0 = time.perf_counter()
        await self.publish(self.trainer.flush() + self.trainer.take_pending())
        snaps = [self.trainer.snapshot(aid) for aid in sorted(self.dirty) if aid in self.trainer.runs]
        await self.publish(snaps)
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
