"""ClickHouse as 2 local shards behind a `Distributed` table sharded by user (issue 36, item 3).

Two extra clickhouse-server processes (ports 18810/18811) with a `remote_servers` cluster naming
both; the migrations on each shard; the same simulated market written once into a database of
the single server and once through the `Distributed` tables; paths built on each shard and
merged: the path table, and every model's result on it, equal the single server's.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attribution.migrate import migrate
from attribution.models import MODELS, ModelConfig, attribute
from attribution.paths import Window, build_paths
from attribution.shards import build_paths_sharded
from attribution.sql import DriverBackend
from deploy.cluster import USER_TABLES, LocalCluster, create_distributed, start_shards, stop_shards
from schemas.clients import clickhouse_client
from schemas.settings import Settings
from workloads.attribution_market import (
    AttributionMarketConfig,
    default_outside,
    period,
    raw_columns,
    simulate,
)

pytestmark = [pytest.mark.clickhouse, pytest.mark.slow, pytest.mark.timeout(600)]

CFG = AttributionMarketConfig(seed=11, n_users=3000, outside=default_outside())
WINDOW = Window(click_s=3 * 86400, view_s=86400, gap_s=2 * 86400)
DB = "mn_attr"


def _on(stack: Settings, url: str) -> Settings:
    return stack.model_copy(update={"clickhouse": stack.clickhouse.model_copy(update={"url": url})})


def _write(client: Any, data: Any) -> dict[str, int]:
    backend = DriverBackend(client)
    written = {}
    for table, (cols, columns) in raw_columns(data).items():
        backend.insert_columnar(table, cols, columns)
        written[table] = len(columns[0])
    return written


@pytest.fixture(scope="module")
def cluster(stack: Settings) -> Iterator[dict[str, Any]]:
    base = Path(f"/tmp/mn-ch-{uuid.uuid4().hex[:6]}")
    local = start_shards(base)
    clients: list[Any] = []
    try:
        for shard in local.shards:
            migrate(_on(stack, f"{shard.url}/{DB}"))
        single_settings = _on(stack, f"{stack.clickhouse.url}_mn{uuid.uuid4().hex[:6]}")
        migrate(single_settings)
        single = clickhouse_client(single_settings, single_settings.clickhouse.url.rsplit("/", 1)[1])
        router = local.client(0, settings={"insert_distributed_sync": 1})
        create_distributed(router, local.name, DB, f"{DB}_all")
        router.disconnect()
        router = local.client(0, f"{DB}_all", settings={"insert_distributed_sync": 1})
        shard_clients = [local.client(i, DB) for i in range(len(local.shards))]
        clients = [single, router, *shard_clients]
        data = simulate(CFG)
        produced = _write(single, data)
        assert _write(router, data) == produced
        yield {
            "local": local,
            "single": single,
            "router": router,
            "shards": shard_clients,
            "produced": produced,
        }
        single.execute(f"DROP DATABASE IF EXISTS {single_settings.clickhouse.url.rsplit('/', 1)[1]}")
    finally:
        for c in clients:
            c.disconnect()
        stop_shards(local)
        shutil.rmtree(base, ignore_errors=True)


def test_rows_split_by_user_and_none_lost(cluster: dict[str, Any]) -> None:
    local: LocalCluster = cluster["local"]
    assert len(local.shards) == 2
    for table in USER_TABLES:
        if table not in cluster["produced"]:  # the market's history has none (`views`)
            continue
        single = cluster["single"].execute(f"SELECT count() FROM {table}")[0][0]
        per_shard = [c.execute(f"SELECT count() FROM {table}")[0][0] for c in cluster["shards"]]
        through = cluster["router"].execute(f"SELECT count() FROM {table}")[0][0]
        assert single == cluster["produced"][table] == sum(per_shard) == through, table
        assert all(n > 0 for n in per_shard), (table, per_shard)  # both shards hold users
        users = [
            {u for (u,) in c.execute(f"SELECT DISTINCT user_id FROM {table}")} for c in cluster["shards"]
        ]
        assert not users[0] & users[1], table  # a user lives on one shard only


def test_paths_and_results_per_shard_equal_single_server(cluster: dict[str, Any]) -> None:
    since, until = period(CFG)
    one = build_paths(DriverBackend(cluster["single"]), "slot_campaign", since, until, WINDOW)
    many = build_paths_sharded(
        [DriverBackend(c) for c in cluster["shards"]], "slot_campaign", since, until, WINDOW
    )
    a, b = one.paths, many.paths
    assert a.n > 100 and a.conversions.sum() > 50
    assert a.channels == b.channels
    for name in ("offsets", "channel", "kind", "age_s", "conversions", "nulls"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_allclose(a.value, b.value, rtol=1e-12)
    assert one.conversions_in_range == many.conversions_in_range
    assert one.value_in_range == pytest.approx(many.value_in_range, rel=1e-12)
    config = ModelConfig(seed=3, bootstrap=20)
    for model in MODELS:
        ra, rb = attribute(model, a, config).to_dict(), attribute(model, b, config).to_dict()
        assert _close(ra, rb), model


def _close(a: Any, b: Any) -> bool:
    """Equal JSON-like values, floats up to rounding (a path's value is a sum in another order)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(_close, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return bool(a == pytest.approx(b, rel=1e-9, abs=1e-9, nan_ok=True))
    return bool(a == b)
