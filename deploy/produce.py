"""`adstream produce`: validate JSON lines against the contract and produce the valid ones."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from schemas.clients import kafka_args
from schemas.codec import decode, encode, key_of, model_for_topic
from schemas.errors import BrokerError, SchemaError
from schemas.settings import Settings
from schemas.signing import event_key, seal
from schemas.topics import topic_name


@dataclass
class ProduceReport:
    """What `produce` did: how many lines were sent, and each rejected line with its reason."""

    sent: int = 0
    blank: int = 0
    invalid: list[tuple[int, str]] = field(default_factory=list)


def validate_lines(
    topic: str, lines: Iterable[bytes], report: ProduceReport, signing_key: bytes | None = None
) -> Iterable[tuple[bytes, bytes]]:
    """Yield (key, value) for each valid line; record invalid ones by 1-based line number. With
    `signing_key` (the stack's event key), impressions are signed and clicks and dwells get their
    click tokens (`schemas.signing.seal`): the operator vouches for what this tool sends."""
    model = model_for_topic(topic)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            report.blank += 1
            continue
        try:
            msg = decode(model, line)
        except SchemaError as exc:
            report.invalid.append((number, str(exc)))
            continue
        if signing_key is not None:
            msg = seal(msg, signing_key)
        yield key_of(msg), encode(msg)


async def produce_lines(
    settings: Settings, topic: str, lines: Iterable[bytes], *, sign: bool = True
) -> ProduceReport:
    """Validate every line and produce the valid ones to the (prefixed) topic, keyed per the
    contract; with `sign`, impressions, clicks and dwells are signed with the stack's event key
    (the streams worker drops them unsigned, `streams.verify_impressions` / `_clicks`)."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import KafkaError

    report = ProduceReport()
    model_for_topic(topic)  # fail before connecting when the topic is not a contract topic
    # acks=all: an event is only reported sent once every in-sync replica has it (reliability M14)
    producer = AIOKafkaProducer(**kafka_args(settings), linger_ms=5, max_batch_size=256 * 1024, acks="all")
    try:
        await producer.start()
    except KafkaError as exc:
        await producer.stop()  # a producer that failed to start still holds its client
        raise BrokerError(f"Kafka at {settings.kafka.bootstrap} did not answer ({exc})") from exc
    physical = topic_name(topic, settings.topic_prefix)
    signing_key = event_key(settings) if sign else None
    try:
        pending = []
        for key, value in validate_lines(topic, lines, report, signing_key):
            pending.append(await producer.send(physical, value=value, key=key))
            if len(pending) >= 10_000:
                await asyncio.gather(*pending)
                report.sent += len(pending)
                pending.clear()
        await asyncio.gather(*pending)
        report.sent += len(pending)
    finally:
        await producer.stop()
    return report
