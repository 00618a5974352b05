"""The raw ClickHouse rows of the contract's events: one definition of each table's columns,
which the streams sink writes (`streams.sink.COLUMNS` is this table) and the migrations create
(`attribution/migrations/*.sql`); trainers and attribution read them. A test applies every
migration and checks each table against this file, and each event model's fields against it:
a field added to an event is either stored here or named in `NOT_STORED`, on purpose.

Every raw table starts with `event_id`, `ts` (DateTime, seconds) and `ts_ms` (the event time in
ms, not a model field), and ends with `kafka_partition`, `kafka_offset` (where the sink read it)
and `ingested_at` (the server's default).
"""

from __future__ import annotations

from typing import Final

from schemas.events import AdCreative, Click, Conversion, Dwell, Impression, Message, Touch, View

RAW_ROWS: Final[dict[type[Message], tuple[str, tuple[str, ...]]]] = {
    Impression: (
        "impressions",
        ("event_id", "ts", "ts_ms", "user_id", "request_id", "ad_id", "campaign_id", "advertiser_id",
         "slot", "position", "price", "pctr", "model_version", "adapter_version", "ab_arm",
         "propensity", "explored", "variant_id", "variant_propensity", "bid_type", "render", "query_match"),
    ),
    # the first view of each served impression in its window (the worker's join decides which:
    # duplicate, late and unserved beacons are counted, not stored), so a row is a shown impression
    View: ("views", ("event_id", "ts", "ts_ms", "user_id", "impression_id", "ad_id")),
    Click: ("clicks", ("event_id", "ts", "ts_ms", "user_id", "impression_id", "ad_id", "campaign_id")),
    Dwell: ("dwell", ("event_id", "ts", "ts_ms", "user_id", "impression_id", "ad_id", "dwell_ms")),
    Conversion: (
        "conversions",
        ("event_id", "ts", "ts_ms", "user_id", "campaign_id", "advertiser_id", "value", "ad_id"),
    ),
    Touch: (
        "touches",
        ("event_id", "ts", "ts_ms", "user_id", "advertiser_id", "source", "medium", "campaign",
         "interaction", "cost"),
    ),
    AdCreative: (
        "ads",
        ("event_id", "ts", "ts_ms", "ad_id", "campaign_id", "advertiser_id", "category", "title",
         "bid", "daily_budget", "active"),
    ),
}  # fmt: skip

# the columns the sink appends to every row, after the model's
SOURCE_COLUMNS: Final = ("kafka_partition", "kafka_offset")

# model fields deliberately not in the raw tables (with why)
NOT_STORED: Final[dict[type[Message], frozenset[str]]] = {
    # the signature is checked by the worker before the sink
    Impression: frozenset({"kind", "sig"}),
    Click: frozenset({"kind", "click_token"}),  # the token is checked by the worker
    Dwell: frozenset({"kind", "click_token"}),
    View: frozenset({"kind", "click_token"}),
    Conversion: frozenset({"kind"}),
    Touch: frozenset({"kind"}),
    # the creative's assembled variants live on ad.catalog (the serving catalog), not in ClickHouse
    AdCreative: frozenset({"kind", "variants"}),
}
