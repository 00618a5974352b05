-- Touchpoints on channels outside adstream (`Touch` on ad.touches, written by the streams sink
-- like every raw event) and the daily spend imported per outside channel
-- (`adstream spend import FILE.csv`). An outside channel is source / medium (/ campaign), UTM
-- style; paths mix these touches with the platform's own impressions and clicks.
-- touches: ReplacingMergeTree on event_id like the other raw tables (read with FINAL).
-- outside_spend: one row per (advertiser, day, channel); importing a day again replaces it (the
-- highest `version`, the import's time in ms, wins under FINAL). campaign '' = no utm_campaign.
-- Accepted by ClickHouse 18.16 and by current releases.

CREATE TABLE IF NOT EXISTS touches (
    event_id String,
    ts DateTime,
    ts_ms UInt64,
    user_id String,
    advertiser_id String,
    source String,
    medium String,
    campaign Nullable(String),
    interaction String,
    cost Nullable(Float64),
    kafka_partition UInt32,
    kafka_offset UInt64,
    ingested_at DateTime DEFAULT now()
) ENGINE = ReplacingMergeTree() PARTITION BY toYYYYMM(ts) ORDER BY event_id;

CREATE TABLE IF NOT EXISTS outside_spend (
    day Date,
    advertiser_id String,
    source String,
    medium String,
    campaign String,
    spend Float64,
    version UInt64
) ENGINE = ReplacingMergeTree(version) PARTITION BY toYYYYMM(day)
  ORDER BY (advertiser_id, day, source, medium, campaign);
