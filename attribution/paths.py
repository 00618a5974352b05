"""Conversion paths built in ClickHouse, aggregated to distinct paths × counts for the models.

Per user and advertiser, the touchpoints are the advertiser's shown impressions (kind 0, a view:
served and then rendered, `schemas.billing`) and
the clicks on them (kind 1), and the touches on outside channels (`Touch`: source / medium /
campaign, a click or a view; `OUTSIDE_SQL` names them), ordered by time. Each conversion takes
the touches after the user's previous conversion (a path resets after each one) that lie inside
their kind's lookback (click 7 d, view 1 d by default; per advertiser through
`attribution.lookback_by_advertiser`). A journey without conversion is closed once no touch
or conversion follows its last touch within `attribution.journey_gap_s` (for the last touch:
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
from enum import StrEnum
from itertools import chain
from typing import Any

import numpy as np

from attribution.sql import Backend
from schemas.errors import AdstreamError
from schemas.holdout import HOLDOUT_AD_ID
from schemas.settings import Settings


class Granularity(StrEnum):
    """What a channel is (`--by`): a slot, a campaign, or a campaign in a slot."""

    slot = "slot"
    campaign = "campaign"
    slot_campaign = "slot_campaign"


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

# An outside channel (a `Touch`: source / medium / campaign, UTM style) at each granularity: the
# source and medium at `slot` (the kind of channel), with the campaign at the campaign levels.
# Its key hashes a marker with the name, so it never equals an own channel's key.
_OUTSIDE_CAMPAIGN = "if(ifNull(campaign, '') = '', '', concat('/', ifNull(campaign, '')))"
OUTSIDE_SQL: dict[str, str] = {
    "slot": "concat(source, '/', medium)",
    "campaign": f"concat(source, '/', medium, {_OUTSIDE_CAMPAIGN})",
    "slot_campaign": f"concat(source, '/', medium, {_OUTSIDE_CAMPAIGN})",
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


def outside_sql(by: str) -> str:
    """The SQL expression of an outside touch's channel name (over `touches` or `outside_spend`)."""
    channel_sql(by)
    return OUTSIDE_SQL[by]


def outside_key_sql(by: str) -> str:
    """The 64-bit key of an outside touch's channel for granularity `by`."""
    return f"cityHash64('outside', {outside_sql(by)})"


# The touches of every (user, advertiser) in [lo, until), sorted by (time, kind, channel): one
# pass over the impressions (from a day before `lo`, so that a click in range on an earlier
# impression is found), each a view when it was shown in range (`schemas.billing`: at its first
# render beacon, `views`, or when served for a slot rendered on the server or an impression from
# before render beacons; a served ad never shown is no view), plus a click at the time of its first
# click in range (a click's channel is its impression's). The clicks are a small hash table, keyed
# by impression; the first click keeps it deterministic on every engine, and a second click on
# the same impression is the same touchpoint. The outside touches (`touches`) join them as a
# view (t) or a click (tc) each, the other time 0 (out of range, as an unclicked impression's tc).
# A (user, advertiser) is grouped by its 64-bit key `u` (`cityHash64(user_id, advertiser_id)`, as
# channels and paths are keyed by hashes): a UInt64 key groups and joins the conversions much
# faster than the two strings, and the touches are gathered as plain numeric arrays (a tuple
# array is gathered value by value) and zipped into (time, kind, channel) tuples only to sort
# them; together these cut the server's CPU time for the path query by about 40 % on the
# benchmark's market (benchmarks/attribution.py).
_TOUCHES = """
SELECT u, any(advertiser_id) AS adv,
       groupArrayIf(t, t >= %(lo)s) AS tv_ts, groupArrayIf(ch, t >= %(lo)s) AS tv_ch,
       groupArrayIf(tc, tc >= %(lo)s) AS tk_ts, groupArrayIf(ch, tc >= %(lo)s) AS tk_ch,
       arraySort(arrayConcat(arrayMap((a, b) -> (a, toUInt8(0), b), tv_ts, tv_ch),
                             arrayMap((a, b) -> (a, toUInt8(1), b), tk_ts, tk_ch))) AS tt,
       arrayMap(x -> x.1, tt) AS t_ts, arrayMap(x -> x.2, tt) AS t_kind, arrayMap(x -> x.3, tt) AS t_ch
FROM (
    SELECT cityHash64(user_id, advertiser_id) AS u, advertiser_id, t, ch, tc
    FROM (
{shown}
    ) AS i ANY LEFT JOIN (
        SELECT impression_id AS event_id, min(toUInt32(ts)) AS tc FROM clicks FINAL
        WHERE ts >= toDateTime(%(lo)s) AND ts < toDateTime(%(until)s)
        GROUP BY impression_id
    ) AS c USING event_id
    UNION ALL
    SELECT cityHash64(user_id, advertiser_id) AS u, advertiser_id,
           if(interaction = 'view', toUInt32(ts), toUInt32(0)) AS t,
           {outside_key} AS ch, if(interaction = 'view', toUInt32(0), toUInt32(ts)) AS tc
    FROM touches FINAL
    WHERE ts >= toDateTime(%(lo)s) AND ts < toDateTime(%(until)s)
)
GROUP BY u
HAVING notEmpty(tt)
"""

# The impressions' shown times (`_TOUCHES`' `{shown}`): served for a slot rendered on the server,
# else at the first view (`views`); without views in range every client-rendered impression is
# unshown (time 0), which is what the join gives then, without paying for it (a 24 % slower path
# build on a million impressions with an empty `views`: benchmarks/attribution.py).
_SHOWN_WITH_VIEWS = """
        SELECT user_id, advertiser_id, if(on_serve, ts_served, tv) AS t, ch, event_id
        FROM (
            SELECT user_id, advertiser_id, toUInt32(ts) AS ts_served, {key} AS ch, event_id,
                   ifNull(render, '') != 'client' AS on_serve
            FROM impressions FINAL
            WHERE ts >= toDateTime(%(imp_lo)s) AND ts < toDateTime(%(until)s) AND ad_id != %(holdout)s
        ) AS s ANY LEFT JOIN (
            SELECT impression_id AS event_id, min(toUInt32(ts)) AS tv FROM views FINAL
            WHERE ts >= toDateTime(%(imp_lo)s) AND ts < toDateTime(%(until)s)
            GROUP BY impression_id
        ) AS v USING event_id"""
_SHOWN_NO_VIEWS = """
        SELECT user_id, advertiser_id,
               if(ifNull(render, '') != 'client', toUInt32(ts), toUInt32(0)) AS t, {key} AS ch, event_id
        FROM impressions FINAL
        WHERE ts >= toDateTime(%(imp_lo)s) AND ts < toDateTime(%(until)s) AND ad_id != %(holdout)s"""
VIEWS_IN_RANGE_SQL = (
    "SELECT count() FROM views WHERE ts >= toDateTime(%(imp_lo)s) AND ts < toDateTime(%(until)s)"
)

# Channels travel through the path SQL as 64-bit keys (cheaper to sort, copy and group than
# strings); this names them. Distinct (campaign, slot) pairs first: a re-inserted row adds no
# pair, so no FINAL is needed, and the name is built once per pair, not per impression. The
# pairs are grouped by their hash (the slot × campaign key), each taking its strings by any():
# a UInt64 key where DISTINCT kept both strings as its key (half the query's CPU time on the
# benchmark's market). The new names may not be the old ones (18.16 refuses `any(x) AS x`).
CHANNEL_NAMES_SQL = """
SELECT h, any(name) AS name
FROM (
    SELECT {key} AS h, {ch} AS name
    FROM (
        SELECT pair_campaign AS campaign_id, pair_slot AS slot
        FROM (
            SELECT any(campaign_id) AS pair_campaign, any(slot) AS pair_slot FROM impressions
            WHERE ts >= toDateTime(%(lo)s) AND ts < toDateTime(%(until)s) AND ad_id != %(holdout)s
            GROUP BY cityHash64(campaign_id, slot)
        )
    )
    UNION ALL
    SELECT {outside_key} AS h, {outside} AS name
    FROM (
        SELECT DISTINCT source, medium, campaign FROM touches
        WHERE ts >= toDateTime(%(lo)s) AND ts < toDateTime(%(until)s)
    )
)
GROUP BY h
"""

# Conversions of every (user, advertiser) in [lo, until) (earlier ones only reset paths), keyed
# as `_TOUCHES` keys them.
_CONVERSIONS = """
SELECT cityHash64(user_id, advertiser_id) AS u,
       arraySort(groupArray((toUInt32(ts), value, event_id))) AS cc,
       arrayMap(x -> x.1, cc) AS c_ts, arrayMap(x -> x.2, cc) AS c_val
FROM conversions FINAL
WHERE ts >= toDateTime(%(lo)s) AND ts < toDateTime(%(until)s)
GROUP BY u
"""

# Per user: the conversions and the journey ends sorted in time; each event takes the touches
# after the event before it (e_prev) up to itself: a conversion those inside their kind's
# lookback, a journey end all of them (its null path). Which touches an event takes is computed
# once per event (`keep`) and the three arrays filtered by it.
PATHS_SQL = """
SELECT path, kinds, ages, sum(is_conv) AS conversions, sum(if(is_conv = 1, e_val, 0.)) AS value,
       sum(1 - is_conv) AS nulls
FROM (
    SELECT
        arrayMap((t, k) -> t <= e_ts AND t > e_prev
                 AND (e_null = 1 OR toInt64(e_ts) - t <= if(k = 1, e_cw, e_vw)), t_ts, t_kind) AS keep,
        arrayFilter((c, m) -> m, t_ch, keep) AS path,
        arrayFilter((k, m) -> m, t_kind, keep) AS kinds,
        arrayMap(t -> toUInt32(intDiv(toInt64(e_ts) - t, 3600)),
                 arrayFilter((t, m) -> m, t_ts, keep)) AS ages,
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
                   -- per touch, the time of the next touch or conversion (a conversion in the same
                   -- second comes after it): touches and conversions are each sorted already
                   arrayPushBack(c_ts, toUInt32(%(until)s)) AS c_until,
                   arrayMap((t, nt) -> least(nt, arrayFirst(c -> c >= t, c_until)),
                            t_ts, arrayPushBack(arrayPopFront(t_ts), toUInt32(%(until)s))) AS t_next,
                   arraySort(arrayConcat(
                       arrayMap((t, v) -> (t, toUInt8(0), v), c_ts, c_val),
                       arrayMap(t -> (t, toUInt8(1), 0.), arrayFilter(
                           (t, nt) -> toInt64(nt) - t >= %(gap)s, t_ts, t_next)))) AS ev
            FROM (
                SELECT t_ts, t_kind, t_ch, c_ts, c_val,
                       transform(adv, %(advertisers)s, %(click_ws)s, %(click_w)s) AS cw,
                       transform(adv, %(advertisers)s, %(view_ws)s, %(view_w)s) AS vw
                FROM ({touches}) AS t ANY LEFT JOIN ({conversions}) AS c USING u
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
"""

# The same paths, one row per touch (the driver decodes flat numeric columns without a Python
# object per value): each touch with its path's content hash (`pid`: unique per distinct path,
# the same on every engine, so paths are ordered by it) and position, and the path's counts.
# The hash is taken once per path, and the touches are the ARRAY JOIN's own elements (not
# `path[pos]` on a path copied to each of its touches).
FLAT_PATHS_SQL = """
SELECT pid, pos, ch, kind, age_h, conversions, value, nulls
FROM (
    SELECT cityHash64(path, kinds, ages) AS pid, path, kinds, ages, conversions, value, nulls
    FROM ({paths})
)
ARRAY JOIN arrayEnumerate(path) AS pos, path AS ch, kinds AS kind, ages AS age_h
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
            click_s=s.attribution.click_lookback_s,
            view_s=s.attribution.view_lookback_s,
            gap_s=s.attribution.journey_gap_s,
            by_advertiser=tuple(
                (adv, int(c), int(v)) for adv, (c, v) in sorted(s.attribution.lookback_by_advertiser.items())
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


def paths_query(by: str, views: bool = True) -> str:
    """The full path-building SQL at granularity `by` (placeholders as in `path_params`);
    `views=False` when the range has no view beacons (`VIEWS_IN_RANGE_SQL`): the same paths
    without the join that finds them."""
    shown = (_SHOWN_WITH_VIEWS if views else _SHOWN_NO_VIEWS).format(key=channel_key_sql(by))
    touches = _TOUCHES.format(shown=shown, outside_key=outside_key_sql(by))
    return PATHS_SQL.format(touches=touches, conversions=_CONVERSIONS)


def flat_paths_query(by: str, views: bool = True) -> str:
    """`paths_query(by, views)` one row per touch (columns as `paths_from_columns` takes them)."""
    return FLAT_PATHS_SQL.format(paths=paths_query(by, views))


def channel_names_query(by: str) -> str:
    """Channel hash → name at granularity `by` (same placeholders as `paths_query`)."""
    return CHANNEL_NAMES_SQL.format(
        ch=channel_sql(by), key=channel_key_sql(by), outside=outside_sql(by), outside_key=outside_key_sql(by)
    )


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

    def touched(self) -> Paths:
        """Only the paths with at least one touch (an empty path is a conversion or journey no
        touchpoint preceded: no channel can be credited with it)."""
        return self if bool(np.all(self.lengths > 0)) else self.select(self.lengths > 0)

    def select(self, mask: np.ndarray) -> Paths:
        idx = np.flatnonzero(mask)
        lengths = self.lengths[idx]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        # each kept touch: its path's old start plus its position in the path (empty paths: none)
        touch = np.repeat(self.offsets[idx] - offsets[:-1], lengths) + np.arange(int(offsets[-1]))
        return Paths(
            self.channels, offsets, self.channel[touch], self.kind[touch], self.age_s[touch],
            self.conversions[idx], self.value[idx], self.nulls[idx],
        )  # fmt: skip


def _paths_from_rows(rows: Sequence[Sequence[Any]]) -> Paths:
    """`Paths` from rows (channel names, kinds, ages_h, conversions, value, nulls), in row order."""
    flat = list(chain.from_iterable(r[0] for r in rows))
    names = sorted(set(flat))
    code = {n: i for i, n in enumerate(names)}
    lengths = np.fromiter(map(len, (r[0] for r in rows)), dtype=np.int64, count=len(rows))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    count = len(flat)
    channel = np.fromiter(map(code.__getitem__, flat), dtype=np.int32, count=count)
    kind = np.fromiter(chain.from_iterable(r[1] for r in rows), dtype=np.uint8, count=count)
    ages = np.fromiter(chain.from_iterable(r[2] for r in rows), dtype=np.float64, count=count) * 3600.0
    return Paths(
        tuple(names),
        offsets,
        channel,
        kind,
        ages,
        np.fromiter((r[3] for r in rows), dtype=np.float64, count=len(rows)),
        np.fromiter((r[4] for r in rows), dtype=np.float64, count=len(rows)),
        np.fromiter((r[5] for r in rows), dtype=np.float64, count=len(rows)),
    )


def _touch_order(pid: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The row order that sorts the flat rows by (pid, pos). The server returns each path's
    touches together and in position order (one ARRAY JOIN of its arrays), so only the paths'
    first rows need sorting, by pid: a tenth of the rows, where a lexsort of every row took two
    thirds of the path table's assembly. Rows in any other order (a shard merge) are lexsorted."""
    n = pid.shape[0]
    starts = np.flatnonzero(pos == 1)
    if starts.shape[0] and starts[0] == 0:
        lengths = np.diff(np.append(starts, n))
        run_start = np.repeat(starts, lengths)
        by_pid = np.argsort(pid[starts], kind="stable")
        sorted_pid = pid[starts][by_pid]
        if (
            np.array_equal(pos, np.arange(1, n + 1) - run_start)
            and np.array_equal(pid, pid[run_start])
            and not np.any(sorted_pid[1:] == sorted_pid[:-1])
        ):
            moved = lengths[by_pid]
            new_start = np.concatenate([[0], np.cumsum(moved)[:-1]])
            return np.repeat(starts[by_pid] - new_start, moved) + np.arange(n)
    return np.lexsort((pos, pid))


def paths_from_columns(columns: Sequence[np.ndarray], names_of: dict[int, str]) -> Paths:
    """`Paths` from the columns of `FLAT_PATHS_SQL` (pid, pos, ch, kind, age_h, conversions,
    value, nulls; one row per touch, any order): paths ordered by their content hash, touches
    by position, channels named by `names_of` (channel key → name)."""
    if not columns or not len(columns[0]):  # no rows (the driver then returns no columns at all)
        columns = [np.zeros(0)] * 8
    pid, pos, ch, kind, age_h, conv, value, nulls = (np.asarray(c) for c in columns)
    if pid.shape[0] == 0:
        empty = np.zeros(0)
        return Paths(
            (), np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.uint8),
            empty, empty, empty, empty,
        )  # fmt: skip
    order = _touch_order(pid.astype(np.uint64), pos.astype(np.int64))
    pid, ch = pid[order].astype(np.uint64), ch[order].astype(np.uint64)
    first = np.flatnonzero(np.concatenate([[True], pid[1:] != pid[:-1]]))
    offsets = np.concatenate([first, [pid.shape[0]]]).astype(np.int64)
    import pandas as pd  # factorize: a hash table of the few keys, where np.unique sorted every touch's

    inverse, uniques = pd.factorize(ch)
    keys = np.sort(np.asarray(uniques, dtype=np.uint64))
    inverse = np.searchsorted(keys, np.asarray(uniques, dtype=np.uint64))[inverse]
    missing = [int(k) for k in keys if int(k) not in names_of]
    if missing:
        raise AttributionInputError(f"path channels {missing[:3]} have no name")
    names = sorted({names_of[int(k)] for k in keys})
    index = {n: i for i, n in enumerate(names)}
    code = np.array([index[names_of[int(k)]] for k in keys], dtype=np.int32)
    at = order[first]  # one touch of each path carries its counts
    return Paths(
        tuple(names), offsets, code[inverse.reshape(-1)], kind[order].astype(np.uint8),
        age_h[order].astype(np.float64) * 3600.0, conv[at].astype(np.float64),
        value[at].astype(np.float64), nulls[at].astype(np.float64),
    )  # fmt: skip


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
    return _paths_from_rows(rows[:n])


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


def query_paths(
    backend: Backend, by: str, since: int, until: int, window: Window
) -> tuple[tuple[np.ndarray, ...], dict[int, str], float, float]:
    """The path rows of [since, until) as ClickHouse builds them (flat columns), the channel
    names by hash, and the range's conversions and value: what `build_paths` loads, and what each
    shard of a cluster answers (`attribution.shards`)."""
    check_range(since, until)
    params = path_params(since, until, window)
    views = bool(backend.execute(VIEWS_IN_RANGE_SQL, params)[0][0])
    columns = backend.execute_columns(flat_paths_query(by, views), params)
    names_of = {int(h): n for h, n in backend.execute(channel_names_query(by), params)}
    totals = backend.execute(CONVERSION_TOTALS_SQL, {"since": since, "until": until})
    conv, value = totals[0] if totals else (0, 0.0)
    return tuple(columns), names_of, float(conv or 0), float(value or 0.0)


def build_paths(backend: Backend, by: str, since: int, until: int, window: Window) -> PathBuild:
    """Build the aggregated path table of [since, until) in ClickHouse and load it."""
    columns, names_of, conv, value = query_paths(backend, by, since, until, window)
    return PathBuild(paths_from_columns(columns, names_of), conv, value)
