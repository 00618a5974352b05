"""Validation at the edge: raw Kafka bytes → contract event, or a DeadLetter with its reason."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from pydantic import ValidationError

from schemas.codec import decode, error_reason, model_for_topic
from schemas.errors import SchemaError
from schemas.events import MAX_TS, DeadLetter, Message, dead_letter_fields
from schemas.signing import check_event


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
    """The record's contract event, or an `Invalid` carrying its dead letter (the worker hands
    here the records the batch decoder's fast path, `schemas.decode.BatchDecoder`, did not take)."""
    model = model_for_topic(base_topic)
    raw = value or b""
    try:
        if value is None:
            raise SchemaError("message has no value (tombstone)")
        return decode(model, raw)
    except SchemaError as exc:
        reason = "empty" if value is None else reason_of(exc)
        return dead_letter(physical_topic, partition, offset, raw, ts_ms, str(exc) or reason, reason)


def ahead_of_record(  # noqa: PLR0913 - the record, and keyword-only knobs
    event: Message,
    physical_topic: str,
    partition: int,
    offset: int,
    value: bytes,
    ts_ms: int,
    max_skew_s: float,
    *,
    now_s: float | None = None,
    event_ts: float | None = None,
) -> Invalid | None:
    """A dead letter when the event claims a time more than `max_skew_s` after it was written.

    "Written" is the record's Kafka timestamp capped by the wall clock (`now_s`, default now):
    a replay of old records decides as the first pass did (their timestamps are in the past),
    while a producer cannot vouch for a future event by also setting its record's CreateTime
    ahead, and a record without a timestamp (≤ 0) is judged against the wall clock instead of
    not at all. The label join's watermark does not follow one such event anyway
    (`schemas.watermark`); this keeps them out of user state and ClickHouse too.
    """
    now = time.time() if now_s is None else now_s
    written = now if ts_ms <= 0 else min(ts_ms / 1000, now)
    if (event.ts.timestamp() if event_ts is None else event_ts) <= written + max_skew_s:
        return None
    if ts_ms <= 0:
        against = f"the wall clock {datetime.fromtimestamp(now, tz=UTC).isoformat()} (no record timestamp)"
    elif written < ts_ms / 1000:
        against = (
            f"the wall clock {datetime.fromtimestamp(now, tz=UTC).isoformat()} (the record's own "
            f"timestamp {datetime.fromtimestamp(ts_ms / 1000, tz=UTC).isoformat()} is in the future)"
        )
    else:
        against = f"the record's Kafka timestamp {datetime.fromtimestamp(ts_ms / 1000, tz=UTC).isoformat()}"
    error = f"field 'ts': {event.ts.isoformat()} is more than {max_skew_s:.0f}s after {against}"
    return dead_letter(physical_topic, partition, offset, value, ts_ms, error, "future_timestamp")


def unvouched(  # noqa: PLR0913 - the record, and keyword-only knobs
    event: Message,
    physical_topic: str,
    partition: int,
    offset: int,
    value: bytes,
    ts_ms: int,
    key: bytes,
    *,
    impressions: bool = True,
    clicks: bool = True,
    event_ts: float | None = None,
) -> Invalid | None:
    """A dead letter when no replica vouches for the event: an impression whose signature is
    missing or wrong, a click or dwell without the click token of an impression served to that
    user and ad (`schemas.signing.check_event`; `impressions` / `clicks` turn either off).
    `event_ts` is `event.ts.timestamp()` when the caller has it already."""
    failed = check_event(event, key, impressions=impressions, clicks=clicks, ts=event_ts)
    if failed is None:
        return None
    reason, error = failed
    return dead_letter(physical_topic, partition, offset, value, ts_ms, error, reason)


def dead_letter(
    physical_topic: str, partition: int, offset: int, raw: bytes, ts_ms: int, error: str, reason: str
) -> Invalid:
    """The `Invalid` of a record: its DeadLetter (original bytes, truncated if huge) and reason."""
    dl = DeadLetter(
        event_id=dead_letter_id(physical_topic, partition, offset),
        ts=datetime.fromtimestamp(min(max(ts_ms, 0) / 1000, MAX_TS.timestamp() - 1), tz=UTC),
        source_topic=physical_topic[:249],
        partition=max(-1, partition),
        offset=max(-1, offset),
        **capped(raw, error),
    )
    return Invalid(dl, reason)


capped = dead_letter_fields  # the contract's rule, shared with the trainer's dead letters
