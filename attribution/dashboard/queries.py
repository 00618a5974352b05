"""Every SQL statement of the dashboard, and the time window they read.

Rules these statements keep (see DESIGN.md, "ClickHouse 18.16 vs current"):

- user values arrive only as clickhouse-driver parameters (`%(since)s`, `%(until)s`,
  `%(bucket)s`, `%(top)s`, `%(run_id)s`; `%(holdout)s` too): times are epoch seconds wrapped in
  `toDateTime(…)`, so neither the client's nor the server's time zone can shift them;
- no window functions, CTEs or `toStartOfInterval` (18.16 has none): time buckets are
  `intDiv(toUInt32(ts), bucket) * bucket`, running sums are done on the caller's side;
- raw tables are ReplacingMergeTree keyed on `event_id` and are read with `FINAL`, so a batch
  the sink inserted twice is counted once;
- money is billed spend (`schemas.billing`), read from the hourly rollups (`rollup_hourly`,
  `attribution.rollups`: refreshed by `adstream attribution rollup`, the scheduler, and every
  stored attribution run), never an impression's price: a served ad that was never shown (CPM)
  or never clicked (CPC) cost nothing;
- joined subqueries carry aliases and join `USING` one column, the form both engines accept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime

from attribution.sql import SHOWN_AT_SERVE_SQL
from schemas.errors import ConfigError
from schemas.holdout import HOLDOUT_AD_ID

RANGE = "ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)"
BUCKET = "intDiv(toUInt32(ts), %(bucket)s) * %(bucket)s"
# A holdout impression (schemas.holdout) records a request where a held-out user was shown no
# ad: it is neither served traffic (CTR, AUC, adapter mix) nor spend; event rates count it apart.
SERVED = "ad_id != %(holdout)s"

# Time span of the data (for the default window): impressions and conversions, duplicates
# irrelevant here. An empty table is left out (its min(ts) would be 1970).
BOUNDS = """
SELECT min(lo), max(hi), sum(n) FROM (
    SELECT toUInt32(min(ts)) AS lo, toUInt32(max(ts)) AS hi, count() AS n FROM impressions
    UNION ALL
    SELECT toUInt32(min(ts)) AS lo, toUInt32(max(ts)) AS hi, count() AS n FROM conversions
) WHERE n > 0
"""

EVENT_RATES = f"""
SELECT kind, t, count() AS n FROM (
    SELECT if(ad_id = %(holdout)s, 'holdout impressions', 'impressions') AS kind, {BUCKET} AS t
    FROM impressions FINAL WHERE {RANGE}
    UNION ALL
    SELECT 'views' AS kind, {BUCKET} AS t FROM views FINAL WHERE {RANGE}
    UNION ALL
    SELECT 'clicks' AS kind, {BUCKET} AS t FROM clicks FINAL WHERE {RANGE}
    UNION ALL
    SELECT 'dwell' AS kind, {BUCKET} AS t FROM dwell FINAL WHERE {RANGE}
    UNION ALL
    SELECT 'conversions' AS kind, {BUCKET} AS t FROM conversions FINAL WHERE {RANGE}
) GROUP BY kind, t ORDER BY kind, t
"""

# Each impression's click, at most one (a re-delivered click is one row after FINAL; ANY takes
# one click per impression whatever else). Clicks come after their impression, so only clicks
# since the window's start can match.
_CLICKED = """
ANY LEFT JOIN (
    SELECT impression_id AS imp, toUInt8(1) AS clicked FROM clicks FINAL
    WHERE ts >= toDateTime(%(since)s) GROUP BY impression_id
) AS c USING imp
"""

_TOP_CAMPAIGNS = f"""
SELECT campaign_id FROM impressions WHERE {RANGE} AND {SERVED}
GROUP BY campaign_id ORDER BY count() DESC, campaign_id LIMIT %(top)s
"""

# CTR is clicks over shown impressions (`schemas.billing`): a served impression is shown at once
# when its slot renders on the server (or it is from before render beacons: render NULL), else
# when its render beacon is in `views`. One JOIN per SELECT (18.16): clicks, then views.
CTR_BY_SLOT_CAMPAIGN = f"""
SELECT slot, campaign_id, sum(shown_at_serve OR viewed) AS shown, sum(clicked) AS clicks
FROM (
    SELECT imp, slot, campaign_id, shown_at_serve, clicked
    FROM (
        SELECT event_id AS imp, slot, campaign_id, {SHOWN_AT_SERVE_SQL} AS shown_at_serve
        FROM impressions FINAL
        WHERE {RANGE} AND {SERVED} AND campaign_id IN ({_TOP_CAMPAIGNS})
    ) AS i
    {_CLICKED}
) AS ic
ANY LEFT JOIN (
    SELECT impression_id AS imp, toUInt8(1) AS viewed FROM views FINAL
    WHERE ts >= toDateTime(%(since)s) GROUP BY impression_id
) AS v USING imp
GROUP BY slot, campaign_id ORDER BY campaign_id, slot
"""

# The hours of the rollups that touch the window (an hour the window cuts counts whole).
ROLLUP_RANGE = "hour >= toDateTime(intDiv(%(since)s, 3600) * 3600) AND hour < toDateTime(%(until)s)"

# Billed spend per bucket, from the hourly rollups: an hour's spend in the bucket its end falls in
# (spent by then; the hour the window ends in, at the window's last second), so a running sum
# never shows spend before it was made, and climbs by the hour in buckets under an hour. Spend
# appears once its hour is rolled up.
SPEND_OVER_TIME = f"""
SELECT intDiv(least(toUInt32(hour) + 3600, %(until)s - 1), %(bucket)s) * %(bucket)s AS t,
       sum(spend) AS spend
FROM rollup_hourly FINAL WHERE {ROLLUP_RANGE}
GROUP BY t ORDER BY t
"""

# Each ad's latest catalog state as of the window's end; a campaign's daily budget is the sum
# over its active ads.
BUDGETS = """
SELECT cmp, sum(budget) AS daily_budget FROM (
    SELECT ad_id, argMax(campaign_id, ts) AS cmp, argMax(daily_budget, ts) AS budget,
           argMax(active, ts) AS live
    FROM ads FINAL WHERE ts < toDateTime(%(until)s) GROUP BY ad_id
) WHERE live = 1 GROUP BY cmp ORDER BY cmp
"""

# Per campaign, from the hourly rollups: billed spend, served impressions, and conversions and
# value as the conversions record their campaign (what the advertiser sees, before any
# attribution model); the `top` by spend.
CAMPAIGN_ECONOMICS = f"""
SELECT campaign_id, sum(spend) AS total_spend, sum(impressions) AS served, sum(conversions) AS n_conversions,
       sum(value) AS total_value
FROM rollup_hourly FINAL WHERE {ROLLUP_RANGE} AND campaign_id != ''
GROUP BY campaign_id
ORDER BY total_spend DESC, campaign_id LIMIT %(top)s
"""

# Online AUC of the served pctr against clicks, per time bucket, per adapter version and for
# all traffic ('all'), by the rank-sum form: scores (in bins of 1e-4, which bounds the arrays;
# floor, not round(): 18.16 and current releases round halves differently) are grouped with
# their click and non-click counts, sorted, and each score's clicks beat the non-clicks below
# it and tie with half of those at it:
#   AUC = Σ_s pos_s · (neg_below_s + neg_s / 2) / (P · N).
ONLINE_AUC = f"""
SELECT t, version, arraySum(ps) AS clicks, arraySum(ns) AS non_clicks,
       arraySum(arrayMap((p, n, c) -> p * (c - n + 0.5 * n), ps, ns, arrayCumSum(ns)))
           / (arraySum(ps) * arraySum(ns)) AS auc
FROM (
    SELECT t, version, arrayMap(x -> x.2, g) AS ps, arrayMap(x -> x.3, g) AS ns
    FROM (
        SELECT t, version, arraySort(x -> x.1, groupArray((score, p, n))) AS g
        FROM (
            SELECT t, version, score, sum(clicked) AS p, sum(1 - clicked) AS n
            FROM (
                SELECT {BUCKET} AS t, floor(assumeNotNull(pctr) * 10000) AS score,
                       ifNull(adapter_version, 'none') AS ver, clicked
                FROM (
                    SELECT event_id AS imp, ts, pctr, adapter_version FROM impressions FINAL
                    WHERE {RANGE} AND {SERVED} AND isNotNull(pctr)
                ) AS i
                {_CLICKED}
            ) ARRAY JOIN [ver, 'all'] AS version
            GROUP BY t, version, score
        ) GROUP BY t, version
    )
) WHERE clicks > 0 AND non_clicks > 0
ORDER BY version, t
"""

ADAPTER_MIX = f"""
SELECT {BUCKET} AS t, ifNull(adapter_version, 'none') AS version, count() AS n
FROM impressions FINAL WHERE {RANGE} AND {SERVED}
GROUP BY t, version ORDER BY t, version
"""

# The stored attribution run shown (attribution.runs writes these tables): the one named by
# %(run_id)s, or the latest when it is ''.
_RUN = """
SELECT run_id FROM attribution_runs WHERE %(run_id)s = '' OR run_id = %(run_id)s
ORDER BY created_at DESC, run_id DESC LIMIT 1
"""

RUN_INFO = f"""
SELECT run_id, toUInt32(created_at) AS created, toUInt32(since) AS lo, toUInt32(until) AS hi,
       granularity, conversions, value, paths
FROM attribution_runs WHERE run_id IN ({_RUN})
"""

# Per model × channel of that run: credit share with its bootstrap CI, and the budget move.
RUN_RESULTS = f"""
SELECT model, channel, conversions, value, share, ci_low, ci_high, spend, roi, cpa,
       recommended_spend, low_confidence
FROM attribution_results WHERE run_id IN ({_RUN})
ORDER BY model, channel
"""

# The latest runs, to pick one by id (`?run=`).
RECENT_RUNS = """
SELECT run_id, toUInt32(created_at) AS created, toUInt32(since) AS lo, toUInt32(until) AS hi,
       granularity, arrayStringConcat(models, ', ') AS model_list, conversions, value
FROM attribution_runs
ORDER BY created_at DESC, run_id DESC LIMIT %(top)s
"""

# Every statement of the page, by name.
QUERIES: dict[str, str] = {
    "event_rates": EVENT_RATES,
    "ctr_by_slot_campaign": CTR_BY_SLOT_CAMPAIGN,
    "spend_over_time": SPEND_OVER_TIME,
    "budgets": BUDGETS,
    "campaign_economics": CAMPAIGN_ECONOMICS,
    "online_auc": ONLINE_AUC,
    "adapter_mix": ADAPTER_MIX,
    "run_info": RUN_INFO,
    "run_results": RUN_RESULTS,
    "recent_runs": RECENT_RUNS,
}

# Buckets the page chooses from: the smallest giving at most MAX_BUCKETS points.
NICE_BUCKETS_S = (1, 5, 10, 30, 60, 300, 600, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400)
MAX_BUCKETS = 120
COARSE_BUCKETS = 30
DEFAULT_SPAN_S = 7 * 86400  # default window: the data's last week at most
MAX_TOP = 100
VIEWS = ("operations", "advertiser")  # the page's views: the platform's, and an advertiser's
MAX_FILTER_VALUES = 50


@dataclass(frozen=True)
class View:
    """Which of the page's views, and the advertiser view's filters and currency label."""

    name: str = "operations"
    advertisers: tuple[str, ...] = ()  # empty: all
    campaigns: tuple[str, ...] = ()
    currency: str = "USD"  # ISO 4217 code: the label of money (the platform keeps one currency)

    def __post_init__(self) -> None:
        if self.name not in VIEWS:
            raise ConfigError(f"view={self.name!r} is not one of {', '.join(VIEWS)}")
        if not (len(self.currency) == 3 and self.currency.isascii() and self.currency.isalpha()):
            raise ConfigError(f"currency={self.currency!r} is not an ISO 4217 code (three letters, e.g. EUR)")
        for name, values in (("advertiser", self.advertisers), ("campaign", self.campaigns)):
            if len(values) > MAX_FILTER_VALUES:
                raise ConfigError(f"{name}= names {len(values)} values; at most {MAX_FILTER_VALUES}")
            for v in values:
                if len(v) > 128:
                    raise ConfigError(f"{name}={v[:40]!r}… is longer than 128 characters")

    @classmethod
    def parse(
        cls, view: str = "operations", advertiser: str = "", campaign: str = "", currency: str = "USD"
    ) -> View:
        """The view from query parameters (filters as `a,b`; the currency in any case)."""
        return cls(view.strip(), _values(advertiser), _values(campaign), currency.strip().upper())


@dataclass(frozen=True)
class Window:
    """The half-open time range [since, until) in epoch seconds, its bucket and the top-N cap."""

    since: int
    until: int
    bucket: int
    top: int = 20
    run_id: str = ""  # the attribution run to show; '' = the latest
    view: View = View()

    def __post_init__(self) -> None:
        if self.until <= self.since:
            raise ConfigError(f"until={_iso(self.until)} must be after since={_iso(self.since)}")
        if self.since < 0:
            raise ConfigError(f"since={self.since} is before 1970")
        if self.until > 2**32 - 1:
            raise ConfigError(f"until={self.until} is beyond DateTime's range (2106)")
        if not 1 <= self.bucket <= 366 * 86400:
            raise ConfigError(f"bucket={self.bucket} must be between 1 s and 366 days")
        if not 1 <= self.top <= MAX_TOP:
            raise ConfigError(f"top={self.top} must be between 1 and {MAX_TOP}")
        if len(self.run_id) > 128:
            raise ConfigError(f"run_id={self.run_id[:40]!r}… is longer than 128 characters")

    @property
    def params(self) -> dict[str, int | str]:
        """The bound parameters the statements take (each uses some; the driver ignores the rest)."""
        return {
            "since": self.since,
            "until": self.until,
            "bucket": self.bucket,
            "top": self.top,
            "run_id": self.run_id,
            "holdout": HOLDOUT_AD_ID,
        }

    @property
    def coarse_bucket(self) -> int:
        """A bucket for statistics that need many events per point (online AUC): the window's,
        or coarser so that the window has at most COARSE_BUCKETS points."""
        return max(self.bucket, auto_bucket(self.until - self.since, COARSE_BUCKETS))

    @property
    def buckets(self) -> list[int]:
        """The start of every bucket that overlaps the window (for gap-free time axes)."""
        first = self.since // self.bucket * self.bucket
        return list(range(first, self.until, self.bucket))


def auto_bucket(span_s: int, points: int = MAX_BUCKETS) -> int:
    """The smallest nice bucket that cuts `span_s` seconds into at most `points` buckets.

    >>> auto_bucket(3600), auto_bucket(86400), auto_bucket(86400, points=30)
    (30, 900, 3600)
    """
    for b in NICE_BUCKETS_S:
        if math.ceil(span_s / b) <= points:
            return b
    return NICE_BUCKETS_S[-1] * math.ceil(span_s / (NICE_BUCKETS_S[-1] * points))


def parse_time(value: str, field: str) -> int:
    """Epoch seconds from `value`: epoch seconds, or ISO 8601 (no offset means UTC).

    >>> parse_time("2026-01-01", "since"), parse_time("2026-01-01T01:00:00+01:00", "since")
    (1767225600, 1767225600)
    """
    text = value.strip()
    try:
        return int(float(text))
    except (ValueError, OverflowError):  # not a number, or nan / inf
        pass
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise ConfigError(f"{field}={value!r} is neither epoch seconds nor an ISO 8601 time") from exc
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return math.floor(dt.timestamp())


def resolve(
    bounds: tuple[int, int] | None,
    since: str | None = None,
    until: str | None = None,
    bucket: int | None = None,
    top: int = 20,
    run_id: str = "",
    view: View | None = None,
) -> Window:
    """The window asked for; what is not given comes from the data's bounds (lo, hi).

    Defaults: until = just after the latest event, since = the earliest event or a week before
    `until`, whichever is later; the bucket fits the span into at most MAX_BUCKETS points.
    """
    now = math.floor(datetime.now(UTC).timestamp())
    lo, hi = bounds if bounds is not None else (now - 86400, now)
    end = parse_time(until, "until") if until else hi + 1
    start = parse_time(since, "since") if since else max(lo, end - DEFAULT_SPAN_S)
    if not since and start >= end:  # an explicit `until` before every event
        start = end - 86400
    size = bucket if bucket is not None else auto_bucket(max(end - start, 1))
    return Window(start, end, size, top, run_id, view or View())


def _values(text: str) -> tuple[str, ...]:
    """A filter's values from `a,b` (spaces around each dropped, empty ones skipped).

    >>> _values(" adv_1, adv_2 ,,")
    ('adv_1', 'adv_2')
    """
    return tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))


def _iso(epoch: int) -> str:
    try:
        return datetime.fromtimestamp(epoch, UTC).isoformat()
    except (OverflowError, OSError, ValueError):
        return str(epoch)
