"""Path building per shard: each shard of a user-sharded cluster builds its own users' paths.

A path never crosses users, and a `Distributed` table sharded by `cityHash64(user_id)`
(`deploy.cluster`) keeps every impression, click, conversion and outside touch of a user on one
shard, so each shard runs the full path SQL (`attribution.paths.flat_paths_query`) on its local
tables, in parallel, and the coordinator adds up the distinct paths: the same path (same content
hash `pid`) found on two shards is one path whose conversions, value and nulls are the sums. The
merged `PathBuild` is the one a single server holding all the rows builds (sums of floats up to
rounding), so every model's result is too.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from attribution.paths import (
    AttributionInputError,
    PathBuild,
    Window,
    paths_from_columns,
    query_paths,
)
from attribution.sql import Backend

_COLUMNS = 8  # pid, pos, ch, kind, age_h, conversions, value, nulls (FLAT_PATHS_SQL)


@dataclass(frozen=True)
class ShardPaths:
    """One shard's part of a path build: its flat path rows, channel names and conversion totals."""

    columns: tuple[np.ndarray, ...]
    names_of: dict[int, str]
    conversions_in_range: float
    value_in_range: float


def shard_paths(backend: Backend, by: str, since: int, until: int, window: Window) -> ShardPaths:
    """The path rows one shard builds from its local tables (as `build_paths` does on one server)."""
    columns, names_of, conv, value = query_paths(backend, by, since, until, window)
    return ShardPaths(_normal(columns), names_of, conv, value)


def _normal(columns: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    """The 8 flat columns with numeric dtypes (a shard with no rows returns no columns at all)."""
    if not columns or not len(columns[0]):
        dtypes = (np.uint64, np.int64, np.uint64, np.uint8, np.float64, np.float64, np.float64, np.float64)
        return tuple(np.zeros(0, d) for d in dtypes)
    if len(columns) != _COLUMNS:
        raise AttributionInputError(f"a shard returned {len(columns)} path columns, expected {_COLUMNS}")
    pid, pos, ch, kind, age, conv, value, nulls = (np.asarray(c) for c in columns)
    return (
        pid.astype(np.uint64), pos.astype(np.int64), ch.astype(np.uint64), kind.astype(np.uint8),
        age.astype(np.float64), conv.astype(np.float64), value.astype(np.float64), nulls.astype(np.float64),
    )  # fmt: skip


def merge_columns(parts: Sequence[Sequence[np.ndarray]]) -> tuple[np.ndarray, ...]:
    """The flat path rows of all shards as one server would return them: each distinct path (pid)
    once, its touches from one shard, its conversions, value and nulls summed over the shards."""
    cols = [_normal(p) for p in parts]
    if not cols:
        return _normal([])
    pid = np.concatenate([c[0] for c in cols])
    pos = np.concatenate([c[1] for c in cols])
    shard = np.concatenate([np.full(c[0].shape[0], i, dtype=np.int64) for i, c in enumerate(cols)])
    if pid.shape[0] == 0:
        return _normal([])
    counts = [np.concatenate([c[k] for c in cols]) for k in (5, 6, 7)]
    keys, inverse = np.unique(pid, return_inverse=True)
    inverse = inverse.reshape(-1)
    first = pos == 1  # each path's counts ride on every touch row: count one row per shard and path
    sums = [np.bincount(inverse[first], weights=c[first], minlength=keys.shape[0]) for c in counts]
    owner = np.full(keys.shape[0], np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(owner, inverse, shard)  # the touches of a path come from its lowest shard
    keep = shard == owner[inverse]
    merged = [np.concatenate([c[k] for c in cols])[keep] for k in range(5)]
    return (*merged, *(s[inverse[keep]] for s in sums))


def merge_names(parts: Sequence[dict[int, str]]) -> dict[int, str]:
    """Channel key → name over all shards (a key is a hash of the name: it names one channel)."""
    names: dict[int, str] = {}
    for part in parts:
        for key, name in part.items():
            if names.setdefault(key, name) != name:
                raise AttributionInputError(f"channel key {key} names both {names[key]!r} and {name!r}")
    return names


def merge_shards(parts: Sequence[ShardPaths]) -> PathBuild:
    """One `PathBuild` from every shard's part."""
    columns = merge_columns([p.columns for p in parts])
    return PathBuild(
        paths_from_columns(columns, merge_names([p.names_of for p in parts])),
        sum(p.conversions_in_range for p in parts),
        sum(p.value_in_range for p in parts),
    )


def build_paths_sharded(
    shards: Sequence[Backend], by: str, since: int, until: int, window: Window
) -> PathBuild:
    """`build_paths` over a user-sharded cluster: every shard builds its users' paths at once
    (one thread each, waiting on its server), then the parts are merged."""
    if not shards:
        raise AttributionInputError("no shard given")
    with ThreadPoolExecutor(max_workers=len(shards)) as pool:
        parts = list(pool.map(lambda b: shard_paths(b, by, since, until, window), shards))
    return merge_shards(parts)
