"""Freshness on the running loop: a produced click reaches a served adapter version that learned it.

Runs `benchmarks/freshness.py` small (worker, trainer and Serve app as processes, background
closed-loop traffic): every trial's click must be found as its training example, inside a
published delta (`AdapterDelta.learned_offsets`), and then in a response's `adapter_version`.
Timing is the benchmark's business; here only that each hop happened, in order. Slow (minutes).
"""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from schemas.settings import Settings

pytestmark = [
    pytest.mark.slow,
    pytest.mark.kafka,
    pytest.mark.redis,
    pytest.mark.clickhouse,
    pytest.mark.ray,
    pytest.mark.timeout(1500),
]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "freshness.py"


def _freshness():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("freshness_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _clean(run_dir: str, stack: Settings) -> None:
    """Drop what the run created (topics, database, Redis keys, its folder)."""
    from clickhouse_driver import Client

    from deploy.stack import delete_topics_async
    from schemas.clients import clickhouse_args, clickhouse_database

    run_id = run_dir.rstrip("/").rsplit("/", 1)[-1]
    s = Settings(
        topic_prefix=f"demo{run_id}.",
        kafka={"bootstrap": stack.kafka.bootstrap},
        clickhouse={"url": stack.clickhouse.url.rsplit("/", 1)[0] + f"/demo_{run_id}"},
    )
    asyncio.run(delete_topics_async(s))
    admin = Client(**clickhouse_args(s))
    admin.execute(f"DROP DATABASE IF EXISTS {clickhouse_database(s)}")
    admin.disconnect()
    import redis

    rc = redis.Redis.from_url(stack.redis.url)
    keys = list(rc.scan_iter(match=f"adstream-demo:{run_id}:*", count=1000))
    if keys:
        rc.delete(*keys)
    rc.close()
    shutil.rmtree(run_dir, ignore_errors=True)


def test_every_click_reaches_a_served_version_that_learned_it(stack: Settings, tmp_path: Path) -> None:
    bench = _freshness()
    args = bench.parse_args(
        [
            "--trials",
            "4",
            "--rate",
            "8",
            "--history",
            "2000",
            "--warmup-s",
            "5",
            "--out",
            str(tmp_path / "f.json"),
        ]
    )
    res = None
    try:
        res = bench.run(args)
    finally:
        if res is not None:
            _clean(res["run_dir"], stack)
    assert res["attempted"] == 4 and res["trials"] == 4, res["failed"]
    assert res["settings"]["online.label_mode"] == Settings().online.label_mode  # dotted names (issue 17)
    for t in res["per_trial"]:
        assert t["error"] is None and t["seq"] is not None and t["seq"] >= 0
        assert set(bench.HOPS) <= set(t)
        # the hops are consecutive stretches of the same journey
        assert t["total_s"] >= t["produce"] + t["worker"] + t["trainer"] - 0.05
    assert set(res["hops"]) == set(bench.HOPS) and res["p50_s"] <= res["p99_s"]
