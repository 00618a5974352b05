"""Models of the HTTP API served by the serving ingress (see docs/DESIGN.md, "HTTP API")."""

from __future__ import annotations

from typing import Annotated, Literal, TypeAlias

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

from schemas.events import (
    TEXT_PATTERN,
    ClickToken,
    Contract,
    CountryCode,
    Device,
    Ident,
    NonNegFloat,
    Probability,
    Slot,
    UserId,
    Version,
)

MAX_INTERESTS = 8  # declared interests per request: a sign-up form's few picks, not a profile
MAX_QUERY_CHARS = 256  # a search box's query, not a document


def _integral(value: object) -> object:
    """JSON Schema's `integer` includes `61.0`: accept integral floats as ints (not bools, not 61.5)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# context numbers: finite floats, ints a float64 holds exactly (no 4,000-digit ints to parse or log)
ContextValue: TypeAlias = (
    Annotated[str, StringConstraints(max_length=256)]
    | bool
    | Annotated[int, Field(ge=-(2**53), le=2**53)]
    | Annotated[float, Field(ge=-(2**53), le=2**53, allow_inf_nan=False)]
)
Rung: TypeAlias = Literal["adapter", "base_model", "recall_score", "popular"]
# QoS classes, top first: under overload a replica sheds BestEffort first, then Burstable
QosClass: TypeAlias = Literal["guaranteed", "burstable", "besteffort"]


def _distinct(names: list[str]) -> list[str]:
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"lists a category more than once: {twice}")
    return names


# category names (`AdCreative.category`) the user declared; names the catalog does not hold are
# ignored by serving and counted, not refused: the catalog's categories change while clients
# keep sending what their users picked (OpenRTB bidders ignore unknown taxonomy values likewise)
Interests: TypeAlias = Annotated[list[Ident], Field(max_length=MAX_INTERESTS), AfterValidator(_distinct)]


class AdRequest(Contract):
    """A request for ranked ads for one user in one slot."""

    user_id: UserId
    slot: Slot
    k: Annotated[int, BeforeValidator(_integral), Field(ge=1, le=100)] = 10
    context: (
        Annotated[dict[Annotated[str, StringConstraints(max_length=64)], ContextValue], Field(max_length=32)]
        | None
    ) = None
    deadline_ms: Annotated[int, BeforeValidator(_integral), Field(ge=1, le=10_000)] | None = None
    # the request's QoS class; None: the slot's default (`qos.slot_class`)
    qos: QosClass | None = None
    # a preview (tools, monitors, freshness probes): ranked and answered as usual, but no
    # impression is logged, nothing is spent or frequency-capped, the canary's windows skip it
    preview: bool = False
    # declared interests (category names, e.g. picked at sign-up): a user with no state yet is
    # ranked as if they had clicked once in each; the prior gives way as the user's own evidence
    # accrues (`serving.interests`)
    interests: Interests | None = None
    # the audience, for campaign targeting (`Campaign.targeting`): the user's country (ISO 3166-1
    # alpha-2) and device class; a campaign that targets either is not shown when it is not said
    geo: CountryCode | None = None
    device: Device | None = None
    # the user's search text (meaningful for a search slot): recall adds each ad's match of its
    # words to the query vector's score (`serving.text`), so ads naming them are recalled first
    query: (
        Annotated[str, StringConstraints(min_length=1, max_length=MAX_QUERY_CHARS, pattern=TEXT_PATTERN)]
        | None
    ) = None

    @field_validator("slot")
    @classmethod
    def _configured_slot(cls, slot: str, info: ValidationInfo) -> str:
        """Serving validates with `context={"slots": settings.slots.names}`: any other slot is
        refused (422 naming `slot`); without a context every well-formed slot name passes."""
        slots = info.context.get("slots") if isinstance(info.context, dict) else None
        if slots is not None and slot not in slots:
            raise ValueError(f"{slot!r} is not a configured slot (slots.names: {', '.join(slots)})")
        return slot


class ServedAd(Contract):
    """One ad in a response, with the score it was ranked by, its pCTR and the price charged."""

    ad_id: Ident
    campaign_id: Ident
    score: Annotated[float, Field(allow_inf_nan=False)]
    pctr: Probability
    # the auction's second price in the campaign's bid unit (`Campaign.bid_type`): per click for
    # CPC (charged at the first click), per thousand shown impressions for CPM (an impression
    # costs price / 1000 once shown); `schemas.billing`
    price: NonNegFloat
    # echo it in the Click / Dwell of this ad (`Click.click_token`): the streams worker drops
    # clicks without the token of an impression served to that user (`schemas.signing`)
    click_token: ClickToken | None = None
    # the creative variant to render (`AdCreative.variants`), chosen by `serving.variants`
    variant_id: Ident | None = None


class StageMs(Contract):
    """Milliseconds spent in each stage of the pipeline for one request."""

    recall: NonNegFloat
    rank: NonNegFloat
    rerank: NonNegFloat


class AdResponse(Contract):
    """The ranked ads for a request; `degraded` says a deadline or fault forced a lower rung."""

    request_id: Ident
    ads: list[ServedAd]
    degraded: bool
    served_by: Rung = "adapter"
    stage_ms: StageMs
    model_version: Version
    adapter_version: Version | None = None


# measurement only (`ab.shadow_slates`): the response header with the ads (a JSON list of ids, in
# display order) that the request would have been served without adapters
SHADOW_HEADER = "x-adstream-shadow"

MAX_CANDIDATES = 1000  # candidates per `/v1/rank` request (a retrieval stage's usual few hundred)


def _distinct_ids(ids: list[str]) -> list[str]:
    seen: set[str] = set()
    for i in ids:
        if i in seen:
            raise ValueError(f"lists the ad {i!r} more than once")
        seen.add(i)
    return ids


class RankRequest(AdRequest):
    """`POST /v1/rank`: rank ads the caller retrieved itself (its own candidate ids from the
    catalog) for one user and slot, with the same ranker, adapters, deadlines, QoS, pacing and
    caps as `/v1/ads`; the best `k` are served (signed impressions and click tokens as there)."""

    candidates: Annotated[
        list[Ident], Field(min_length=1, max_length=MAX_CANDIDATES), AfterValidator(_distinct_ids)
    ]


class RankResponse(AdResponse):
    """`/v1/rank`'s answer: the ranked ads, and the candidates that were not ranked: ids the
    catalog does not hold (`unknown`), and ads it holds that this request may not be shown
    (`ineligible`: inactive, out of today's budget, outside their campaign's schedule or
    audience, or frequency-capped for the user)."""

    unknown: list[Ident] = Field(default_factory=list)
    ineligible: list[Ident] = Field(default_factory=list)


class AdapterInfo(Contract):
    """What a serving replica knows of one adapter (`GET /v1/adapters`)."""

    adapter_id: Ident
    version: Version
    seq: Annotated[int, Field(ge=0)]
    previous_version: Version | None = None
    staleness_s: NonNegFloat
    rejected_deltas: Annotated[int, Field(ge=0)] = 0
    pinned: bool = False  # an admin rollback holds it at this version until unpinned
