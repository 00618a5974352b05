"""The contract of `POST /v1/events` (the event collector): the batch a publisher sends and the
answer naming each refused event by index, field and reason (`serving.collector`)."""

from __future__ import annotations

from typing import Annotated, Final, Literal, TypeAlias

from pydantic import Field

from schemas.events import Click, Contract, Conversion, Dwell, Impression, Touch, View

# the kinds a publisher may send over HTTP; catalog, dead letters, training examples and adapter
# deltas are the platform's own records and only travel on Kafka
HTTP_KINDS: Final[tuple[str, ...]] = ("impression", "view", "click", "dwell", "conversion", "touch")

# what the collector validates, by `kind` (the OpenAPI request schema; the collector itself
# reads each event apart, so one bad event never hides the verdicts of the others)
AnyHttpEvent: TypeAlias = Annotated[
    Impression | View | Click | Dwell | Conversion | Touch, Field(discriminator="kind")
]

# low-cardinality reasons (also the `reason` label of the refusal counter)
Reason: TypeAlias = Literal[
    "bad_json",
    "not_an_object",
    "duplicate_key",
    "duplicate_event",
    "missing_field",
    "unknown_field",
    "unknown_kind",
    "kind_not_accepted",
    "wrong_type",
    "naive_timestamp",
    "out_of_range",
    "invalid",
    "unsigned",
    "bad_signature",
    "no_click_token",
    "bad_click_token",
]


class EventBatch(Contract):
    """A batch of events of any accepted kind (`kind` names each one's model)."""

    events: list[AnyHttpEvent]


class RejectedEvent(Contract):
    """One refused event of a batch: its 0-based index, the field at fault and why."""

    index: Annotated[int, Field(ge=0)]
    field: str  # dotted location inside the event (`kind`, `click_token`, `ts`); `<event>`: the whole
    reason: Reason
    message: str  # the contract's words, naming the value


class EventsResult(Contract):
    """The answer to a batch: how many events were produced (broker acknowledged, acks=all) and
    every refused one. 200: all accepted; 207: some refused, the rest produced; 422: none accepted."""

    accepted: Annotated[int, Field(ge=0)]
    rejected: list[RejectedEvent]
