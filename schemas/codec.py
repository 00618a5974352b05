"""Encoding and validation of contract messages at the edge: bytes in, model or SchemaError out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import msgspec
from pydantic import BaseModel, ValidationError

from schemas import topics
from schemas.errors import SchemaError
from schemas.events import (
    MAX_FEATURE,
    AdapterDelta,
    AdCreative,
    Campaign,
    Click,
    Conversion,
    DeadLetter,
    Dwell,
    Impression,
    Message,
    Touch,
    TrainingExample,
    View,
)

MODEL_BY_TOPIC: Final[dict[str, type[Message]]] = {
    topics.IMPRESSIONS: Impression,
    topics.CLICKS: Click,
    topics.DWELL: Dwell,
    topics.CONVERSIONS: Conversion,
    topics.TOUCHES: Touch,
    topics.VIEWS: View,
    topics.CATALOG: AdCreative,
    topics.CAMPAIGNS: Campaign,
    topics.DLQ: DeadLetter,
    topics.TRAINING_EXAMPLES: TrainingExample,
    topics.ADAPTER_DELTAS: AdapterDelta,
}

TOPIC_BY_KIND: Final[dict[str, str]] = {
    str(model.model_fields["kind"].default): topic for topic, model in MODEL_BY_TOPIC.items()
}


def describe_validation_error(exc: ValidationError, limit: int = 5) -> str:
    """One line naming each failing field, the problem and the offending value."""
    parts = []
    for err in exc.errors()[:limit]:
        loc = ".".join(str(p) for p in err["loc"]) or "<message>"
        value = err.get("input")
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        parts.append(f"field '{loc}': {err['msg']} (got {shown})")
    more = len(exc.errors()) - limit
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)


def error_reason(exc: ValidationError) -> str:
    """A short, low-cardinality reason code for metrics (never a value or an id)."""
    first = exc.errors()[0]
    kind = str(first["type"])
    if kind in ("json_invalid", "json_type"):
        return "bad_json"
    if kind == "extra_forbidden":
        return "unknown_field"
    if kind == "missing":
        return "missing_field"
    if kind.endswith("_type") or kind.endswith("_parsing") or kind == "literal_error":
        return "wrong_type"
    if kind in ("timezone_aware", "datetime_from_date_parsing"):
        return "naive_timestamp"
    if kind.startswith(("greater", "less", "string_too", "too_", "finite")):
        return "out_of_range"
    return "invalid"


def model_for_topic(topic: str, prefix: str = "") -> type[Message]:
    """The contract model of a (possibly prefixed) topic name."""
    base = topic[len(prefix) :] if prefix and topic.startswith(prefix) else topic
    try:
        return MODEL_BY_TOPIC[base]
    except KeyError:
        known = ", ".join(sorted(MODEL_BY_TOPIC))
        raise SchemaError(f"topic {topic!r} is not a contract topic (known: {known})") from None


def decode(model: type[Message], data: bytes | str) -> Message:
    """Validate one JSON message against `model`; raise SchemaError naming the field on failure."""
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        raise SchemaError(describe_validation_error(exc)) from exc
    except UnicodeDecodeError as exc:
        raise SchemaError(f"message is not UTF-8 JSON: {exc}") from exc


def decode_any(data: bytes | str) -> Message:
    """Validate a JSON message whose `kind` field names its model (mixed event files)."""
    import json

    try:
        obj: Any = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SchemaError(f"line is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str):
        raise SchemaError("field 'kind': required to tell the event type of a mixed stream")
    topic = TOPIC_BY_KIND.get(obj["kind"])
    if topic is None:
        raise SchemaError(f"field 'kind': unknown event kind {obj['kind']!r}")
    return decode(MODEL_BY_TOPIC[topic], data)


def topic_of(msg: BaseModel) -> str:
    """The contract topic a message belongs on."""
    for topic, model in MODEL_BY_TOPIC.items():
        if type(msg) is model:
            return topic
    raise SchemaError(f"{type(msg).__name__} is not a contract message")


def key_of(msg: Message) -> bytes:
    """The Kafka key the contract prescribes for a message (user, ad or adapter id)."""
    spec = topics.TOPICS_BY_NAME[topic_of(msg)]
    value = getattr(msg, spec.key, None)
    if value is None:
        value = msg.event_id
    return str(value).encode()


def encode(msg: BaseModel) -> bytes:
    """UTF-8 JSON bytes of a message, as it travels on Kafka."""
    return msg.model_dump_json().encode()


def encoder(model: type[BaseModel]) -> Callable[[BaseModel], bytes]:
    """`encode` for messages of exactly `model`, in one call of its serializer (the same bytes,
    without `model_dump_json`'s str and its encoding: for a worker encoding thousands at once)."""
    to_json: Callable[[BaseModel], bytes] = model.__pydantic_serializer__.to_json
    return to_json


_JSON: Final = msgspec.json.Encoder()
# msgspec and pydantic write a float the same way (shortest round-trip text) below 1e16; from
# there pydantic writes `1e+16`, msgspec `1e16`. Every float of a TrainingExample is within
# ±MAX_FEATURE (features, the vector) or [0, 1] (the served pCTR) by the contract.
assert MAX_FEATURE < 1e16


def example_json(example: TrainingExample) -> bytes:
    """`encode(example)`: the same bytes (tests hold it, at the bounds too) at half the cost, for
    a worker encoding one example per impression (fields in declaration order, as pydantic)."""
    out: bytes = _JSON.encode(example.__dict__)
    return out
