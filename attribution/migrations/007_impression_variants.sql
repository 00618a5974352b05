-- The creative variant each impression showed and the probability serving's variant bandit chose
-- it with (`Impression.variant_id`, `.variant_propensity`; written by the streams sink): what the
-- dashboard's variants panel reads (share and CTR per variant of an ad) and what off-policy
-- evaluation of another selection policy needs. Clicks name their impression, so they join to
-- the variant through it and need no column. Nullable: ads without variants, and impressions from
-- before this release, carry none. ADD COLUMN is made idempotent by attribution.migrate (18.16
-- has no IF NOT EXISTS there). Accepted by ClickHouse 18.16 and by current releases.

ALTER TABLE impressions ADD COLUMN variant_id Nullable(String);
ALTER TABLE impressions ADD COLUMN variant_propensity Nullable(Float64);
