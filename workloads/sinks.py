"""Where generated events go: a JSON-lines file (one `encode(msg)` a line) or Kafka topics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

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


async def produce(
    messages: Iterable[Message],
    settings: Settings,
    *,
    rate: float = 0.0,
    progress: Progress | None = None,
    chunk: int = 2000,
) -> int:
    """Produce every message to its contract topic (prefixed, keyed per the contract) with aiokafka,
    at most `rate` events/s when rate > 0. Returns the number acknowledged by the broker."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import KafkaError

    producer = AIOKafkaProducer(
        bootstrap_servers=settings.kafka_bootstrap,
        linger_ms=20,
        max_batch_size=512 * 1024,
        acks=1,
    )
    try:
        await producer.start()
    except KafkaError as exc:
        await producer.stop()
        raise StackError(f"cannot reach Kafka at {settings.kafka_bootstrap}: {exc}") from exc
    pacer = Pacer(rate)
    if rate > 0:  # small chunks at low rates, so pacing is smooth rather than bursty
        chunk = max(1, min(chunk, int(rate / 20)))
    sent = 0
    pending: list[asyncio.Future[object]] = []
    try:
        for msg in messages:
            topic, key, value = routed(msg, settings.topic_prefix)
            pending.append(await producer.send(topic, value=value, key=key))
            if len(pending) >= chunk:
                await asyncio.gather(*pending)
                sent += len(pending)
                if progress is not None:
                    progress(len(pending))
                pending.clear()
                wait = pacer.delay(chunk)
                if wait > 0:
                    await asyncio.sleep(wait)
        await asyncio.gather(*pending)
        sent += len(pending)
        if progress is not None:
            progress(len(pending))
    except KafkaError as exc:
        raise StackError(f"producing to Kafka at {settings.kafka_bootstrap} failed: {exc}") from exc
    finally:
        await producer.stop()
    return sent
