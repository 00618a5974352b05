"""attribution.shards: merging per-shard path rows gives the rows one server holding all returns."""

from __future__ import annotations

import numpy as np
import pytest

from attribution.paths import AttributionInputError, paths_from_columns
from attribution.shards import ShardPaths, merge_columns, merge_names, merge_shards

# flat path rows: pid, pos, ch, kind, age_h, conversions, value, nulls (one row per touch)
PATH_A = [(10, 1, 7, 1, 2.0), (10, 2, 8, 0, 1.0)]  # two touches
PATH_B = [(20, 1, 8, 1, 0.0)]
PATH_C = [(30, 1, 7, 0, 5.0), (30, 2, 7, 1, 3.0), (30, 3, 8, 1, 0.0)]


def rows(*paths: tuple[list[tuple[int, int, int, int, float]], float, float, float]) -> list[np.ndarray]:
    flat = [(*t, conv, value, nulls) for touches, conv, value, nulls in paths for t in touches]
    return [np.array([r[k] for r in flat]) for k in range(8)]


def test_a_path_on_two_shards_is_one_path_with_summed_counts() -> None:
    shard0 = rows((PATH_A, 2.0, 100.0, 1.0), (PATH_B, 1.0, 10.0, 0.0))
    shard1 = rows((PATH_C, 1.0, 5.0, 0.0), (PATH_A[::-1], 3.0, 30.0, 2.0))  # rows in any order
    single = rows((PATH_B, 1.0, 10.0, 0.0), (PATH_A, 5.0, 130.0, 3.0), (PATH_C, 1.0, 5.0, 0.0))
    names = {7: "slot_a|c1", 8: "slot_b|c2"}
    merged = paths_from_columns(merge_columns([shard0, shard1]), names)
    one = paths_from_columns(single, names)
    assert merged.n == 3
    for field in ("offsets", "channel", "kind", "age_s", "conversions", "value", "nulls"):
        np.testing.assert_array_equal(getattr(merged, field), getattr(one, field), err_msg=field)
    assert merged.channels == one.channels


def test_empty_shards_merge_to_the_others() -> None:
    shard = rows((PATH_B, 1.0, 10.0, 0.0))
    merged = merge_columns([[], shard, [np.zeros(0)] * 8])
    np.testing.assert_array_equal(merged[0], [20])
    np.testing.assert_array_equal(merged[5], [1.0])
    assert merge_columns([[], []])[0].shape == (0,)
    assert merge_columns([])[0].shape == (0,)


def test_totals_add_up_and_names_join() -> None:
    build = merge_shards(
        [
            ShardPaths(tuple(rows((PATH_B, 1.0, 10.0, 0.0))), {8: "b"}, 3.0, 30.0),
            ShardPaths(tuple(rows((PATH_B, 2.0, 20.0, 1.0))), {8: "b", 7: "a"}, 4.0, 40.0),
        ]
    )
    assert (build.conversions_in_range, build.value_in_range) == (7.0, 70.0)
    assert build.paths.n == 1 and build.paths.conversions.tolist() == [3.0]
    assert build.direct_conversions == 4.0


def test_a_key_naming_two_channels_is_refused() -> None:
    with pytest.raises(AttributionInputError, match="names both"):
        merge_names([{1: "a"}, {1: "b"}])


def test_a_shard_with_wrong_columns_is_refused() -> None:
    with pytest.raises(AttributionInputError, match="3 path columns"):
        merge_columns([[np.ones(2)] * 3])
