"""The whole loop once, each room as its own real process (`adstream demo`'s code path, small).

simulate → train → catalog → worker + trainer + ad server → closed loop over HTTP → events in
ClickHouse and Redis, labels to the trainer, LoRA deltas back into the serving replica. Slow
(~3 minutes): `make test-all` runs it, `make test` does not.
"""

from __future__ import annotations

import asyncio
import math
import random
import shutil
import socket
from pathlib import Path

import pytest

from schemas.settings import Settings

pytestmark = [
    pytest.mark.slow,
    pytest.mark.kafka,
    pytest.mark.redis,
    pytest.mark.clickhouse,
    pytest.mark.ray,
    pytest.mark.timeout(900),
]


def _free_port() -> int:
    for _ in range(50):
        port = random.randint(28_100, 29_900)
        with socket.socket() as a, socket.socket() as b:
            if a.connect_ex(("127.0.0.1", port)) and b.connect_ex(("127.0.0.1", port + 1)):
                return port
    raise RuntimeError("no free port pair for the loop's ad server")


def test_the_loop_closes(stack: Settings) -> None:
    from clickhouse_driver import Client

    from deploy.demo import DemoSpec, run_demo
    from deploy.stack import delete_topics_async
    from schemas.clients import clickhouse_args, clickhouse_database

    spec = DemoSpec(
        users=150,
        ads=120,
        history=8_000,
        requests=400,
        rate=20.0,
        port=_free_port(),
        dashboard_port=_free_port(),
    )
    lines: list[str] = []
    report = None
    files: set[str] = set()
    try:
        report = run_demo(spec, stack, lines.append, live=False)
        files = {p.name for p in Path(report["dir"]).iterdir()}
    finally:
        # the demo keeps its run's topics, keys and database for inspection; a test does not
        if report is not None:
            run_dir = report["dir"]
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
    assert report is not None, "\n".join(lines)
    metrics = {k: float(v) for k, v in report["serving_metrics"].items()}
    answered = metrics.get('adstream_serving_requests_total{status="200"}', 0.0)
    failed = sum(v for k, v in metrics.items() if k.startswith('adstream_serving_requests_total{status="5'))
    assert answered >= spec.requests and failed == 0, metrics
    # the history and what was served reached ClickHouse through Kafka and the worker
    counts = report["clickhouse"]
    history = report["offline"]["history"]["impressions"]
    assert counts["impressions"] > history + spec.requests and counts["clicks"] > 0, counts
    assert report["redis_users"] > 0
    # labels reached the trainer, whose deltas were applied in the serving replica
    assert metrics.get('adstream_serving_deltas_total{outcome="applied"}', 0.0) > 0, metrics
    before = {a["adapter_id"]: a["seq"] for a in report["adapters_start"]}
    after = {a["adapter_id"]: a["seq"] for a in report["adapters_after"]}
    assert any(seq > before.get(aid, -1) for aid, seq in after.items()), (before, after)
    # the report a person reads, with its plots, and the trainer's online vs frozen AUC sampled
    assert {"report.md", "report.json", "auc_over_time.png", "latency.png"} <= files, files
    assert any(math.isfinite(s["online_auc"]) and math.isfinite(s["base_auc"]) for s in report["samples"])
