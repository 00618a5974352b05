"""Pydantic v2 models of every message on the wire contract (see docs/DESIGN.md, "Wire contract")."""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Final, Literal, TypeAlias

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    StringConstraints,
    TypeAdapter,
    field_validator,
    model_validator,
)

# A slot is a surface where ads are shown (a feed, search results, a splash screen, a sidebar):
# a bounded identifier (a lowercase letter, then up to 31 lowercase letters, digits, `_` or `-`).
# Which slots exist is configuration (`slots.names`); serving refuses a request naming another.
SLOT_PATTERN: Final = r"^[a-z][a-z0-9_-]{0,31}$"
Slot: TypeAlias = Annotated[str, StringConstraints(min_length=1, max_length=32, pattern=SLOT_PATTERN)]
# the default slots (`slots.names`), in the order of the models' fixed slot indices 0, 1, 2
# (`trainers.models.features.slot_index`): other slots hash into extra rows
SLOTS: Final[tuple[str, ...]] = ("feed", "search", "splash")
# how a campaign pays: per shown impression ("cpm") or per click ("cpc"); `schemas.billing`
BidType: TypeAlias = Literal["cpm", "cpc"]
BID_TYPES: Final[tuple[BidType, ...]] = ("cpm", "cpc")
# where a slot's ads are rendered: by the client (shown on its render beacon) or by the server
Render: TypeAlias = Literal["client", "server"]
# the A/B arms of live learning (`serving.arms`, settings group `ab`)
AB_ARMS: Final = ("learning", "correction", "control")
AbArm: TypeAlias = Literal["learning", "correction", "control"]

MAX_ID_BYTES: Final = 255
# Timestamps must fit the stores downstream (ClickHouse DateTime: 1970-01-01 … 2106-02-07 UTC).
MIN_TS: Final = datetime(1970, 1, 1, tzinfo=UTC)
MAX_TS: Final = datetime(2106, 1, 1, tzinfo=UTC)


def _fits_bytes(value: str) -> str:
    """Ids travel in binary records with a one-byte length: at most 255 UTF-8 bytes; and they
    reach logs, Redis keys and dashboards, so control, format (bidi, zero-width) and separator
    characters are refused (`str.isprintable`: NUL, newlines, ANSI escapes, U+202E …)."""
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise ValueError(f"contains the non-printable character U+{ord(bad):04X}; ids must be printable text")
    if len(value) * 4 <= MAX_ID_BYTES:  # no UTF-8 character takes more than 4 bytes: skip encoding
        return value
    size = len(value.encode("utf-8"))
    if size > MAX_ID_BYTES:
        raise ValueError(f"is {size} UTF-8 bytes long; at most {MAX_ID_BYTES} are allowed")
    return value


def ids_fit(ids: Sequence[str]) -> bool:
    """`_fits_bytes` for a record's ids at once, as the fast decoders check them (one join, one
    `isprintable`; UTF-8 sizes only when an id could be too long).

    >>> ids_fit(["u1", "ad-7"]), ids_fit(["u1", "a\\u202eb"]), ids_fit(["é" * 200])
    (True, False, False)
    """
    return "".join(ids).isprintable() and (
        max(map(len, ids), default=0) * 4 <= MAX_ID_BYTES or max(len(v.encode()) for v in ids) <= MAX_ID_BYTES
    )


def _in_range(value: datetime) -> datetime:
    if not MIN_TS <= value < MAX_TS:
        raise ValueError(f"must lie between {MIN_TS.date()} and {MAX_TS.date()} (UTC)")
    return value


EventId = Annotated[str, StringConstraints(min_length=1, max_length=64), AfterValidator(_fits_bytes)]
UserId = Annotated[str, StringConstraints(min_length=1, max_length=128), AfterValidator(_fits_bytes)]
Ident = Annotated[str, StringConstraints(min_length=1, max_length=64), AfterValidator(_fits_bytes)]
_DATETIME_TEXT: Final = TypeAdapter(datetime)


def _not_a_number(value: object) -> object:
    """JSON timestamps are ISO 8601 text; pydantic would read `"1700000000"` as unix seconds."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:  # text, not a number: parse it here (strict mode takes only datetimes next)
            return _DATETIME_TEXT.validate_python(value, strict=False)
        raise ValueError(f"{value[:32]!r} is a number; timestamps are ISO 8601 text with an offset")
    return value


Timestamp = Annotated[AwareDatetime, BeforeValidator(_not_a_number), AfterValidator(_in_range)]
# Free text (ad titles) of any script, but it reaches ClickHouse, dashboards and logs: control
# characters (C0, DEL, C1: NUL, newlines, tabs, ANSI escapes) and bidi embeddings, overrides and
# isolates (U+202A–U+202E, U+2066–U+2069: "Trojan Source") are refused. A pattern, not a Python
# validator, so the streams fast path keeps it (`schemas.decode.BatchDecoder`).
TEXT_PATTERN: Final = r"^[^\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]*$"
Text = Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=TEXT_PATTERN)]
Version = Annotated[str, StringConstraints(min_length=1, max_length=64)]
Signature = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]  # HMAC-SHA256, hex
ClickToken = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{22}$")]  # 16 bytes, base64url
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
# Money (prices, bids, budgets, conversion values): sums of many stay finite and exact enough.
MAX_MONEY: Final = 1e12
Money = Annotated[float, Field(ge=0, le=MAX_MONEY, allow_inf_nan=False)]
# Model inputs are float32 on the trainer and in serving: a value finite in float64 but not in
# float32 (1e39) would become inf there; bounded to a range far inside float32 and the features'.
MAX_FEATURE: Final = 1e6
Feature = Annotated[float, Field(ge=-MAX_FEATURE, le=MAX_FEATURE, allow_inf_nan=False)]
# How well a request's query names an ad: the cosine of their hashed bags of words
# (`schemas.vectors.text_vector`; signed hashing, so a collision can make it negative)
QueryMatch = Annotated[float, Field(ge=-1, le=1, allow_inf_nan=False)]


def _from_base64(value: object) -> object:
    """JSON carries bytes as standard (RFC 4648 §4) base64 text; Python callers may pass bytes."""
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"not valid standard base64 ({exc})") from exc
    return value


B64Bytes = Annotated[
    bytes,
    BeforeValidator(_from_base64),
    PlainSerializer(lambda b: base64.b64encode(b).decode("ascii"), return_type=str, when_used="json"),
    Field(json_schema_extra={"contentEncoding": "base64"}),
]

MAX_DWELL_MS: Final = 3_600_000
MAX_VECTOR_DIM: Final = 1024
# a delta travels as base64 in one Kafka message: 765 KiB → 1,020 KiB, with its other fields still
# under a producer's 1 MiB request limit (a rank-8 snapshot of cross+deep+head+wide is ~710 KiB)
MAX_DELTA_BYTES: Final = 765 * 1024
MAX_SEQ: Final = 2**53 - 1  # an adapter's delta seq: ~285 years at a million deltas a second
# The original bytes a dead letter keeps (a longer record keeps this prefix, its size and sha256):
# base64 (×4/3) plus the other fields stay far below a producer's 1 MiB request limit.
MAX_RAW_BYTES: Final = 256 * 1024


class Contract(BaseModel):
    """Base of all contract models: strict types, unknown fields rejected, immutable."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
    )


class Message(Contract):
    """Anything with an id and an aware timestamp."""

    event_id: EventId
    ts: Timestamp


class UserEvent(Message):
    """A user-facing event, keyed by `user_id` on Kafka."""

    user_id: UserId


class Impression(UserEvent):
    """An ad was shown: what was served, where, at what price, by which model and adapter."""

    kind: Literal["impression"] = "impression"
    request_id: Ident
    ad_id: Ident
    campaign_id: Ident
    advertiser_id: Ident
    slot: Slot
    position: Annotated[int, Field(ge=0, le=10_000)]
    # the auction's generalized second price in the campaign's bid unit (`bid_type`): per click
    # for "cpc" (billed at the first click), per thousand shown impressions for "cpm" (billed
    # price / 1000 when shown); `schemas.billing`
    price: Money
    pctr: Probability | None = None
    model_version: Version | None = None
    adapter_version: Version | None = None
    # the creative variant shown (`AdCreative.variants`, chosen by `serving.variants`) and the
    # probability it was chosen with, for off-policy evaluation of another selection policy
    variant_id: Ident | None = None
    variant_propensity: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    # the A/B arm of the user (`serving.arms`): "learning" (adapters + the per-user correction),
    # "correction" (the correction, no adapters) or "control" (the frozen base model alone)
    ab_arm: AbArm | None = None
    # the probability with which the serving policy put this ad at this position (exploration,
    # `serving.explore`), and whether exploration chose it over the greedy ad: what off-policy
    # evaluation of another ranker or policy needs (`attribution.ope`)
    propensity: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    explored: bool | None = None
    # how the campaign pays (`Campaign.bid_type`: "cpm" on shown impressions, "cpc" on clicks)
    # and how the slot renders: "client" ads become impressions when their render beacon (`View`)
    # arrives, "server" ads are shown when served (`serving.shown_on_serve`). None (impressions
    # from before these fields, or other producers): counted as shown, never billed
    bid_type: BidType | None = None
    render: Render | None = None
    # how well the request's `query` names this ad (`serving.text.text_match`: the cosine of their
    # bags of words), what the ranker's query columns read (`trainers.models.features`): logged
    # so that training featurizes the value serving ranked with, not one recomputed later from a
    # title that may have changed. None: the request carried no query (or serving keeps no ad
    # text, `recall.text_dim` 0)
    query_match: QueryMatch | None = None
    # the serving replica's HMAC over the other fields (`schemas.signing`); the streams worker
    # dead-letters impressions without a valid one (`streams.verify_impressions`)
    sig: Signature | None = None


class Click(UserEvent):
    """A click on a served impression."""

    kind: Literal["click"] = "click"
    impression_id: EventId
    ad_id: Ident
    campaign_id: Ident
    # the `ServedAd.click_token` of the impression, echoed (`schemas.signing.click_token`)
    click_token: ClickToken | None = None


class View(UserEvent):
    """The render beacon of a served ad: it was in view on the user's screen (the web snippet
    sends it once the ad was half visible for a second). It turns the served impression into a
    shown one, which CPM campaigns pay for and attribution counts as a view; the streams worker
    takes the first view of each served impression inside the attribution window, and only with
    the served ad's token (a view of an ad never served cannot carry one)."""

    kind: Literal["view"] = "view"
    impression_id: EventId
    ad_id: Ident
    click_token: ClickToken | None = None  # the served ad's token, as `Click.click_token`


class Dwell(UserEvent):
    """Time the user spent on the landing page of a clicked or viewed impression."""

    kind: Literal["dwell"] = "dwell"
    impression_id: EventId
    ad_id: Ident
    dwell_ms: Annotated[int, Field(ge=0, le=MAX_DWELL_MS)]
    click_token: ClickToken | None = None  # as `Click.click_token`


class Conversion(UserEvent):
    """A purchase or other advertiser goal, with its value; `ad_id` when the advertiser knows it."""

    kind: Literal["conversion"] = "conversion"
    campaign_id: Ident
    advertiser_id: Ident
    value: Money
    ad_id: Ident | None = None


class Touch(UserEvent):
    """A touchpoint on a channel outside adstream (another search engine, social, email, an
    affiliate), named UTM-style by source / medium / campaign, for cross-channel attribution;
    `cost` when the advertiser knows what this touch cost (daily spend is imported apart)."""

    kind: Literal["touch"] = "touch"
    advertiser_id: Ident
    source: Ident  # utm_source: google, newsletter, partner-x
    medium: Ident  # utm_medium: cpc, email, social, affiliate
    campaign: Ident | None = None  # utm_campaign
    interaction: Literal["click", "view"] = "click"  # a visit from a link, or an ad seen elsewhere
    cost: Money | None = None


# A creative's assembled variants (`creatives`): parts of each, what each part may say, and how
# many an ad may carry (a catalog message stays far below a producer's 1 MiB request limit).
MAX_VARIANTS: Final = 64
VariantText = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=TEXT_PATTERN)]
# the slots a tone file's templates may name (`creatives.tone`); a variant's `emphasis` is the
# first one its headline template fills (what the simulator's segments respond to)
CREATIVE_SLOTS: Final[tuple[str, ...]] = ("name", "benefit", "feature", "price", "promotion", "cta")
CreativeSlot: TypeAlias = Literal["name", "benefit", "feature", "price", "promotion", "cta"]


class CreativeVariant(Contract):
    """One assembled version of an ad's creative (headline × body × call to action), with the
    disclosure it must carry; `variant_id` is stable while the tone file's templates keep their order."""

    variant_id: Ident
    locale: Annotated[str, StringConstraints(pattern=r"^[a-z]{2}(-[A-Z]{2})?$")]
    headline: VariantText
    body: VariantText
    cta: VariantText
    disclosure: VariantText
    emphasis: CreativeSlot | None = None


class AdCreative(Message):
    """A catalog entry (keyed by `ad_id`): a creative of a campaign, its bid and daily budget."""

    kind: Literal["ad"] = "ad"
    ad_id: Ident
    campaign_id: Ident
    advertiser_id: Ident
    category: Ident
    title: Text
    # per click for a CPC campaign, per thousand shown impressions for a CPM one (`Campaign.bid_type`)
    bid: Annotated[float, Field(gt=0, le=MAX_MONEY, allow_inf_nan=False)]
    daily_budget: Annotated[float, Field(gt=0, le=MAX_MONEY, allow_inf_nan=False)]
    active: bool
    # assembled variants (`adstream creatives build`); empty: the ad is shown with its `title`
    # (their ids are unique per ad by construction, `creatives.assemble`; a plain field, so the
    # streams fast path validates it as the contract does)
    variants: Annotated[tuple[CreativeVariant, ...], Field(max_length=MAX_VARIANTS)] = ()


# Audience targeting (`Campaign.targeting`, `AdRequest.geo` / `device`): ISO 3166-1 alpha-2
# country codes and the device classes publishers report.
CountryCode = Annotated[str, StringConstraints(pattern=r"^[A-Z]{2}$")]
Device: TypeAlias = Literal["mobile", "desktop", "tablet", "tv"]
DEVICES: Final[tuple[Device, ...]] = ("mobile", "desktop", "tablet", "tv")
MAX_TARGETS: Final = 256


def _distinct_values(values: tuple[str, ...]) -> tuple[str, ...]:
    if len(set(values)) != len(values):
        dupe = next(v for i, v in enumerate(values) if v in values[:i])
        raise ValueError(f"lists {dupe!r} twice")
    return values


_DISTINCT: Final = AfterValidator(_distinct_values)


class Targeting(Contract):
    """Who a campaign's ads may be shown to. Each list narrows the audience; an empty list
    targets everyone on that dimension. A request that does not say its geo or device is not
    shown campaigns that target one (the publisher did not say the user is in the audience).
    `interests` are category names matched against the request's declared interests."""

    geo: Annotated[tuple[CountryCode, ...], Field(max_length=MAX_TARGETS), _DISTINCT] = ()
    devices: Annotated[tuple[Device, ...], Field(max_length=len(DEVICES)), _DISTINCT] = ()
    interests: Annotated[tuple[Ident, ...], Field(max_length=MAX_TARGETS), _DISTINCT] = ()


class Campaign(Message):
    """A campaign (keyed by `campaign_id` on `ad.campaigns`): its daily budget, schedule and
    targeting. Its creatives (`AdCreative.campaign_id`) share the budget, which serving paces per
    campaign; once a campaign has this entry, its creatives' own `daily_budget` is not used
    (without one, the last creative's `daily_budget` stands for the campaign's, as before)."""

    kind: Literal["campaign"] = "campaign"
    campaign_id: Ident
    advertiser_id: Ident
    daily_budget: Annotated[float, Field(gt=0, le=MAX_MONEY, allow_inf_nan=False)]
    # the schedule: served from `start` (inclusive) until `end` (exclusive); None: open-ended
    start: Timestamp | None = None
    end: Timestamp | None = None
    targeting: Targeting = Targeting()
    active: bool = True
    # what the campaign pays for (`schemas.billing`), and so the unit of its creatives' `bid`:
    # "cpc" each first click on a served ad (bid and second price per click), "cpm" each shown
    # impression (bid and second price per thousand shown: an impression costs price / 1000);
    # the auction ranks a CPC ad by pCTR × bid, a CPM ad by bid / 1000 (`serving.rerank`);
    # spend and pacing count only these billable events
    bid_type: BidType = "cpc"

    @model_validator(mode="after")
    def _schedule_in_order(self) -> Campaign:
        if self.start is not None and self.end is not None and self.end <= self.start:
            raise ValueError(f"end ({self.end.isoformat()}) must come after start ({self.start.isoformat()})")
        return self


class DeadLetter(Message):
    """A message that failed validation, with where it came from, why, and its original bytes."""

    kind: Literal["dead_letter"] = "dead_letter"
    source_topic: Annotated[str, StringConstraints(min_length=1, max_length=249)]
    partition: Annotated[int, Field(ge=-1)]
    offset: Annotated[int, Field(ge=-1)]
    error: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    raw: Annotated[B64Bytes, Field(max_length=MAX_RAW_BYTES)]
    # the original record's size and sha256 (hex) when `raw` holds only its first MAX_RAW_BYTES
    raw_size: Annotated[int, Field(ge=0)] | None = None
    raw_sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = None


def dead_letter_fields(raw: bytes, error: str) -> dict[str, Any]:
    """`raw`, `error` (and, for a long record, `raw_size`, `raw_sha256`) of a DeadLetter that
    always fits a producer request: a record longer than MAX_RAW_BYTES keeps its prefix."""
    fields: dict[str, Any] = {"raw": raw}
    if len(raw) > MAX_RAW_BYTES:
        note = f" (original {len(raw)} bytes truncated to {MAX_RAW_BYTES}; see raw_size, raw_sha256)"
        error = error[: 4096 - len(note)] + note
        fields.update(raw=raw[:MAX_RAW_BYTES], raw_size=len(raw), raw_sha256=hashlib.sha256(raw).hexdigest())
    fields["error"] = error[:4096] or "invalid"
    return fields


def _check_finite(values: list[float], field: str) -> list[float]:
    for i, v in enumerate(values):
        if not math.isfinite(v):
            raise ValueError(f"{field}[{i}] is {v!r}; every component must be finite")
        if not -MAX_FEATURE <= v <= MAX_FEATURE:
            raise ValueError(f"{field}[{i}] is {v!r}; every component must lie within ±{MAX_FEATURE:g}")
    return values


class TrainingExample(Message):
    """One labelled impression (keyed by `adapter_id`): ranker features plus click/dwell labels."""

    kind: Literal["training_example"] = "training_example"
    adapter_id: Ident
    impression_id: EventId
    impression_ts: Timestamp
    user_id: UserId
    ad_id: Ident
    campaign_id: Ident
    advertiser_id: Ident
    category: Ident
    slot: Slot
    position: Annotated[int, Field(ge=0, le=10_000)]
    hour: Annotated[int, Field(ge=0, le=23)]
    user_vector: Annotated[list[float], Field(max_length=MAX_VECTOR_DIM)]
    intent_score: Feature
    recall_score: Feature | None = None
    # the impression's `query_match` (None: no query), as served: the ranker's query columns
    query_match: QueryMatch | None = None
    served_pctr: Probability | None = None
    model_version: Version | None = None
    adapter_version: Version | None = None
    click: bool
    dwell_ms: Annotated[int, Field(ge=0, le=MAX_DWELL_MS)] = 0
    # delayed feedback (settings.online.label_mode): "final" = the labels after the attribution window
    # closed (or at the click); the fake-negative modes emit "fake_negative" at the impression
    # (click False), "click" when its click arrives (a positive duplicate) and "dwell" when a
    # dwell arrives (a label update the click model does not learn from)
    label_kind: Literal["final", "fake_negative", "click", "dwell"] = "final"
    # the creative variant the impression showed and the probability it was chosen with
    # (`Impression.variant_id`, `.variant_propensity`): what teaches serving's variant bandit
    variant_id: Ident | None = None
    variant_propensity: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None

    @field_validator("user_vector")
    @classmethod
    def _finite_vector(cls, v: list[float]) -> list[float]:
        return _check_finite(v, "user_vector")


class AdapterDelta(Message):
    """A sparse LoRA weight delta (or full snapshot) for one adapter, as a safetensors payload."""

    kind: Literal["adapter_delta"] = "adapter_delta"
    adapter_id: Ident
    base_version: Version
    # bounded: a JSON-safe integer keeps `seq-N` versions short and a forged 2**62 out
    seq: Annotated[int, Field(ge=0, le=MAX_SEQ)]
    rank: Annotated[int, Field(ge=1, le=256)]
    payload: Annotated[B64Bytes, Field(min_length=1, max_length=MAX_DELTA_BYTES)]
    norm: NonNegFloat
    created_at: Timestamp
    snapshot: bool = False
    # the seq lineage (`schemas.delta.new_epoch`: start time in ms << 11 | 11 random bits), made
    # when Redis holds no seq record of the adapter; seqs order messages within one epoch, and a
    # later epoch supersedes an earlier one. None: the legacy lineage (before epochs), the earliest
    epoch: Annotated[int, Field(ge=1, le=MAX_SEQ)] | None = None
    # HMAC-SHA256 (hex) by the trainer over what the delta changes (`schemas.delta.delta_mac`);
    # replicas with a signing key apply only deltas whose signature checks out
    signature: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = None
    # freshness: per partition of ad.training-examples, the last offset learned into the adapter
    # when this delta was made (an example at (p, o) is in it when o <= learned_offsets[p])
    learned_offsets: (
        Annotated[
            dict[Annotated[int, Field(ge=0, le=1_000_000)], Annotated[int, Field(ge=-1)]],
            Field(max_length=4096),
        ]
        | None
    ) = None


EVENT_MODELS: Final[dict[str, type[Message]]] = {
    "Impression": Impression,
    "Click": Click,
    "Dwell": Dwell,
    "View": View,
    "Conversion": Conversion,
    "Touch": Touch,
    "AdCreative": AdCreative,
    "Campaign": Campaign,
    "DeadLetter": DeadLetter,
    "TrainingExample": TrainingExample,
    "AdapterDelta": AdapterDelta,
}


def event_time(msg: Message) -> datetime:
    """The event time of any contract message."""
    return msg.ts
