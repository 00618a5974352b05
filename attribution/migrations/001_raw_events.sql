-- Raw contract events, one table per topic, written by the streams ClickHouse sink.
-- ReplacingMergeTree keyed on event_id: a replayed or duplicated event collapses into one row
-- on merge; queries must read with FINAL (or count uniq(event_id)) to never double-count.
-- No materialized views read these tables (a view would count an inserted duplicate twice).
-- Accepted by ClickHouse 18.16 and by current releases.

CREATE TABLE IF NOT EXISTS impressions (
    event_id String,
    ts DateTime,
    ts_ms UInt64,
    user_id String,
    request_id String,
    ad_id String,
    campaign_id String,
    advertiser_id String,
    slot String,
    position UInt16,
    price Float64,
    pctr Nullable(Float64),
    model_version Nullable(String),
    adapter_version Nullable(String),
    kafka_partition UInt32,
    kafka_offset UInt64,
    ingested_at DateTime DEFAULT now()
) ENGINE = ReplacingMergeTree() PARTITION BY toYYYYMM(ts) ORDER BY event_id;

CREATE TABLE IF NOT EXISTS clicks (
    event_id String,
    ts DateTime,
    ts_ms UInt64,
    user_id String,
    impression_id String,
    ad_id String,
    campaign_id String,
    kafka_partition UInt32,
    kafka_offset UInt64,
    ingested_at DateTime DEFAULT now()
) ENGINE = ReplacingMergeTree() PARTITION BY toYYYYMM(ts) ORDER BY event_id;

CREATE TABLE IF NOT EXISTS dwell (
    event_id String,
    ts DateTime,
    ts_ms UInt64,
    user_id String,
    impression_id String,
    ad_id String,
    dwell_ms UInt32,
    kafka_partition UInt32,
    kafka_offset UInt64,
    ingested_at DateTime DEFAULT now()
) ENGINE = ReplacingMergeTree() PARTITION BY toYYYYMM(ts) ORDER BY event_id;

CREATE TABLE IF NOT EXISTS conversions (
    event_id String,
    ts DateTime,
    ts_ms UInt64,
    user_id String,
    campaign_id String,
    advertiser_id String,
    value Float64,
    ad_id Nullable(String),
    kafka_partition UInt32,
    kafka_offset UInt64,
    ingested_at DateTime DEFAULT now()
) ENGINE = ReplacingMergeTree() PARTITION BY toYYYYMM(ts) ORDER BY event_id;

CREATE TABLE IF NOT EXISTS ads (
    event_id String,
    ts DateTime,
    ts_ms UInt64,
    ad_id String,
    campaign_id String,
    advertiser_id String,
    category String,
    title String,
    bid Float64,
    daily_budget Float64,
    active UInt8,
    kafka_partition UInt32,
    kafka_offset UInt64,
    ingested_at DateTime DEFAULT now()
) ENGINE = ReplacingMergeTree() PARTITION BY toYYYYMM(ts) ORDER BY event_id;
