"""Path building on hand-made events, on the ClickHouse server (18.16) and on chDB alike: what is
a touch, and when. (A twice-clicked impression once gave two click touches on 18.16 and one on
current ClickHouse, whose ANY INNER JOIN keeps one row per key on both sides.)"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse, urlunparse

import pytest

from attribution.migrate import apply_migrations, migrate
from attribution.paths import CLICK, VIEW, Window, build_paths
from attribution.sql import Backend, ChdbBackend, DriverBackend
from schemas.clients import clickhouse_client
from schemas.settings import Settings

pytestmark = [pytest.mark.clickhouse, pytest.mark.timeout(120)]

T0 = 1_790_000_000  # a Tuesday in 2026, on an hour boundary
H = 3600


@pytest.fixture(params=["clickhouse", "chdb"])
def backend(request: pytest.FixtureRequest, stack: Settings) -> Iterator[Backend]:
    """An empty, migrated database on the server or in chDB."""
    tag = f"hand{uuid.uuid4().hex[:6]}"
    if request.param == "chdb":
        embedded = ChdbBackend(tag)
        apply_migrations(embedded)
        yield embedded
        embedded.close()
        return
    url = urlparse(stack.clickhouse.url)
    s = stack.model_copy(
        update={
            "clickhouse": stack.clickhouse.model_copy(
                update={"url": urlunparse(url._replace(path=f"{url.path}_{tag}"))}
            )
        }
    )
    migrate(s)
    name = urlparse(s.clickhouse.url).path.lstrip("/")
    client = clickhouse_client(s, name)
    yield DriverBackend(client)
    client.execute(f"DROP DATABASE IF EXISTS {name}")
    client.disconnect()


def _impression(
    i: int, t: int, slot: str, campaign: str = "c1", render: str | None = None
) -> tuple[Any, ...]:
    """The sink's row of an impression (`streams.sink.row_of`): the table's columns as the
    migrations leave them, so a column a migration adds needs no edit here (hand-listed tuples
    broke at migrations 004 and 007)."""
    from datetime import UTC, datetime

    from schemas.events import Impression
    from streams.sink import row_of

    imp = Impression(event_id=f"i{i}", ts=datetime.fromtimestamp(t, UTC), user_id="u1", request_id=f"r{i}",
                     ad_id=f"{campaign}_ad", campaign_id=campaign, advertiser_id="adv1", slot=slot,  # type: ignore[arg-type]
                     position=0, price=0.5, pctr=0.1, model_version="ranker-1", render=render)  # fmt: skip
    return row_of(imp, 0, i)[1]


def _insert(backend: Backend, imps: list[tuple[Any, ...]], clicks: list[tuple[Any, ...]],
            conversions: list[tuple[Any, ...]]) -> None:  # fmt: skip
    from schemas.events import Click, Conversion, Impression
    from streams.sink import COLUMNS

    for model, rows in ((Impression, imps), (Click, clicks), (Conversion, conversions)):
        table, cols = COLUMNS[model]
        if rows:
            backend.insert(table, (*cols, "kafka_partition", "kafka_offset"), rows)


def test_a_twice_clicked_impression_is_one_click_touch_at_its_first_click(backend: Backend) -> None:
    _insert(
        backend,
        [_impression(1, T0, "feed"), _impression(2, T0 + 2 * H, "search")],
        [  # two clicks on the feed impression (a double click, or a second visit)
            ("k1", T0 + 60, (T0 + 60) * 1000, "u1", "i1", "c1_ad", "c1", 0, 100),
            ("k2", T0 + H, (T0 + H) * 1000, "u1", "i1", "c1_ad", "c1", 0, 101),
        ],
        [("v1", T0 + 3 * H, (T0 + 3 * H) * 1000, "u1", "c1", "adv1", 10.0, None, 0, 200)],
    )
    built = build_paths(backend, "slot", T0 - H, T0 + 10 * H, Window())
    p = built.paths
    assert p.n == 1 and p.conversions.tolist() == [1.0] and p.value.tolist() == [10.0]
    touches = [(p.channels[c], int(k), a / H) for c, k, a in zip(p.channel, p.kind, p.age_s, strict=True)]
    # feed's view 3 h before; its first click 2 h 59 min before (ages are whole hours); search's view
    assert touches == [("feed", VIEW, 3.0), ("feed", CLICK, 2.0), ("search", VIEW, 1.0)]


def test_views_are_shown_impressions_at_their_render_beacon(backend: Backend) -> None:
    """A client-rendered impression is a view only once its render beacon is in `views` (at the
    beacon's time); one never shown is no touch; a server-rendered one is a view when served."""
    from schemas.events import View
    from streams.sink import COLUMNS, row_of

    _insert(
        backend,
        [
            _impression(1, T0, "feed", render="client"),  # shown 30 min later
            _impression(2, T0 + H, "feed", render="client"),  # served, never shown
            _impression(3, T0 + 2 * H, "search", render="server"),
        ],
        [],
        [("v1", T0 + 4 * H, (T0 + 4 * H) * 1000, "u1", "c1", "adv1", 10.0, None, 0, 200)],
    )
    from datetime import UTC, datetime

    view = View(event_id="b1", ts=datetime.fromtimestamp(T0 + H // 2, UTC), user_id="u1", impression_id="i1",
                ad_id="c1_ad")  # fmt: skip
    table, cols = COLUMNS[View]
    backend.insert(table, (*cols, "kafka_partition", "kafka_offset"), [row_of(view, 0, 7)[1]])
    p = build_paths(backend, "slot", T0 - H, T0 + 10 * H, Window()).paths
    touches = [(p.channels[c], int(k), a / H) for c, k, a in zip(p.channel, p.kind, p.age_s, strict=True)]
    assert touches == [("feed", VIEW, 3.0), ("search", VIEW, 2.0)]  # ages in whole hours


def test_no_events_is_an_empty_path_table_not_an_error_here(backend: Backend) -> None:
    built = build_paths(backend, "campaign", T0, T0 + H, Window())
    assert built.paths.n == 0 and built.conversions_in_range == 0


@pytest.mark.parametrize("by", ["slot", "campaign", "slot_campaign"])
def test_channels_are_named_at_each_granularity(backend: Backend, by: str) -> None:
    _insert(
        backend,
        [_impression(1, T0, "feed", "c1"), _impression(2, T0 + H, "search", "c2")],
        [],
        [("v1", T0 + 2 * H, (T0 + 2 * H) * 1000, "u1", "c1", "adv1", 5.0, None, 0, 200)],
    )
    p = build_paths(backend, by, T0 - H, T0 + 10 * H, Window()).paths
    expected = {
        "slot": ("feed", "search"),
        "campaign": ("c1", "c2"),
        "slot_campaign": ("c1:feed", "c2:search"),
    }
    assert p.channels == expected[by]


def test_a_range_without_views_builds_the_same_paths_without_the_views_join(backend: Backend) -> None:
    """No render beacon in range: `build_paths` leaves the views join out (it cost a quarter of
    the path build), and the paths are those of the query with it (a client-rendered impression
    is unshown either way)."""
    import numpy as np

    from attribution.paths import flat_paths_query, path_params

    _insert(
        backend,
        [
            _impression(1, T0, "feed", render="client"),  # never shown: no view in range
            _impression(2, T0 + H, "search", render="server"),
            _impression(3, T0 + 2 * H, "feed"),  # from before render beacons: shown when served
        ],
        [("k1", T0 + 3 * H, (T0 + 3 * H) * 1000, "u1", "i2", "c1_ad", "c1", 0, 9)],
        [("v1", T0 + 4 * H, (T0 + 4 * H) * 1000, "u1", "c1", "adv1", 10.0, None, 0, 200)],
    )
    params = path_params(T0 - H, T0 + 10 * H, Window())
    with_join = backend.execute_columns(flat_paths_query("slot", views=True), params)
    without = backend.execute_columns(flat_paths_query("slot", views=False), params)
    assert len(with_join[0]) == 3  # search view, feed view, search click
    for a, b in zip(with_join, without, strict=True):
        assert np.array_equal(a, b)
    p = build_paths(backend, "slot", T0 - H, T0 + 10 * H, Window()).paths
    assert [(p.channels[c], int(k)) for c, k in zip(p.channel, p.kind, strict=True)] == [
        ("search", VIEW), ("feed", VIEW), ("search", CLICK),
    ]  # fmt: skip
