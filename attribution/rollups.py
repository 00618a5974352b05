"""Hourly rollups per campaign × slot, recomputed from deduplicated raw rows (see 002_rollups.sql).

`refresh_rollups(backend, since, until)` rebuilds every hour touching [since, until): each
count is taken from a FINAL read (one row per event_id), so a batch the sink inserted twice is
counted once, and refreshing an hour again replaces its rows (higher `version`). Clicks and
dwell take their campaign and slot from the impression they belong to.

`impressions` counts what was served; `shown` the served impressions that were shown, in the
hour they were shown (a client-rendered one at its first render beacon in `views`, a
server-rendered one, or one from before render beacons, when served: `schemas.billing`); CTR is
clicks / shown. Rows rolled up before migration 010 have no `shown` (NULL): readers take their
`impressions` instead (`SHOWN`). `spend` counts what campaigns pay (`schemas.billing`), in
the hour it was billed: a CPM impression price / 1000 (its price is per thousand shown) when
it was shown (when served on a server-rendered slot, else at its first render beacon in
`views` or its first click, whichever came first: a click shows its ad), a CPC impression its
price at its first click (a first view or click up to a day before a refresh's range is not
billed again). Impressions that name no bid type (from before bid types) keep the old rule, the
one rule everywhere (`schemas.billing`): their price when served.
"""

from __future__ import annotations

import time
from typing import Any

from attribution.sql import Backend
from schemas.holdout import HOLDOUT_AD_ID

ROLLUP_TABLE = "rollup_hourly"

_COLUMNS = (
    "hour", "campaign_id", "advertiser_id", "slot", "impressions", "holdout_impressions", "clicks",
    "spend", "conversions", "value", "dwell_events", "dwell_ms", "shown",
)  # fmt: skip

# a row's shown impressions: its count, or (rolled up before 010 counted them) its impressions
SHOWN = "ifNull(shown, impressions)"

# One SELECT per source, each emitting every rollup column (zeros where it has none), summed per
# key. Hours are whole: [since, until) is widened to the hours it touches by the caller.
REFRESH_SQL = """
INSERT INTO rollup_hourly (hour, campaign_id, advertiser_id, slot, impressions, holdout_impressions,
                           clicks, spend, conversions, value, dwell_events, dwell_ms, version, shown)
SELECT hour, campaign_id, advertiser_id, slot,
       sum(n_imp), sum(n_hold), sum(n_click), sum(spend), sum(n_conv), sum(val), sum(n_dwell),
       sum(dwell), %(version)s, sum(n_shown)
FROM (
    SELECT toStartOfHour(ts) AS hour, campaign_id, advertiser_id, slot,
           toUInt64(ad_id != %(holdout)s) AS n_imp, toUInt64(ad_id = %(holdout)s) AS n_hold,
           toUInt64(0) AS n_click,
           if(ad_id = %(holdout)s, 0., if(isNull(bid_type), price,
              if(bid_type = 'cpm' AND ifNull(render, '') != 'client', price / 1000., 0.)))
               AS spend,
           toUInt64(0) AS n_conv, 0. AS val, toUInt64(0) AS n_dwell, toUInt64(0) AS dwell,
           toUInt64(ad_id != %(holdout)s AND ifNull(render, '') != 'client') AS n_shown
    FROM impressions FINAL
    WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
    UNION ALL
    SELECT toStartOfHour(ts) AS hour, campaign_id, advertiser_id, slot,
           toUInt64(0), toUInt64(0), toUInt64(0), 0., toUInt64(0), 0., toUInt64(0), toUInt64(0), toUInt64(1)
    FROM (
        SELECT ts, impression_id AS event_id FROM views FINAL
        WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
    ) AS v ANY INNER JOIN (
        SELECT event_id, campaign_id, advertiser_id, slot FROM impressions FINAL
        WHERE render = 'client' AND ad_id != %(holdout)s
    ) AS i USING event_id
    UNION ALL
    SELECT toStartOfHour(first) AS hour, campaign_id, advertiser_id, slot,
           toUInt64(0), toUInt64(0), toUInt64(0), price / 1000., toUInt64(0), 0., toUInt64(0), toUInt64(0),
           toUInt64(0)
    FROM (
        SELECT event_id, min(ts) AS first FROM (
            SELECT impression_id AS event_id, ts FROM views FINAL
            WHERE ts >= toDateTime(%(since)s - 86400) AND ts < toDateTime(%(until)s)
            UNION ALL
            SELECT impression_id AS event_id, ts FROM clicks FINAL
            WHERE ts >= toDateTime(%(since)s - 86400) AND ts < toDateTime(%(until)s)
        )
        GROUP BY event_id
        HAVING first >= toDateTime(%(since)s)
    ) AS s ANY INNER JOIN (
        SELECT event_id, campaign_id, advertiser_id, slot, price FROM impressions FINAL
        WHERE bid_type = 'cpm' AND render = 'client' AND ad_id != %(holdout)s
    ) AS i USING event_id
    UNION ALL
    SELECT toStartOfHour(first) AS hour, campaign_id, advertiser_id, slot,
           toUInt64(0), toUInt64(0), toUInt64(0), price, toUInt64(0), 0., toUInt64(0), toUInt64(0),
           toUInt64(0)
    FROM (
        SELECT impression_id AS event_id, min(ts) AS first FROM clicks FINAL
        WHERE ts >= toDateTime(%(since)s - 86400) AND ts < toDateTime(%(until)s)
        GROUP BY impression_id
        HAVING first >= toDateTime(%(since)s)
    ) AS f ANY INNER JOIN (
        SELECT event_id, campaign_id, advertiser_id, slot, price FROM impressions FINAL
        WHERE bid_type = 'cpc' AND ad_id != %(holdout)s
    ) AS i USING event_id
    UNION ALL
    SELECT toStartOfHour(ts) AS hour, campaign_id, advertiser_id, slot,
           toUInt64(0), toUInt64(0), toUInt64(1), 0., toUInt64(0), 0., toUInt64(0), toUInt64(0),
           toUInt64(0)
    FROM (
        SELECT ts, impression_id AS event_id FROM clicks FINAL
        WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
    ) AS x ANY INNER JOIN (
        SELECT event_id, campaign_id, advertiser_id, slot FROM impressions FINAL
    ) AS i USING event_id
    UNION ALL
    SELECT toStartOfHour(ts) AS hour, campaign_id, advertiser_id, slot,
           toUInt64(0), toUInt64(0), toUInt64(0), 0., toUInt64(0), 0., toUInt64(1), toUInt64(dwell_ms),
           toUInt64(0)
    FROM (
        SELECT ts, impression_id AS event_id, dwell_ms FROM dwell FINAL
        WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
    ) AS x ANY INNER JOIN (
        SELECT event_id, campaign_id, advertiser_id, slot FROM impressions FINAL
    ) AS i USING event_id
    UNION ALL
    SELECT toStartOfHour(ts) AS hour, campaign_id, advertiser_id, '' AS slot,
           toUInt64(0), toUInt64(0), toUInt64(0), 0., toUInt64(1), value, toUInt64(0), toUInt64(0),
           toUInt64(0)
    FROM conversions FINAL
    WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
)
GROUP BY hour, campaign_id, advertiser_id, slot
"""

# The rollup as read by reports and dashboards: FINAL keeps only the latest refresh of a key.
ROLLUP_SQL = f"""
SELECT hour, campaign_id, advertiser_id, slot, impressions, holdout_impressions, clicks, spend,
       conversions, value, dwell_events, dwell_ms, {SHOWN} AS shown
FROM rollup_hourly FINAL
WHERE hour >= toDateTime(%(since)s) AND hour < toDateTime(%(until)s)
ORDER BY hour, campaign_id, slot, advertiser_id
"""

# Totals per campaign × slot over a range (e.g. spend per channel, CTR by slot and campaign: clicks
# over shown).
ROLLUP_TOTALS_SQL = f"""
SELECT campaign_id, slot, sum(impressions) AS impressions, sum(clicks) AS clicks,
       sum(spend) AS spend, sum(conversions) AS conversions, sum(value) AS value,
       sum(dwell_ms) AS dwell_ms, sum(dwell_events) AS dwell_events, sum(n_shown) AS shown
FROM (
    SELECT campaign_id, slot, impressions, {SHOWN} AS n_shown, clicks, spend, conversions, value,
           dwell_ms, dwell_events
    FROM rollup_hourly FINAL
    WHERE hour >= toDateTime(%(since)s) AND hour < toDateTime(%(until)s)
)
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
