-- How well each served impression's request query named its ad (`Impression.query_match`: the
-- cosine of their bags of words, written by the streams sink), the ranker's query feature as
-- serving computed it: offline training from ClickHouse (`trainers.clickhouse_source`) reads it
-- back, so the model is fitted to what serving ranked with. Nullable: requests without a query,
-- and impressions from before this release, carry none. Independent of the other migrations'
-- contents: it only adds a column to `impressions`. ADD COLUMN is made idempotent by
-- attribution.migrate (18.16 has no IF NOT EXISTS there). Accepted by ClickHouse 18.16 and by
-- current releases.

ALTER TABLE impressions ADD COLUMN query_match Nullable(Float64);
