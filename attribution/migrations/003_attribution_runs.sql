-- Stored attribution runs (one row per run) and their per-channel results (one row per model ×
-- channel of a run). Written once by attribution.runs.store_run; run_id is unique.
-- Accepted by ClickHouse 18.16 and by current releases.

CREATE TABLE IF NOT EXISTS attribution_runs (
    run_id String,
    created_at DateTime,
    since DateTime,
    until DateTime,
    granularity String,
    models Array(String),
    seed UInt64,
    bootstrap UInt32,
    click_lookback_s UInt32,
    view_lookback_s UInt32,
    journey_gap_s UInt32,
    paths UInt64,
    conversions Float64,
    value Float64,
    null_paths Float64,
    direct_conversions Float64,
    params String
) ENGINE = MergeTree() PARTITION BY toYYYYMM(created_at) ORDER BY (created_at, run_id);

CREATE TABLE IF NOT EXISTS attribution_results (
    run_id String,
    created_at DateTime,
    model String,
    channel String,
    conversions Float64,
    value Float64,
    share Float64,
    ci_low Float64,
    ci_high Float64,
    value_ci_low Float64,
    value_ci_high Float64,
    spend Float64,
    roi Float64,
    cpa Float64,
    recommended_spend Float64,
    low_confidence UInt8
) ENGINE = MergeTree() PARTITION BY toYYYYMM(created_at) ORDER BY (run_id, model, channel);
