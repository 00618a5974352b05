"""Fixtures of the streams integration tests: an isolated deployment per test, a worker process."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from streams_it import Worker

from schemas.settings import Settings


@pytest.fixture
def deployment(stack: Settings) -> Iterator[Settings]:
    """Settings with this test's own topics, Redis keys and ClickHouse database; cleaned after."""
    from deploy.stack import create_topics
    from schemas.clients import clickhouse_client

    tag = uuid.uuid4().hex[:6]
    base = stack.clickhouse.url.rsplit("/", 1)[0]
    s = stack.model_copy(
        update={
            "topic_prefix": f"{stack.topic_prefix}{tag}.",
            "redis_prefix": f"{stack.redis_prefix}{tag}:",
            "clickhouse": stack.clickhouse.model_copy(
                update={"url": f"{base}/{stack.clickhouse.url.rsplit('/', 1)[1]}_{tag}"}
            ),
            "sink": stack.sink.model_copy(update={"flush_s": 0.3, "batch_size": 1000}),
            "metrics": stack.metrics.model_copy(update={"port": 0}),
        }
    )
    create_topics(s)
    yield s
    import redis

    r = redis.Redis.from_url(s.redis.url)
    keys = list(r.scan_iter(match=f"{s.redis_prefix}*", count=1000))
    if keys:
        r.delete(*keys)
    r.close()
    client = clickhouse_client(s)
    client.execute(f"DROP DATABASE IF EXISTS {s.clickhouse.url.rsplit('/', 1)[1]}")
    client.disconnect()
    _drop_topics(s)


def _drop_topics(s: Settings) -> None:
    """Best effort: the embedded broker keeps topics in memory."""
    import asyncio

    from deploy.stack import delete_topics_async

    try:
        asyncio.run(delete_topics_async(s))
    except Exception:
        pass


@pytest.fixture
def worker(deployment: Settings, tmp_path: Path) -> Iterator[Worker]:
    w = Worker(deployment, tmp_path / "worker.log")
    yield w
    w.stop()
