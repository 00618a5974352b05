"""attribution.paths.paths_from_columns: the path table is the same whatever order the flat rows
come in (the server's, each path's touches together in position order, takes a shortcut)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from attribution.paths import Paths, paths_from_columns

NAMES = {7: "b", 8: "a", 9: "c"}
# pid, pos, ch, kind, age_h, conversions, value, nulls: one row per touch, as the server sends them
SERVER_ROWS = [
    (30, 1, 7, 0, 5, 1.0, 5.0, 0.0), (30, 2, 7, 1, 3, 1.0, 5.0, 0.0), (30, 3, 9, 1, 0, 1.0, 5.0, 0.0),
    (10, 1, 7, 1, 2, 2.0, 100.0, 1.0), (10, 2, 8, 0, 1, 2.0, 100.0, 1.0),
    (20, 1, 8, 1, 0, 0.0, 0.0, 4.0),
]  # fmt: skip


def columns(rows: Sequence[Sequence[float]]) -> list[np.ndarray]:
    dtypes = (np.uint64, np.uint32, np.uint64, np.uint8, np.uint32, np.uint64, np.float64, np.int64)
    return [np.array([r[k] for r in rows], dtype=d) for k, d in enumerate(dtypes)]


def table(p: Paths) -> tuple[object, ...]:
    return (p.channels, *(getattr(p, f).tolist() for f in
            ("offsets", "channel", "kind", "age_s", "conversions", "value", "nulls")))  # fmt: skip


def test_paths_are_ordered_by_hash_and_touches_by_position() -> None:
    p = paths_from_columns(columns(SERVER_ROWS), NAMES)
    assert p.channels == ("a", "b", "c")
    assert p.offsets.tolist() == [0, 2, 3, 6]  # pid 10, 20, 30
    assert p.channel.tolist() == [1, 0, 0, 1, 1, 2]
    assert p.kind.tolist() == [1, 0, 1, 0, 1, 1]
    assert p.age_s.tolist() == [7200.0, 3600.0, 0.0, 18000.0, 10800.0, 0.0]
    assert (p.conversions.tolist(), p.value.tolist(), p.nulls.tolist()) == (
        [2.0, 0.0, 1.0],
        [100.0, 0.0, 5.0],
        [1.0, 4.0, 0.0],
    )


def test_rows_in_any_order_give_the_same_table() -> None:
    server = table(paths_from_columns(columns(SERVER_ROWS), NAMES))
    rng = np.random.default_rng(0)
    for _ in range(20):
        shuffled = [SERVER_ROWS[i] for i in rng.permutation(len(SERVER_ROWS))]
        assert table(paths_from_columns(columns(shuffled), NAMES)) == server
    # each path's touches together but one path's out of position order
    swapped = [SERVER_ROWS[1], SERVER_ROWS[0], *SERVER_ROWS[2:]]
    assert table(paths_from_columns(columns(swapped), NAMES)) == server
    # a path's touches split by another path's
    split = [SERVER_ROWS[3], SERVER_ROWS[5], SERVER_ROWS[4], *SERVER_ROWS[:3]]
    assert table(paths_from_columns(columns(split), NAMES)) == server
