"""The A/B rollup (005_ab_rollups.sql): hourly per arm × slot × user, rebuilt from deduplicated rows.

`refresh_ab_rollups(backend, since, until)` rebuilds every hour touching [since, until) from
FINAL reads (one row per event_id), so a batch the sink inserted twice counts once and a second
refresh replaces the hour's rows. `read_arms` sums a range per user into `attribution.ab.ArmData`
(the unit the intervals resample); `HOURLY_CTR_SQL` gives each arm's CTR per hour with its
delta-method 95 % half-width computed in SQL, for the dashboards (Grafana runs it as it is).

A request that spans an hour boundary counts once in each hour it has impressions in (rare:
a request's impressions share one timestamp in serving).

`impressions` counts what was served; `shown` (migration 010) the served impressions that were
shown (`schemas.billing`: a client-rendered one with a render beacon in `views`, a server-rendered
one, or one from before render beacons, at once), in the impression's hour as clicks are; CTR is
clicks / shown. Rows rolled up before 010 (shown NULL) read their impressions as shown.

`revenue` is what the user's impressions were billed (`attribution.sql.BILLED_COST_SQL`): a CPC
impression its price once clicked, a CPM one price / 1000 once shown or clicked, one without a
bid type (from before bid types) its price when served, as the rollups' spend counts it (this
rollup counted it once clicked before the rules were made one).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import numpy as np

from attribution.ab import ArmData
from attribution.paths import AttributionInputError
from attribution.rollups import hour_bounds
from attribution.sql import (
    BILLED_COST_SQL,
    SHOWN_AT_SERVE_SQL,
    Backend,
    with_click_and_view,
)
from schemas.holdout import HOLDOUT_AD_ID

AB_ROLLUP_TABLE = "ab_rollup_hourly"

# the arm as a plain string whatever 004 made the column (Nullable / LowCardinality / Enum);
# impressions without an arm ('' or NULL) belong to no arm
_ARM = "toString(assumeNotNull(ab_arm))"

# the impressions of the A/B rollup: those of an arm, the holdout's excluded
_AB_IMPRESSIONS = f"""
        SELECT event_id AS imp, toStartOfHour(ts) AS hour, {_ARM} AS arm, slot, user_id, request_id,
               bid_type, price, {SHOWN_AT_SERVE_SQL} AS shown_at_serve
        FROM impressions FINAL
        WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
          AND isNotNull(ab_arm) AND {_ARM} != '' AND ad_id != %(holdout)s"""

_AB_COLUMNS = "imp, hour, arm, slot, user_id, request_id, bid_type, price, shown_at_serve"

# one JOIN per SELECT (18.16): impressions with their click, then with their first view
REFRESH_AB_SQL = f"""
INSERT INTO ab_rollup_hourly (hour, arm, slot, user_id, requests, impressions, clicks, revenue,
                              version, shown)
SELECT hour, arm, slot, user_id, uniqExact(request_id), count(), sum(clicked),
       sum({BILLED_COST_SQL}), %(version)s, sum(shown_at_serve OR viewed)
FROM {with_click_and_view(_AB_COLUMNS, _AB_IMPRESSIONS)}
GROUP BY hour, arm, slot, user_id
"""

# a row's shown impressions: its count, or (rolled up before 010 counted them) its impressions
SHOWN = "ifNull(shown, impressions)"

# Per arm and user over a range ('' slot: every slot).
AB_USERS_SQL = f"""
SELECT arm, user_id, sum(requests) AS requests, sum(impressions) AS impressions,
       sum(clicks) AS clicks, sum(revenue) AS revenue, sum(n_shown) AS shown
FROM (
    SELECT arm, user_id, requests, impressions, clicks, revenue, {SHOWN} AS n_shown
    FROM ab_rollup_hourly FINAL
    WHERE hour >= toDateTime(%(since)s) AND hour < toDateTime(%(until)s)
      AND (%(slot)s = '' OR slot = %(slot)s)
)
GROUP BY arm, user_id
ORDER BY arm, user_id
"""

# CTR (clicks over shown impressions) per hour and arm with the delta-method half-width over users
# (as attribution.ab's): R = Y/X, var(R) = n/(n−1) · Σ(y − R·x)² / X², with Σ(y − R·x)² =
# Syy − 2R·Sxy + R²·Sxx. `impressions` here are the shown ones. Grafana runs the same statement
# with $__timeFilter(hour) in place of the range.
HOURLY_CTR_SQL = f"""
SELECT hour, arm, users, impressions, clicks, clicks / impressions AS ctr,
       if(users > 1,
          1.959964 * sqrt(greatest(0., users / (users - 1)
              * (syy - 2 * (clicks / impressions) * sxy + pow(clicks / impressions, 2) * sxx)))
              / impressions,
          nan) AS half_width
FROM (
    SELECT hour, arm, count() AS users, sum(x) AS impressions, sum(y) AS clicks,
           sum(x * x) AS sxx, sum(x * y) AS sxy, sum(y * y) AS syy
    FROM (
        SELECT hour, arm, user_id, toFloat64(sum({SHOWN})) AS x, toFloat64(sum(clicks)) AS y
        FROM ab_rollup_hourly FINAL
        WHERE hour >= toDateTime(%(since)s) AND hour < toDateTime(%(until)s)
          AND (%(slot)s = '' OR slot = %(slot)s)
        GROUP BY hour, arm, user_id
    )
    GROUP BY hour, arm
)
WHERE impressions > 0
ORDER BY hour, arm
"""


def refresh_ab_rollups(backend: Backend, since: int, until: int, version: int | None = None) -> None:
    """Recompute the A/B rollup of every hour touching [since, until) from FINAL raw reads."""
    lo, hi = hour_bounds(since, until)
    backend.execute(
        REFRESH_AB_SQL,
        {"since": lo, "until": hi, "holdout": HOLDOUT_AD_ID, "version": version or time.time_ns()},
    )


def _stamp(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S")


def read_arms(backend: Backend, since: int, until: int, slot: str | None = None) -> dict[str, ArmData]:
    """Each arm's per-user aggregates over the hours touching [since, until) (one slot, or all).

    Raises `AttributionInputError` naming the range (and slot) when the rollup has no row there.
    """
    lo, hi = hour_bounds(since, until)
    cols = backend.execute_columns(AB_USERS_SQL, {"since": lo, "until": hi, "slot": slot or ""})
    if not cols or len(cols[0]) == 0:
        where = f" in slot {slot!r}" if slot else ""
        raise AttributionInputError(
            f"no A/B traffic{where} between {_stamp(lo)} and {_stamp(hi)} UTC "
            "(no impression with an arm there, or the A/B rollup is not refreshed)"
        )
    arms, _, requests, impressions, clicks, revenue, shown = cols
    out: dict[str, ArmData] = {}
    names = np.asarray(arms).astype(str)
    for arm in sorted(set(names.tolist())):
        m = names == arm
        out[arm] = ArmData.of(arm, requests[m], impressions[m], clicks[m], revenue[m], shown[m])
    return out
