"""Every attribution migration and query on ClickHouse 18.16 (the server) and on chDB, same rows.

Also: rollups stay right when the sink re-inserts a batch, runs are stored and read back, and
values that reach ClickHouse (here a hostile advertiser id in the lookback overrides) are bound.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any
from urllib.parse import urlparse, urlunparse

import numpy as np
import pytest

from attribution import incrementality, paths, roi, rollups, runs
from attribution.migrate import apply_migrations, migrate, migration_files
from attribution.models import ModelConfig
from attribution.paths import Window, build_paths
from attribution.sql import Backend, ChdbBackend, DriverBackend
from schemas.clients import clickhouse_client
from schemas.holdout import HOLDOUT_AD_ID
from schemas.settings import Settings
from workloads.attribution_market import AttributionMarketConfig, period, simulate, write_raw

pytestmark = [pytest.mark.clickhouse, pytest.mark.timeout(300)]

CFG = AttributionMarketConfig(seed=5, n_users=1500, holdout_share=0.2)
WINDOW = Window(click_s=3 * 86400, view_s=86400, gap_s=2 * 86400)


def own_db(stack: Settings, tag: str) -> Settings:
    url = urlparse(stack.clickhouse.url)
    return stack.model_copy(
        update={
            "clickhouse": stack.clickhouse.model_copy(
                update={"url": urlunparse(url._replace(path=f"{url.path}_{tag}"))}
            )
        }
    )


@pytest.fixture(scope="module")
def engines(stack: Settings) -> Iterator[dict[str, Backend]]:
    """The server (its own database) and chDB, both migrated, both holding the same market."""
    s = own_db(stack, f"attr{uuid.uuid4().hex[:6]}")
    assert migrate(s) == [p.stem for p in migration_files()]
    assert migrate(s) == []  # idempotent
    client = clickhouse_client(s, urlparse(s.clickhouse.url).path.lstrip("/"))
    server = DriverBackend(client)
    chdb = ChdbBackend(f"attr_{uuid.uuid4().hex[:6]}")
    assert apply_migrations(chdb) == [p.stem for p in migration_files()]
    assert apply_migrations(chdb) == []
    data = simulate(CFG)
    for backend in (server, chdb):
        write_raw(backend, data)
        write_outside(backend, data)
    yield {"clickhouse": server, "chdb": chdb}
    client.execute(f"DROP DATABASE IF EXISTS {urlparse(s.clickhouse.url).path.lstrip('/')}")
    client.disconnect()


OUTSIDE = (("google", "cpc", "brand", "click"), ("newsletter", "email", None, "view"),
           ("facebook", "social", None, "click"))  # fmt: skip
OUTSIDE_SPEND = 3 * 14 * 5.0  # three channels, every day of the period, 5.0 a day


def write_outside(backend: Backend, data: Any) -> None:
    """Outside touches (`Touch`, as the streams sink writes them) before some conversions and at
    random times (null journeys), and their daily spend, imported as `adstream spend import` does."""
    from datetime import UTC, datetime, timedelta

    from attribution.spend import SpendRow, import_spend
    from schemas.events import Touch
    from streams.sink import COLUMNS, row_of

    rng = np.random.default_rng(4)
    conv_users, conv_t = data.conv["user"], data.conv["t"]
    n = conv_t.shape[0]
    users = np.concatenate([conv_users, rng.integers(0, CFG.n_users, 200)])
    times = np.concatenate([conv_t - rng.uniform(60, 20 * 3600, n), rng.uniform(0, CFG.days * 86400, 200)])
    touches = []
    for i, (u, t) in enumerate(zip(users.tolist(), times.tolist(), strict=True)):
        source, medium, campaign, interaction = OUTSIDE[i % len(OUTSIDE)]
        touches.append(Touch(
            event_id=f"ot{i}", ts=datetime.fromtimestamp(CFG.start + max(t, 0.0), UTC), user_id=f"u{u:06d}",
            advertiser_id=CFG.advertiser_id, source=source, medium=medium, campaign=campaign,
            interaction=interaction,  # type: ignore[arg-type]
        ))  # fmt: skip
    table, cols = COLUMNS[Touch]
    backend.insert(
        table, (*cols, "kafka_partition", "kafka_offset"), [row_of(t, 0, i)[1] for i, t in enumerate(touches)]
    )
    first = datetime.fromtimestamp(CFG.start, UTC).date()
    import_spend(backend, [
        SpendRow(first + timedelta(days=d), CFG.advertiser_id, source, medium, campaign or "", 5.0)
        for d in range(int(CFG.days)) for source, medium, campaign, _ in OUTSIDE
    ], version=1)  # fmt: skip


def normal(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Rows comparable across engines: datetimes as epoch strings, floats rounded, sorted."""

    def cell(v: Any) -> Any:
        if isinstance(v, datetime):
            return v.strftime("%Y-%m-%d %H:%M:%S")
        if isinstance(v, float):
            return round(v, 6)
        if isinstance(v, list):
            return tuple(cell(x) for x in v)
        return v

    return sorted((tuple(cell(v) for v in row) for row in rows), key=repr)


def both(engines: dict[str, Backend], sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    a = normal(engines["clickhouse"].execute(sql, params))
    b = normal(engines["chdb"].execute(sql, params))
    assert a == b
    return a


@pytest.mark.parametrize("by", ["slot", "campaign", "slot_campaign"])
def test_path_building_agrees_on_both_engines(engines: dict[str, Backend], by: str) -> None:
    since, until = period(CFG)
    rows = both(engines, paths.paths_query(by), paths.path_params(since, until, WINDOW))
    assert rows and sum(r[3] for r in rows) > 0 and sum(r[5] for r in rows) > 0  # conversions and nulls
    names = both(engines, paths.channel_names_query(by), paths.path_params(since, until, WINDOW))
    outside = {"slot": {"google/cpc", "newsletter/email", "facebook/social"}}.get(
        by, {"google/cpc/brand", "newsletter/email", "facebook/social"}
    )
    assert outside <= {r[1] for r in names}
    built = build_paths(engines["chdb"], by, since, until, WINDOW)
    # outside touches sit on converting paths beside own channels
    conv = built.paths.conversions[built.paths.path_of_touch] > 0
    assert outside <= {built.paths.channels[c] for c in built.paths.channel[conv]}
    assert built.paths.conversions.sum() + built.direct_conversions == pytest.approx(
        built.conversions_in_range
    )


def test_paths_respect_lookbacks_and_reset(engines: dict[str, Backend]) -> None:
    since, until = period(CFG)
    p = build_paths(engines["clickhouse"], "slot_campaign", since, until, WINDOW).paths
    conv = p.conversions[p.path_of_touch] > 0
    ages, kinds = p.age_s[conv], p.kind[conv]
    assert ages[kinds == 0].max() < 86400 and ages[kinds == 1].max() < 3 * 86400
    assert not any(c.startswith(HOLDOUT_AD_ID) for c in p.channels)


def path_table(backend: Backend) -> tuple[Any, ...]:
    since, until = period(CFG)
    p = build_paths(backend, "slot_campaign", since, until, WINDOW).paths
    return (p.channels, p.offsets.tolist(), p.channel.tolist(), p.kind.tolist(), p.age_s.tolist(),
            p.conversions.tolist(), p.value.round(6).tolist(), p.nulls.tolist())  # fmt: skip


def test_rollups_and_paths_survive_a_reinserted_batch(engines: dict[str, Backend]) -> None:
    since, until = period(CFG)
    data = simulate(CFG)
    served = ~data.imp["holdout"]
    for name, backend in engines.items():
        rollups.refresh_rollups(backend, since, until)
        once = normal(backend.execute(rollups.ROLLUP_TOTALS_SQL, {"since": since, "until": until}))
        paths_once = path_table(backend)
        write_raw(backend, data)  # the sink re-inserts every batch after a crash
        raw = backend.execute("SELECT count() FROM impressions", {})[0][0]
        assert raw == 2 * data.imp["t"].shape[0]  # the duplicates are really there
        rollups.refresh_rollups(backend, since, until)
        rollups.refresh_rollups(backend, since, until)  # and refreshing again changes nothing
        twice = normal(backend.execute(rollups.ROLLUP_TOTALS_SQL, {"since": since, "until": until}))
        assert once == twice, name
        assert path_table(backend) == paths_once, name  # every touch and conversion still once
        assert sum(r[2] for r in twice) == int(served.sum())
        assert sum(r[3] for r in twice) == data.clk["t"].shape[0]
        assert sum(r[5] for r in twice) == data.conv["t"].shape[0]
        assert sum(r[4] for r in twice) == pytest.approx(float(data.spend().sum()))
    both(engines, rollups.ROLLUP_SQL, {"since": since, "until": until})


def test_spend_lift_and_runs_agree_and_round_trip(engines: dict[str, Backend]) -> None:
    since, until = period(CFG)
    params = {"since": since, "until": until, "holdout": HOLDOUT_AD_ID}
    spend = both(engines, roi.spend_query("slot_campaign"), roi.spend_params(since, until))
    assert sum(r[1] for r in spend) == pytest.approx(float(simulate(CFG).spend().sum()) + OUTSIDE_SPEND)
    assert {r[0] for r in spend} >= {"google/cpc/brand", "newsletter/email", "facebook/social"}
    lift = both(engines, incrementality.LIFT_SQL, {**params, "window": 7 * 86400})
    assert {r[1] for r in lift} == {0, 1}
    for backend in engines.values():
        run = runs.run_attribution(
            backend, models=["last_click", "shapley"], by="campaign", since=since, until=until,
            window=WINDOW, config=ModelConfig(bootstrap=5), calibrate_holdout=True,
        )  # fmt: skip
        runs.store_run(backend, run)
        assert backend.execute(runs.LATEST_RUN_SQL, {"granularity": "campaign"})[0][0] == run.run_id
        rows = backend.execute(runs.RUN_RESULTS_SQL, {"run_id": run.run_id})
        per_model: dict[str, float] = {}
        for r in rows:
            per_model[r[0]] = per_model.get(r[0], 0.0) + r[2]
        total = float(run.build.paths.conversions.sum())
        assert set(per_model) == {"last_click", "shapley", "last_click+holdout", "shapley+holdout"}
        assert all(v == pytest.approx(total) for v in per_model.values())
        assert backend.execute(runs.RUNS_SQL, {"limit": 5})


def test_holdout_design_agrees_on_both_engines(engines: dict[str, Backend]) -> None:
    """The per-user, per-slot exposure rows behind per-slot lifts and interactions
    (attribution.channel_lift.DOSE_SQL): same rows on both engines, and each campaign's
    per-slot lift accounts for the exposed users' served impressions."""
    from attribution.channel_lift import DOSE_SQL, measure_design

    since, until = period(CFG)
    rows = both(
        engines, DOSE_SQL, {"since": since, "until": until, "holdout": HOLDOUT_AD_ID, "window": 7 * 86400}
    )
    assert {r[2] for r in rows} == {0, 1}
    data = simulate(CFG)
    served = ~data.imp["holdout"]
    design = measure_design(engines["chdb"], since, until)
    assert set(design.channels) == {c.campaign_id for c in CFG.campaigns}
    assert sum(float(c.exposed_impressions.sum()) for c in design.channels.values()) == served.sum()
    assert design.interactions and all(se > 0 for _, se in design.interactions.values())


def test_user_values_are_bound_parameters(engines: dict[str, Backend]) -> None:
    since, until = period(CFG)
    hostile = "adv'; DROP TABLE impressions; --"
    window = Window(by_advertiser=((hostile, 60, 60), ("adv_attr", 60, 60)))
    for backend in engines.values():
        short = build_paths(backend, "campaign", since, until, window).paths
        assert backend.execute("SELECT count() FROM impressions", {})[0][0] > 0
        long = build_paths(backend, "campaign", since, until, WINDOW).paths
        # the per-advertiser override (1-minute lookbacks) really applied
        assert short.conversions.sum() < long.conversions.sum()
        assert np.all(short.age_s[short.conversions[short.path_of_touch] > 0] < 3600)


def test_a_seeded_run_is_the_same_on_both_engines(engines: dict[str, Backend]) -> None:
    """Rows come back in no set order; the bootstrap resamples by position: CIs must not care."""
    since, until = period(CFG)
    runs_by_engine = [
        runs.run_attribution(
            backend,
            models=["linear", "shapley"],
            by="campaign",
            since=since,
            until=until,
            window=WINDOW,
            config=ModelConfig(bootstrap=20, seed=3),
        )
        for backend in engines.values()
    ]
    a, b = (r.results for r in runs_by_engine)
    for model in ("linear", "shapley"):
        np.testing.assert_allclose(a[model].conversions, b[model].conversions)
        np.testing.assert_allclose(a[model].ci_low, b[model].ci_low)
        np.testing.assert_allclose(a[model].ci_high, b[model].ci_high)
