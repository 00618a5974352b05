-- Shown impressions in the hourly rollups (`schemas.billing`): `shown` counts the served
-- impressions that were shown, in the hour they were shown: a client-rendered impression at its
-- first render beacon (its `views` row, 009), a server-rendered one (or one from before render
-- beacons: `render` NULL) when served. `impressions` still counts what was served. CTR reads
-- clicks / shown (attribution.rollups, attribution.ab_rollups, the dashboards, `adstream ab`).
-- Nullable: rows rolled up before this migration read NULL, "not counted", and readers fall back
-- to `impressions` for them (what those rows counted as shown) until the hour is refreshed.
-- ADD COLUMN is made idempotent by attribution.migrate (18.16 has no IF NOT EXISTS there); the
-- refreshes name their columns, so the column's place at the end of each table does not matter.
-- Accepted by ClickHouse 18.16 and by current releases.

ALTER TABLE rollup_hourly ADD COLUMN shown Nullable(UInt64);
ALTER TABLE ab_rollup_hourly ADD COLUMN shown Nullable(UInt64);
