"""Conversion paths built in ClickHouse, aggregated to distinct paths × counts for the models.

Per user and advertiser, the touchpoints are the advertiser's impressions (kind 0, a view) and
the clicks on them (kind 1), ordered by time. Each conversion takes the touches after the
user's previous conversion (a path resets after each one) that lie inside their kind's
lookback (click 7 d, view 1 d by default; per advertiser through
`attribution_lookback_by_advertiser`). A journey without conversion is closed once no touch
or conversion follows its last touch within `attribution_journey_gap_s` (for the last touch:
before `until`); its touches since the previous event form a *null path*, and a later
conversion's path starts after it. Holdout impressions are not touchpoints.

The SQL runs on ClickHouse 18.16 and current releases alike (groupArray / arraySort /
arrayFilter / ARRAY JOIN, no window functions or CTEs); every value is a bound parameter.
The result is one row per distinct (channel hashes, kinds, ages in hours) with conversion, value
and null counts; `Paths` holds it as flat numpy arrays (CSR layout) for the models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, Literal

import numpy as np

from attribution.sql import Backend
from schemas.errors import AdstreamError
from schemas.holdout import HOLDOUT_AD_ID
from schemas.settings import Settings

Granularity = Literal["slot", "campaign", "slot_campaign"]

# The channel of a touch at each granularity: fixed SQL chosen by name, never user text.
CHANNEL_SQL: dict[str, str] = {
    "slot": "slot",
    "campaign": "campaign_id",
    "slot_campaign": "concat(campaign_id, ':', slot)",
}

# The same channel as a 64-bit key, hashed from the columns themselves (no string built per row).
CHANNEL_KEY_SQL: dict[str, str] = {
    "slot": "cityHash64(slot)",
    "campaign": "cityHash64(campaign_id)",
    "slot_campaign": "cityHash64(campaign_id, slot)",
}

VIEW, CLICK = 0, 1


class AttributionInputError(AdstreamError):
    """Attribution was asked for something unusable (a bad range, unknown model or channel, no data)."""


def channel_sql(by: str) -> str:
    """The SQL expression of a touch's channel for granularity `by`."""
    try:
        return CHANNEL_SQL[by]
    except KeyError:
        raise AttributionInputError(
            f"--by {by!r} is not a granularity (choose from {', '.join(CHANNEL_SQL)})"
        ) from None


def channel_key_sql(by: str) -> str:
    """The SQL expression of a touch's channel key (a 64-bit hash) for granularity `by`."""
    channel_sql(by)  # the one check of `by`
    return CHANNEL_KEY_SQL[by]


# The touches of every (user, advertiser) in [lo, until), sorted by (time, kind, channel).
_TOUCHES = """
SELECT user_id, advertiser_id,
       arraySort(groupArray((t, k, ch))) AS tt,
       arrayMap(x -> x.1, tt) AS t_ts, arrayMap(x -> x.2, tt) AS t_kind, arrayMap(x -> x.3, tt) AS t_ch
FROM (
    SELECT user_id, advertiser_id, toUInt32(ts) AS t, toUInt8(0) AS k, {key} AS ch
    FROM impressions FINAL
    WHERE ts >= toDateTime(%(lo)s) AND ts < toDateTime(%(until)s) AND ad_id != %(holdout)s
    UNION ALL
    SELECT user_id, advertiser_id, t, toUInt8(1) AS k, ch
    FROM (
        SELECT user_id, toUInt32(ts) AS t, impression_id AS event_id FROM clicks FINAL
        WHERE ts >= toDateTime(%(lo)s) AND ts < toDateTime(%(until)s)
    ) AS c ANY INNER JOIN (
        -- only the clicked impressions go into the join's hash table; no FINAL on this side or
        -- in the IN set: ANY takes one row per key and a set ignores copies, so a re-inserted
        -- row changes nothing here (the left side's FINAL keeps each click once)
        SELECT event_id, advertiser_id, {key} AS ch FROM impressions
        WHERE ts >= toDateTime(%(imp_lo)s) AND ts < toDateTime(%(until)s) AND ad_id != %(holdout)s
          AND event_id IN (
              SELECT impression_id FROM clicks
              WHERE ts >= toDateTime(%(lo)s) AND ts < toDateTime(%(until)s))
    ) AS i USING event_id
)
GROUP BY user_id, advertiser_id
"""

# Channels travel through the path SQL as 64-bit keys (cheaper to sort, copy and group than
# strings); this names them. Distinct (campaign, slot) pairs first: a re-inserted row adds no
# pair, so no FINAL is needed, and the name is built once per pair, not per impression.
CHANNEL_NAMES_SQL = """
SELECT {key} AS h, any({ch}) AS name
FROM (
    SELECT DISTINCT campaign_id, slot FROM impressions
    WHERE ts >= toDateTime(%(lo)s) AND ts < toDateTime(%(until)s) AND ad_id != %(holdout)s
)
GROUP BY h
"""

# Conversions of every (user, advertiser) in [lo, until) (earlier ones only reset paths).
_CONVERSIONS = """
SELECT user_id, advertiser_id,
       arraySort(groupArray((toUInt32(ts), value, event_id))) AS cc,
       arrayMap(x -> x.1, cc) AS c_ts, arrayMap(x -> x.2, cc) AS c_val
FROM conversions FINAL
WHERE ts >= toDateTime(%(lo)s) AND ts < toDateTime(%(until)s)
GROUP BY user_id, advertiser_id
"""

# Per user: the conversions and the journey ends sorted in time; each event takes the touches
# after the event before it (e_prev) up to itself: a conversion those inside their kind's
# lookback, a journey end all of them (its null path).
PATHS_SQL = """
SELECT path, kinds, ages, sum(is_conv) AS conversions, sum(if(is_conv = 1, e_val, 0.)) AS value,
       sum(1 - is_conv) AS nulls
FROM (
    SELECT
        arrayFilter((t, k) -> t <= e_ts AND t > e_prev
                    AND (e_null = 1 OR toInt64(e_ts) - t <= if(k = 1, e_cw, e_vw)), t_ts, t_kind) AS p_ts,
        arrayFilter((c, t, k) -> t <= e_ts AND t > e_prev
                    AND (e_null = 1 OR toInt64(e_ts) - t <= if(k = 1, e_cw, e_vw)),
                    t_ch, t_ts, t_kind) AS path,
        arrayFilter((k, t) -> t <= e_ts AND t > e_prev
                    AND (e_null = 1 OR toInt64(e_ts) - t <= if(k = 1, e_cw, e_vw)), t_kind, t_ts) AS kinds,
        arrayMap(t -> toUInt32(intDiv(toInt64(e_ts) - t, 3600)), p_ts) AS ages,
        toUInt64(1 - e_null) AS is_conv, e_val
    FROM (
        SELECT t_ts, t_kind, t_ch,
               arrayMap(x -> x.1, ev) AS e_ts_arr, arrayMap(x -> x.2, ev) AS e_null_arr,
               arrayMap(x -> x.3, ev) AS e_val_arr,
               arrayPopBack(arrayPushFront(e_ts_arr, toUInt32(0))) AS e_prev_arr,
               arrayMap(x -> cw, ev) AS e_cw_arr,
               arrayMap(x -> vw, ev) AS e_vw_arr
        FROM (
            -- events: the conversions (flag 0), and a journey end (flag 1) at every touch that no
            -- touch or conversion follows within the gap (the last touch: until the range ends)
            SELECT t_ts, t_kind, t_ch, cw, vw,
                   -- touches (0) and conversions (1) in time order; the time of the next of either
                   arraySort(arrayConcat(arrayMap(t -> (t, toUInt8(0)), t_ts),
                                         arrayMap(t -> (t, toUInt8(1)), c_ts))) AS merged,
                   arrayPushBack(arrayPopFront(arrayMap(x -> x.1, merged)), toUInt32(%(until)s)) AS m_next,
                   arraySort(arrayConcat(
                       arrayMap((t, v) -> (t, toUInt8(0), v), c_ts, c_val),
                       arrayMap(x -> (x.1, toUInt8(1), 0.), arrayFilter(
                           (x, nt) -> x.2 = 0 AND toInt64(nt) - x.1 >= %(gap)s, merged, m_next)))) AS ev
            FROM (
                SELECT t_ts, t_kind, t_ch, c_ts, c_val,
                       transform(advertiser_id, %(advertisers)s, %(click_ws)s, %(click_w)s) AS cw,
                       transform(advertiser_id, %(advertisers)s, %(view_ws)s, %(view_w)s) AS vw
                FROM ({touches}) AS t ANY LEFT JOIN ({conversions}) AS c USING user_id, advertiser_id
            )
        )
    )
    -- 18.16: a lambda at an ARRAY JOIN level may only capture the ARRAY JOIN's own columns
    ARRAY JOIN e_ts_arr AS e_ts, e_val_arr AS e_val, e_null_arr AS e_null, e_prev_arr AS e_prev,
               e_cw_arr AS e_cw, e_vw_arr AS e_vw
    WHERE e_ts >= %(since)s
)
WHERE notEmpty(path)
GROUP BY path, kinds, ages
-- by content (channel keys, kinds, ages: unique per row), the same order on every engine
ORDER BY path, kinds, ages
"""

# Conversions in range, and how many of them no touch preceded (reported, not credited).
CONVERSION_TOTALS_SQL = """
SELECT count() AS conversions, sum(value) AS value
FROM conversions FINAL
WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
"""


@dataclass(frozen=True)
class Window:
    """Lookbacks and journey gap of a path build (seconds), with per-advertiser overrides."""

    click_s: int = 7 * 86400
    view_s: int = 86400
    gap_s: int = 7 * 86400
    by_advertiser: tuple[tuple[str, int, int], ...] = ()

    @classmethod
    def from_settings(cls, s: Settings) -> Window:
        return cls(
            click_s=s.attribution_click_lookback_s,
            view_s=s.attribution_view_lookback_s,
            gap_s=s.attribution_journey_gap_s,
            by_advertiser=tuple(
                (adv, int(c), int(v)) for adv, (c, v) in sorted(s.attribution_lookback_by_advertiser.items())
            ),
        )

    def longest(self) -> int:
        return max([self.click_s, self.view_s, *(max(c, v) for _, c, v in self.by_advertiser)])


def check_range(since: int, until: int) -> None:
    """A usable [since, until): since before until, both after the epoch."""
    if since < 0 or until < 0:
        raise AttributionInputError(f"time range [{since}, {until}) must not start before 1970")
    if until <= since:
        raise AttributionInputError(f"--until ({until}) must be after --since ({since})")


def paths_query(by: str) -> str:
    """The full path-building SQL at granularity `by` (placeholders as in `path_params`)."""
    return PATHS_SQL.format(touches=_TOUCHES.format(key=channel_key_sql(by)), conversions=_CONVERSIONS)


def channel_names_query(by: str) -> str:
    """Channel hash → name at granularity `by` (same placeholders as `paths_query`)."""
    return CHANNEL_NAMES_SQL.format(ch=channel_sql(by), key=channel_key_sql(by))


def path_params(since: int, until: int, window: Window) -> dict[str, Any]:
    """Bound parameters of `paths_query` for [since, until) and the lookbacks."""
    lo = max(0, since - window.longest())
    return {
        "since": since,
        "until": until,
        "lo": lo,
        "imp_lo": max(0, lo - 86400),
        "gap": window.gap_s,
        "holdout": HOLDOUT_AD_ID,
        "click_w": window.click_s,
        "view_w": window.view_s,
        # a first entry no advertiser id can equal keeps the arrays typed when there are no
        # overrides (18.16 cannot type an empty array literal for transform)
        "advertisers": ["\x00", *(a for a, _, _ in window.by_advertiser)],
        "click_ws": [window.click_s, *(c for _, c, _ in window.by_advertiser)],
        "view_ws": [window.view_s, *(v for _, _, v in window.by_advertiser)],
    }


@dataclass(frozen=True)
class Paths:
    """Distinct paths × counts, flat: touches of path i are `offsets[i]:offsets[i+1]`."""

    channels: tuple[str, ...]
    offsets: np.ndarray  # int64, n + 1
    channel: np.ndarray  # int32 per touch, index into `channels`
    kind: np.ndarray  # uint8 per touch: 0 view, 1 click
    age_s: np.ndarray  # float64 per touch: seconds before the conversion / journey end
    conversions: np.ndarray  # float64 per path
    value: np.ndarray  # float64 per path
    nulls: np.ndarray  # float64 per path

    @property
    def n(self) -> int:
        return int(self.conversions.shape[0])

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def path_of_touch(self) -> np.ndarray:
        return np.repeat(np.arange(self.n), self.lengths)

    def with_counts(self, conversions: np.ndarray, value: np.ndarray, nulls: np.ndarray) -> Paths:
        """The same paths with other counts (bootstrap replicates, held-out splits)."""
        return Paths(
            self.channels, self.offsets, self.channel, self.kind, self.age_s, conversions, value, nulls
        )

    def converting(self) -> Paths:
        """Only the paths with at least one conversion."""
        return self.select(self.conversions > 0)

    def select(self, mask: np.ndarray) -> Paths:
        idx = np.flatnonzero(mask)
        lengths = self.lengths[idx]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        touch = (
            np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in idx])
            if idx.size
            else (np.zeros(0, dtype=np.int64))
        )
        return Paths(
            self.channels, offsets, self.channel[touch], self.kind[touch], self.age_s[touch],
            self.conversions[idx], self.value[idx], self.nulls[idx],
        )  # fmt: skip


def paths_from_rows(rows: Sequence[Sequence[Any]], names_of: dict[Any, str] | None = None) -> Paths:
    """`Paths` from rows (path, kinds, ages_h, conversions, value, nulls) as PATHS_SQL returns them.

    `names_of` maps the channel keys of the rows (hashes) to names; without it keys are names.
    """
    flat = list(chain.from_iterable(r[0] for r in rows))
    keys = dict.fromkeys(flat)
    if names_of is not None:
        missing = keys.keys() - names_of.keys()
        if missing:
            raise AttributionInputError(f"path channels {sorted(missing)[:3]} have no name")
    name = names_of.__getitem__ if names_of is not None else (lambda k: k)
    names = sorted({name(k) for k in keys})
    index = {n: i for i, n in enumerate(names)}
    code = {k: index[name(k)] for k in keys}
    lengths = np.fromiter(map(len, (r[0] for r in rows)), dtype=np.int64, count=len(rows))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    count = len(flat)
    channel = np.fromiter(map(code.__getitem__, flat), dtype=np.int32, count=count)
    kind = np.fromiter(chain.from_iterable(r[1] for r in rows), dtype=np.uint8, count=count)
    ages = np.fromiter(chain.from_iterable(r[2] for r in rows), dtype=np.float64, count=count) * 3600.0
    counts = np.array([r[3:6] for r in rows], dtype=np.float64).reshape(len(rows), 3)
    return Paths(
        tuple(names),
        offsets,
        channel,
        kind,
        ages,
        np.ascontiguousarray(counts[:, 0]),
        np.ascontiguousarray(counts[:, 1]),
        np.ascontiguousarray(counts[:, 2]),
    )


def paths_from_lists(
    paths: Sequence[Sequence[str]],
    conversions: Sequence[float],
    value: Sequence[float] | None = None,
    nulls: Sequence[float] | None = None,
    kinds: Sequence[Sequence[int]] | None = None,
    ages_h: Sequence[Sequence[float]] | None = None,
) -> Paths:
    """`Paths` from plain lists (tests, examples): kinds default to clicks, ages to 0."""
    n = len(paths)
    rows = [
        (
            list(p),
            list(kinds[i]) if kinds else [CLICK] * len(p),
            list(ages_h[i]) if ages_h else [0] * len(p),
            conversions[i],
            value[i] if value is not None else 0.0,
            nulls[i] if nulls is not None else 0.0,
        )
        for i, p in enumerate(paths)
    ]
    return paths_from_rows(rows[:n])


@dataclass(frozen=True)
class PathBuild:
    """A path build's result: the paths and the totals models cannot credit."""

    paths: Paths
    conversions_in_range: float
    value_in_range: float

    @property
    def direct_conversions(self) -> float:
        """Conversions in range with no touch in their lookback (not credited to any channel)."""
        return max(0.0, self.conversions_in_range - float(self.paths.conversions.sum()))


def build_paths(backend: Backend, by: str, since: int, until: int, window: Window) -> PathBuild:
    """Build the aggregated path table of [since, until) in ClickHouse and load it."""
    check_range(since, until)
    params = path_params(since, until, window)
    rows = backend.execute(paths_query(by), params)
    names_of = {h: n for h, n in backend.execute(channel_names_query(by), params)}
    totals = backend.execute(CONVERSION_TOTALS_SQL, {"since": since, "until": until})
    conv, value = totals[0] if totals else (0, 0.0)
    return PathBuild(paths_from_rows(rows, names_of), float(conv or 0), float(value or 0.0))
