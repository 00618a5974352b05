"""Hourly rollups per campaign × slot, recomputed from deduplicated raw rows (see 002_rollups.sql).

`refresh_rollups(backend, since, until)` rebuilds every hour touching [since, until): each
count is taken from a FINAL read (one row per event_id), so a batch the sink inserted twice is
counted once, and refreshing an hour again replaces its rows (higher `version`). Clicks and
dwell take their campaign and slot from the impression they belong to.
"""

from __future__ import annotations

import time
from typing import Any

from attribution.sql import Backend
from schemas.holdout import HOLDOUT_AD_ID

ROLLUP_TABLE = "rollup_hourly"

_COLUMNS = (
    "hour", "campaign_id", "advertiser_id", "slot", "impressions", "holdout_impressions", "clicks",
    "spend", "conversions", "value", "dwell_events", "dwell_ms",
)  # fmt: skip

# One SELECT per source, each emitting every rollup column (zeros where it has none), summed per
# key. Hours are whole: [since, until) is widened to the hours it touches by the caller.
REFRESH_SQL = """
INSERT INTO rollup_hourly
SELECT hour, campaign_id, advertiser_id, slot,
       sum(n_imp), sum(n_hold), sum(n_click), sum(spend), sum(n_conv), sum(val), sum(n_dwell),
       sum(dwell), %(version)s
FROM (
    SELECT toStartOfHour(ts) AS hour, campaign_id, advertiser_id, slot,
           toUInt64(ad_id != %(holdout)s) AS n_imp, toUInt64(ad_id = %(holdout)s) AS n_hold,
           toUInt64(0) AS n_click, if(ad_id = %(holdout)s, 0., price) AS spend,
           toUInt64(0) AS n_conv, 0. AS val, toUInt64(0) AS n_dwell, toUInt64(0) AS dwell
    FROM impressions FINAL
    WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
    UNION ALL
    SELECT toStartOfHour(ts) AS hour, campaign_id, advertiser_id, slot,
           toUInt64(0), toUInt64(0), toUInt64(1), 0., toUInt64(0), 0., toUInt64(0), toUInt64(0)
    FROM (
        SELECT ts, impression_id AS event_id FROM clicks FINAL
        WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
    ) AS x ANY INNER JOIN (
        SELECT event_id, campaign_id, advertiser_id, slot FROM impressions FINAL
    ) AS i USING event_id
    UNION ALL
    SELECT toStartOfHour(ts) AS hour, campaign_id, advertiser_id, slot,
           toUInt64(0), toUInt64(0), toUInt64(0), 0., toUInt64(0), 0., toUInt64(1), toUInt64(dwell_ms)
    FROM (
        SELECT ts, impression_id AS event_id, dwell_ms FROM dwell FINAL
        WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
    ) AS x ANY INNER JOIN (
        SELECT event_id, campaign_id, advertiser_id, slot FROM impressions FINAL
    ) AS i USING event_id
    UNION ALL
    SELECT toStartOfHour(ts) AS hour, campaign_id, advertiser_id, '' AS slot,
           toUInt64(0), toUInt64(0), toUInt64(0), 0., toUInt64(1), value, toUInt64(0), toUInt64(0)
    FROM conversions FINAL
    WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
)
GROUP BY hour, campaign_id, advertiser_id, slot
"""

# The rollup as read by reports and dashboards: FINAL keeps only the latest refresh of a key.
ROLLUP_SQL = """
SELECT hour, campaign_id, advertiser_id, slot, impressions, holdout_impressions, clicks, spend,
       conversions, value, dwell_events, dwell_ms
FROM rollup_hourly FINAL
WHERE hour >= toDateTime(%(since)s) AND hour < toDateTime(%(until)s)
ORDER BY hour, campaign_id, slot, advertiser_id
"""

# Totals per campaign × slot over a range (e.g. spend per channel, CTR by slot and campaign).
ROLLUP_TOTALS_SQL = """
SELECT campaign_id, slot, sum(impressions) AS impressions, sum(clicks) AS clicks,
       sum(spend) AS spend, sum(conversions) AS conversions, sum(value) AS value,
       sum(dwell_ms) AS dwell_ms, sum(dwell_events) AS dwell_events
FROM rollup_hourly FINAL
WHERE hour >= toDateTime(%(since)s) AND hour < toDateTime(%(until)s)
GROUP BY campaign_id, slot
ORDER BY campaign_id, slot
"""


def hour_bounds(since: int, until: int) -> tuple[int, int]:
    """[since, until) widened to whole hours (epoch seconds)."""
    return since - since % 3600, until + (-until) % 3600


def refresh_rollups(backend: Backend, since: int, until: int, version: int | None = None) -> None:
    """Recompute the hourly rollups of every hour touching [since, until) from FINAL raw reads."""
    lo, hi = hour_bounds(since, until)
    backend.execute(
        REFRESH_SQL,
        {"since": lo, "until": hi, "holdout": HOLDOUT_AD_ID, "version": version or time.time_ns()},
    )


def read_rollups(backend: Backend, since: int, until: int) -> list[dict[str, Any]]:
    """The rollup rows of [since, until) as dicts (one per hour × campaign × slot × advertiser)."""
    lo, hi = hour_bounds(since, until)
    return [
        dict(zip(_COLUMNS, row, strict=True))
        for row in backend.execute(ROLLUP_SQL, {"since": lo, "until": hi})
    ]
