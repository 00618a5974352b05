"""Where generated events go: a JSON-lines file (one `encode(msg)` a line) or Kafka topics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

from schemas.clients import kafka_args
from schemas.codec import encode, key_of, topic_of
from schemas.errors import StackError
from schemas.events import Message
from schemas.settings import Settings
from schemas.topics import topic_name

log = logging.getLogger(__name__)

Progress = Callable[[int], None]


def write_jsonl(messages: Iterable[Message], out: Path | IO[bytes], progress: Progress | None = None) -> int:
    """Write each message as one JSON line (with its `kind`); returns how many were written."""
    if isinstance(out, Path):
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("wb") as fh:
            return write_jsonl(messages, fh, progress)
    n = 0
    for msg in messages:
        out.write(encode(msg))
        out.write(b"\n")
        n += 1
        if progress is not None and n % 1000 == 0:
            progress(1000)
    if progress is not None:
        progress(n % 1000)
    return n


def routed(msg: Message, prefix: str) -> tuple[str, bytes, bytes]:
    """(physical topic, key, value) of a message per the contract."""
    return topic_name(topic_of(msg), prefix), key_of(msg), encode(msg)


class Pacer:
    """Sleeps just enough to keep a target rate (events per second of wall time; 0 = no limit)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.start = time.perf_counter()
        self.sent = 0

    def delay(self, n: int) -> float:
        """Seconds to wait after `n` more events to stay at the target rate."""
        self.sent += n
        if self.rate <= 0:
            return 0.0
        return max(0.0, self.start + self.sent / self.rate - time.perf_counter())


class KafkaSink:
    """An aiokafka producer that routes contract messages to their (prefixed) topics."""

    def __init__(self, settings: Settings, *, linger_ms: int = 20, max_batch_size: int = 512 * 1024) -> None:
        self.settings = settings
        self.linger_ms = linger_ms
        self.max_batch_size = max_batch_size
        self.sent = 0
        self._producer: object | None = None
        self._parts: dict[str, list[int]] = {}
        from aiokafka.partitioner import DefaultPartitioner

        self._partitioner = DefaultPartitioner()

    async def start(self) -> KafkaSink:
        from aiokafka import AIOKafkaProducer
        from aiokafka.errors import KafkaError

        producer = AIOKafkaProducer(
            **kafka_args(self.settings),
            linger_ms=self.linger_ms,
            max_batch_size=self.max_batch_size,
            acks=1,
        )
        try:
            await producer.start()
        except KafkaError as exc:
            await producer.stop()
            raise StackError(f"cannot reach Kafka at {self.settings.kafka.bootstrap}: {exc}") from exc
        self._producer = producer
        return self

    async def stop(self) -> None:
        if self._producer is not None:
            await self._producer.stop()  # type: ignore[attr-defined]
            self._producer = None

    async def __aenter__(self) -> KafkaSink:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _partitions(self, topic: str) -> list[int]:
        parts = self._parts.get(topic)
        if parts is None:
            parts = self._parts[topic] = sorted(await self._producer.partitions_for(topic))  # type: ignore[union-attr]
        return parts

    async def send_many(self, messages: Iterable[Message]) -> int:
        """Send messages and wait until the broker acknowledged all of them.

        Messages are grouped per partition (the default murmur2 key partitioner, as `send()`
        would pick) into record batches sent with `send_batch`: several times faster than one
        `send()` per message, and per-partition order is kept.
        """
        from aiokafka.errors import KafkaError

        if self._producer is None:
            raise StackError("KafkaSink used before start()")
        producer: Any = self._producer
        groups: dict[tuple[str, int], list[tuple[bytes, bytes]]] = {}
        n = 0
        try:
            for msg in messages:
                topic, key, value = routed(msg, self.settings.topic_prefix)
                parts = await self._partitions(topic)
                groups.setdefault((topic, self._partitioner(key, parts, parts)), []).append((key, value))
                n += 1
            pending = []
            for (topic, partition), records in groups.items():
                batch = producer.create_batch()
                for key, value in records:
                    if batch.append(key=key, value=value, timestamp=None) is not None:
                        continue
                    if batch.record_count():
                        pending.append(await producer.send_batch(batch, topic, partition=partition))
                        batch = producer.create_batch()
                    if batch.append(key=key, value=value, timestamp=None) is None:  # over batch size
                        pending.append(await producer.send(topic, value=value, key=key, partition=partition))
                if batch.record_count():
                    pending.append(await producer.send_batch(batch, topic, partition=partition))
            await asyncio.gather(*pending)
        except KafkaError as exc:
            raise StackError(f"producing to Kafka at {self.settings.kafka.bootstrap} failed: {exc}") from exc
        self.sent += n
        return n


async def produce(
    messages: Iterable[Message],
    settings: Settings,
    *,
    rate: float = 0.0,
    progress: Progress | None = None,
    chunk: int = 20_000,
) -> int:
    """Produce every message to its contract topic (prefixed, keyed per the contract) with aiokafka,
    at most `rate` events/s when rate > 0. Returns the number acknowledged by the broker."""
    pacer = Pacer(rate)
    if rate > 0:  # small chunks at low rates, so pacing is smooth rather than bursty
        chunk = max(1, min(chunk, int(rate / 20)))
    batch: list[Message] = []
    async with KafkaSink(settings) as sink:
        for msg in messages:
            batch.append(msg)
            if len(batch) >= chunk:
                await _flush(sink, batch, pacer, progress)
        await _flush(sink, batch, pacer, progress)
        return sink.sent


async def _flush(sink: KafkaSink, batch: list[Message], pacer: Pacer, progress: Progress | None) -> None:
    n = await sink.send_many(batch)
    batch.clear()
    if progress is not None:
        progress(n)
    wait = pacer.delay(n)
    if wait > 0:
        await asyncio.sleep(wait)
