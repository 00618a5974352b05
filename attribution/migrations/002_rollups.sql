-- Hourly rollups per campaign × slot, rebuilt from FINAL reads of the raw tables
-- (attribution.rollups.refresh_rollups), never fed by a materialized view: a view sees each
-- inserted block, so a batch the sink re-inserts after a crash would be counted twice even
-- though the ReplacingMergeTree below it collapses the duplicate rows. A refresh recomputes
-- whole hours from deduplicated rows and replaces them (ReplacingMergeTree on `version`, read
-- with FINAL), so refreshing again, or after a re-inserted batch, gives the same numbers.
-- Conversions carry no slot: they are rolled up under slot '' of their campaign.
-- Accepted by ClickHouse 18.16 and by current releases.

CREATE TABLE IF NOT EXISTS rollup_hourly (
    hour DateTime,
    campaign_id String,
    advertiser_id String,
    slot String,
    impressions UInt64,
    holdout_impressions UInt64,
    clicks UInt64,
    spend Float64,
    conversions UInt64,
    value Float64,
    dwell_events UInt64,
    dwell_ms UInt64,
    version UInt64
) ENGINE = ReplacingMergeTree(version) PARTITION BY toYYYYMM(hour) ORDER BY (hour, campaign_id, slot, advertiser_id);
