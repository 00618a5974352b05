"""The event collector's pure core: a `POST /v1/events` body in, a verdict per event out.

`judge_batch(body, limits, key)` reads a batch (`schemas.collect.EventBatch`), validates each
event by its `kind` against the contract and answers which events go to which topic and which
were refused (index, field, reason). Publishers may send impressions only as the replica signed
them (`Impression.sig`: served-side facts), and clicks and dwells only with the click token of
an impression served to that user and ad, exactly as the streams worker checks them
(`schemas.signing.check_event`). `TokenBucket` is the per-key rate limit with an injected clock.
No I/O here: the HTTP shell is `serving.collector_http`.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, cast

import msgspec
from pydantic import ValidationError

from schemas import codec
from schemas.collect import HTTP_KINDS, Reason, RejectedEvent
from schemas.events import Message
from schemas.signing import check_event

WHOLE: Final = "<event>"
_JSON: Final = msgspec.json.Encoder()
FORGED: Final = frozenset({"bad_signature", "bad_click_token"})


def printable(text: str) -> str:
    """`text` as valid UTF-8 (a lone surrogate a client sent, echoed in an answer, as `\\ud800`).

    >>> printable("u\\ud800")
    'u\\\\ud800'
    """
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class BatchRefused(Exception):
    """The body as a whole cannot be read as a batch (not JSON, no `events` list, too many)."""

    def __init__(self, status: int, field: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.field = printable(field)
        self.message = printable(message)


@dataclass(frozen=True)
class Limits:
    """What one batch may be (`settings.collector`)."""

    max_body_bytes: int
    max_events: int


@dataclass(frozen=True)
class Accepted:
    """A valid event: its index in the batch, contract topic (unprefixed), Kafka key and bytes."""

    index: int
    kind: str
    topic: str
    key: bytes
    value: bytes


@dataclass
class Verdict:
    """What `judge_batch` decided for each event of a batch."""

    accepted: list[Accepted] = field(default_factory=list)
    rejected: list[RejectedEvent] = field(default_factory=list)
    kinds: dict[int, str] = field(default_factory=dict)  # index → a known kind, for the counters

    @property
    def forged(self) -> list[RejectedEvent]:
        """Refused events whose signature or click token does not verify (counted apart)."""
        return [r for r in self.rejected if r.reason in FORGED]


class _Object(dict[str, Any]):
    """A JSON object that remembers the keys given more than once (the last one would win)."""

    dupes: list[str]


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON (numbers are finite)")


def _pairs(items: list[tuple[str, Any]]) -> _Object:
    obj = _Object(items)
    obj.dupes = []
    if len(obj) < len(items):  # rare: find which keys came twice
        seen: set[str] = set()
        for k, _ in items:
            if k in seen and k not in obj.dupes:
                obj.dupes.append(k)
            seen.add(k)
    return obj


def parse_batch(body: bytes, limits: Limits) -> list[Any]:
    """The raw events of a body `{"events": [...]}` (BatchRefused: 413 over the byte limit, 422
    when it is not UTF-8 JSON, not that object, or carries more than `max_events`)."""
    if len(body) > limits.max_body_bytes:
        raise BatchRefused(413, "body", f"request body over {limits.max_body_bytes} bytes")
    try:
        doc = json.loads(body, object_pairs_hook=_pairs, parse_constant=_not_json)
    except (ValueError, RecursionError) as exc:
        raise BatchRefused(422, "body", f"body is not UTF-8 JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BatchRefused(
            422, "body", f'body must be an object {{"events": [...]}}, got {type(doc).__name__}'
        )
    extra = sorted(set(doc) - {"events"})
    if extra:
        raise BatchRefused(422, extra[0], f"unknown field(s) {extra}: the body holds only `events`")
    if cast(_Object, doc).dupes:
        raise BatchRefused(422, "events", "key `events` given twice")
    events = doc.get("events")
    if not isinstance(events, list):
        raise BatchRefused(422, "events", f"field 'events' must be a list (got {type(events).__name__})")
    if len(events) > limits.max_events:
        raise BatchRefused(
            422, "events", f"field 'events' holds {len(events)} events; at most {limits.max_events} per batch"
        )
    return events


def judge_event(index: int, raw: Any, key: bytes) -> tuple[Message, str] | RejectedEvent:
    """The validated event and its kind, or why it is refused (index, field, reason, message)."""

    def refuse(where: str, reason: Reason, message: str) -> RejectedEvent:
        return RejectedEvent(index=index, field=printable(where), reason=reason, message=printable(message))

    if not isinstance(raw, dict):
        return refuse(WHOLE, "not_an_object", f"event must be a JSON object, got {type(raw).__name__}")
    if isinstance(raw, _Object) and raw.dupes:
        return refuse(raw.dupes[0], "duplicate_key", f"key {raw.dupes[0]!r} given twice in one event")
    kind = raw.get("kind")
    if kind is None:
        return refuse("kind", "missing_field", f"field 'kind' is required (one of {list(HTTP_KINDS)})")
    if not isinstance(kind, str) or kind not in codec.TOPIC_BY_KIND:
        return refuse("kind", "unknown_kind", f"field 'kind': unknown event kind {str(kind)[:64]!r}")
    if kind not in HTTP_KINDS:
        return refuse(
            "kind", "kind_not_accepted", f"field 'kind': {kind!r} events are not accepted over HTTP"
        )
    model = codec.MODEL_BY_TOPIC[codec.TOPIC_BY_KIND[kind]]
    try:  # JSON mode: the contract's strict types read ISO timestamps and base64 as on Kafka
        event = model.model_validate_json(_JSON.encode(raw))
    except UnicodeEncodeError:  # a lone surrogate (`"\\ud800"` is valid JSON, not valid text)
        return refuse(_surrogate_field(raw), "invalid", "text holds a lone UTF-16 surrogate: not UTF-8")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or WHOLE
        return refuse(where, cast(Reason, codec.error_reason(exc)), codec.describe_validation_error(exc))
    failed = check_event(event, key)
    if failed is not None:
        reason, message = failed
        return refuse("sig" if kind == "impression" else "click_token", cast(Reason, reason), message)
    return event, kind


def _surrogate_field(raw: dict[str, Any]) -> str:
    """The first field whose name or text cannot be UTF-8 (`WHOLE` when it is nested deeper)."""
    for name, value in raw.items():
        for text in (name, value):
            if isinstance(text, str):
                try:
                    text.encode()
                except UnicodeEncodeError:
                    return name
    return WHOLE


def judge_batch(body: bytes, limits: Limits, key: bytes) -> Verdict:
    """Every event of a batch judged (BatchRefused when the body as a whole is unreadable)."""
    return judge_events(parse_batch(body, limits), key)


def judge_events(events: list[Any], key: bytes) -> Verdict:
    """Every event of a parsed batch judged; an `event_id` given twice in one batch is refused
    the second time (the first one is kept)."""
    verdict = Verdict()
    seen: set[str] = set()
    for index, raw in enumerate(events):
        out = judge_event(index, raw, key)
        if isinstance(out, RejectedEvent):
            verdict.rejected.append(out)
            kind = raw.get("kind") if isinstance(raw, dict) else None
            if isinstance(kind, str) and kind in codec.TOPIC_BY_KIND:
                verdict.kinds[index] = kind
            continue
        event, kind = out
        verdict.kinds[index] = kind
        if event.event_id in seen:
            verdict.rejected.append(
                RejectedEvent(
                    index=index,
                    field="event_id",
                    reason="duplicate_event",
                    message=f"field 'event_id': {event.event_id!r} appears earlier in this batch",
                )
            )
            continue
        seen.add(event.event_id)
        topic = codec.TOPIC_BY_KIND[kind]
        verdict.accepted.append(Accepted(index, kind, topic, codec.key_of(event), codec.encode(event)))
    return verdict


class TokenBucket:
    """Per-key token buckets: `rate` tokens per second up to `burst`; one token per event.

    >>> t = [0.0]
    >>> b = TokenBucket(rate=2.0, burst=4, clock=lambda: t[0])
    >>> b.take("k", 4), b.take("k", 1)
    (0.0, 0.5)
    >>> t[0] = 0.5; b.take("k", 1)
    0.0
    """

    def __init__(self, rate: float, burst: int, clock: Callable[[], float], max_keys: int = 10_000) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key → (tokens, at)

    def _level(self, key: str) -> float:
        now = self.clock()
        tokens, at = self._buckets.get(key, (float(self.burst), now))
        return min(float(self.burst), tokens + max(0.0, now - at) * self.rate)

    def wait_s(self, key: str, n: int = 1) -> float:
        """Seconds until `n` events of `key` could pass (0: now), taking nothing."""
        need = min(n, self.burst) - self._level(key)
        return max(0.0, need / self.rate)

    def take(self, key: str, n: int) -> float:
        """Take `n` tokens (at most `burst`: a batch larger than the bucket passes once it is full)
        and answer 0, or take nothing and answer the seconds to wait."""
        wait = self.wait_s(key, n)
        if wait > 0:
            return wait
        self._buckets[key] = (self._level(key) - min(n, self.burst), self.clock())
        self._buckets.move_to_end(key)
        while len(self._buckets) > self.max_keys:  # the least recent key starts full again
            self._buckets.popitem(last=False)
        return 0.0


def retry_after(wait_s: float) -> str:
    """The Retry-After header (whole seconds, at least 1) for a wait.

    >>> retry_after(0.2), retry_after(3.01)
    ('1', '4')
    """
    return str(max(1, math.ceil(wait_s)))
