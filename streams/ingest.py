"""Validation at the edge: raw Kafka bytes → contract event, or a DeadLetter with its reason."""

from __future__ import annotations

import copy
import hashlib
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from operator import itemgetter
from typing import Any, Final

from pydantic import ValidationError
from pydantic_core import SchemaValidator

from schemas.codec import decode, error_reason, model_for_topic
from schemas.errors import SchemaError
from schemas.events import (
    MAX_TS,
    MIN_TS,
    DeadLetter,
    Message,
    _fits_bytes,
    _in_range,
    _not_a_number,
    dead_letter_fields,
    ids_fit,
)
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
    """The record's contract event, or an `Invalid` carrying its dead letter."""
    model = model_for_topic(base_topic)
    raw = value or b""
    try:
        if value is None:
            raise SchemaError("message has no value (tombstone)")
        return decode(model, raw)
    except SchemaError as exc:
        reason = "empty" if value is None else reason_of(exc)
        return dead_letter(physical_topic, partition, offset, raw, ts_ms, str(exc) or reason, reason)


# `"ts": "` and a four-digit year's dash: text, never a number (see FastDecoder)
_TS_TEXT = re.compile(rb'"ts"\s*:\s*"[0-9]{4}-')
_new = object.__new__
# `_in_range` as epoch seconds: whole seconds, each exact in a float
_MIN_S: Final = MIN_TS.timestamp()
_MAX_S: Final = MAX_TS.timestamp()
_PRINTABLE_ASCII: Final = bytes(range(0x20, 0x7F))
_setattr = object.__setattr__


class FastDecoder:
    """A contract model's validation without its per-field Python validators, whose rules are
    checked once per record afterwards; `decode` gives the model's event, or None where the
    contract's own `decode` must decide (anything it would refuse, and anything unusual).

    The model's core schema is copied with its Python validators taken out: `_fits_bytes` of the
    ids (their length limits stay in the schema) and `_not_a_number` / `_in_range` of `ts` (the
    strict datetime schema stays). Afterwards, for the whole record: every id printable and at
    most 255 UTF-8 bytes (the `_fits_bytes` rule), `ts` in range (`_in_range` itself), and `ts`
    given as text starting with a four-digit year and a dash (`_not_a_number` refuses numeric
    text, which the datetime schema would read as unix seconds; no number looks like that). The
    text is found in the raw bytes, which is exact only without escapes or a second `"ts"`: a
    record with a backslash or another `"ts"` anywhere goes to the contract's path. So a record
    `decode` accepts is one the contract accepts, with the same event (tests compare both on
    valid and hostile records); a record failing anything is given to the contract's path, which
    dead-letters it with its reason. Python validators called from the schema cost more than
    the rest of validation: this is about half the cost of `model_validate_json`.

    The checks afterwards are the cheap forms of the same rules: `ts` is compared as epoch
    seconds (exact at these bounds: whole seconds, and a float keeps far below a microsecond
    of a time before 2106), and a record whose every byte is printable ASCII (no escapes: no
    backslash) has only printable ids of at most 128 bytes (the schema's longest id), which
    `_fits_bytes` accepts, so `ids_fit` runs only on records with other bytes.
    """

    def __init__(self, model: type[Message]) -> None:
        self.model = model
        self.ids: list[str] = []
        self.times: list[str] = []
        schema = copy.deepcopy(model.__pydantic_core_schema__)
        if schema.get("type") != "model" or schema["schema"].get("type") != "model-fields":
            raise TypeError(f"{model.__name__}: not a plain model schema")
        for name, field in schema["schema"]["fields"].items():
            field["schema"] = self._strip(field["schema"], name)
        if self.times != ["ts"]:
            raise TypeError(f"{model.__name__}: timestamps {self.times}, the fast path knows `ts` only")
        # the fields alone: a model schema of a built model class would reuse its own validator
        self.validator = SchemaValidator(schema["schema"], schema.get("config"))
        if len(self.ids) < 2:
            raise TypeError(f"{model.__name__}: fewer than two ids")
        self._ids: Callable[[dict[str, Any]], Any] = itemgetter(*self.ids)  # a tuple of them
        fields = schema["schema"]["fields"]
        self._nullable = any(fields[name]["schema"].get("type") == "default" for name in self.ids)

    def _strip(self, node: Any, name: str) -> Any:
        kind = node.get("type")
        if kind in ("function-after", "function-before"):
            fn = node.get("function", {}).get("function")
            if fn is _fits_bytes:
                self.ids.append(name)
                return self._strip(node["schema"], name)
            if fn in (_not_a_number, _in_range):
                if name not in self.times:
                    self.times.append(name)
                return self._strip(node["schema"], name)
            raise TypeError(f"{self.model.__name__}.{name}: a validator the fast path does not know: {fn}")
        if isinstance(node.get("schema"), dict):
            node = {**node, "schema": self._strip(node["schema"], name)}
        return node

    def decode(self, value: bytes | None) -> Message | None:
        """The record's event when it is valid and plain; None: ask the contract's `decode`."""
        got = self.decode_ts(value)
        return None if got is None else got[0]

    def decode_ts(self, value: bytes | None) -> tuple[Message, float] | None:
        """`decode`, with the event's time in epoch seconds (`event.ts.timestamp()`)."""
        if value is None or b"\\" in value or value.count(b'"ts"') != 1 or _TS_TEXT.search(value) is None:
            return None
        try:
            fields, _, fields_set = self.validator.validate_json(value)
        except ValueError:  # ValidationError; invalid UTF-8
            return None
        ts: float = fields["ts"].timestamp()
        if not _MIN_S <= ts < _MAX_S:  # `_in_range`
            return None
        if value.translate(None, _PRINTABLE_ASCII):  # other bytes than printable ASCII: `_fits_bytes`
            ids: Sequence[str] = self._ids(fields)
            if self._nullable:
                ids = [v for v in ids if v is not None]
            if not ids_fit(ids):
                return None
        event = _new(self.model)  # as the model's own validator makes it
        _setattr(event, "__dict__", fields)
        _setattr(event, "__pydantic_fields_set__", fields_set)
        _setattr(event, "__pydantic_extra__", None)
        _setattr(event, "__pydantic_private__", None)
        return event, ts


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
