-- Live learning's A/B arm and the serving policy's logged propensities on every impression
-- (`Impression.ab_arm`, `.propensity`, `.explored`; written by the streams sink): what the
-- per-arm A/B rollups (005) and off-policy evaluation (`adstream evaluate`) read. Nullable:
-- impressions from before this release, or from producers that are no replica, carry none.
-- Accepted by ClickHouse 18.16 and by current releases.

ALTER TABLE impressions ADD COLUMN ab_arm Nullable(String);
ALTER TABLE impressions ADD COLUMN propensity Nullable(Float64);
ALTER TABLE impressions ADD COLUMN explored Nullable(UInt8);
