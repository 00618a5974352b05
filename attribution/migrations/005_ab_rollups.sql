-- Hourly A/B rollup: one row per hour × arm × slot × user, so intervals that resample users
-- (attribution.ab) can run from the rollup rather than from raw impressions.
-- Like rollup_hourly (002), it is rebuilt from FINAL reads of the raw tables
-- (attribution.ab_rollups.refresh_ab_rollups), never fed by a materialized view: a view sees
-- each inserted block, so a batch the sink re-inserts after a crash would be counted twice.
-- A refresh recomputes whole hours and replaces their rows (ReplacingMergeTree on `version`,
-- read with FINAL), so refreshing again, or after a re-inserted batch, gives the same numbers.
-- requests: distinct request_id among the user's impressions of that hour and slot; impressions
-- exclude holdout rows; clicks count clicked impressions (a click is counted in its
-- impression's hour); revenue is the price of the clicked impressions.
-- Reads impressions.ab_arm (004_impression_arms); rows without an arm are not in any arm.
-- Accepted by ClickHouse 18.16 and by current releases.

CREATE TABLE IF NOT EXISTS ab_rollup_hourly (
    hour DateTime,
    arm String,
    slot String,
    user_id String,
    requests UInt64,
    impressions UInt64,
    clicks UInt64,
    revenue Float64,
    version UInt64
) ENGINE = ReplacingMergeTree(version) PARTITION BY toYYYYMM(hour) ORDER BY (hour, arm, slot, user_id);
