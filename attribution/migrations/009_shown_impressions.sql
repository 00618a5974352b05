-- Served, shown, billed (`schemas.billing`): how each served impression's campaign pays and how its
-- slot renders (`Impression.bid_type`, `.render`), and the render beacons that made served
-- impressions shown (`View`: the streams worker stores the first view of each served impression
-- inside its window, so `views` holds one row per shown impression; duplicate, late and unserved
-- beacons are counted by the worker, never stored). A shown impression is one with a `views` row,
-- or one whose `render` is not 'client' (rendered on the server, or from before render beacons:
-- NULL). Attribution's views are the shown impressions (attribution.paths). Independent of the
-- other migrations' contents: it only adds columns to `impressions` and creates its own table.
-- ADD COLUMN is made idempotent by attribution.migrate (18.16 has no IF NOT EXISTS there).
-- `views` is laid out as the raw tables are (by month, ordered by time then event_id; a replayed
-- view is written again with its same event_id and ts, so it collapses).
-- Accepted by ClickHouse 18.16 and by current releases.

ALTER TABLE impressions ADD COLUMN bid_type Nullable(String);
ALTER TABLE impressions ADD COLUMN render Nullable(String);

CREATE TABLE IF NOT EXISTS views (
    event_id String,
    ts DateTime,
    ts_ms UInt64,
    user_id String,
    impression_id String,
    ad_id String,
    kafka_partition UInt32,
    kafka_offset UInt64,
    ingested_at DateTime DEFAULT now()
) ENGINE = ReplacingMergeTree() PARTITION BY toYYYYMM(ts) ORDER BY (ts, event_id);
