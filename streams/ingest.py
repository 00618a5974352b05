"""Validation at the edge: raw Kafka bytes → contract event, or a DeadLetter with its reason."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime

from pydantic import ValidationError

from schemas.codec import decode, error_reason, model_for_topic
from schemas.errors import SchemaError
from schemas.events import MAX_RAW_BYTES, DeadLetter, Message


@dataclass(frozen=True, slots=True)
class Invalid:
    """A record that failed validation: its dead letter and a low-cardinality reason."""

    dead_letter: DeadLetter
    reason: str


def dead_letter_id(topic: str, partition: int, offset: int) -> str:
    """Deterministic id of a record's dead letter (a replay reproduces it, consumers dedupe)."""
    digest = hashlib.blake2b(f"{topic}\0{partition}\0{offset}".encode(), digest_size=16).hexdigest()
    return f"dlq-{digest}"


def reason_of(exc: SchemaError) -> str:
    cause = exc.__cause__
    if isinstance(cause, ValidationError):
        return error_reason(cause)
    if isinstance(cause, UnicodeDecodeError):
        return "not_utf8"
    return "invalid"


def validate(
    base_topic: str, physical_topic: str, partition: int, offset: int, value: bytes | None, ts_ms: int
) -> Message | Invalid:
    """The record's contract event, or an `Invalid` carrying its dead letter."""
    model = model_for_topic(base_topic)
    raw = value or b""
    try:
        if value is None:
            raise SchemaError("message has no value (tombstone)")
        return decode(model, raw)
    except SchemaError as exc:
        reason = "empty" if value is None else reason_of(exc)
        error = str(exc) or reason
        if len(raw) > MAX_RAW_BYTES:
            error = f"{error} (original {len(raw)} bytes truncated to {MAX_RAW_BYTES})"
            raw = raw[:MAX_RAW_BYTES]
        when = datetime.fromtimestamp(max(ts_ms, 0) / 1000, tz=UTC)
        dl = DeadLetter(
            event_id=dead_letter_id(physical_topic, partition, offset),
            ts=when,
            source_topic=physical_topic,
            partition=partition,
            offset=offset,
            error=error[:4096],
            raw=raw,
        )
        return Invalid(dl, reason)
