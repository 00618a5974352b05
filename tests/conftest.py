"""Shared fixtures: isolated settings per test session and the real local stack, started once."""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from collections.abc import Generator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import pytest

from schemas.settings import Settings
from tests.support.clock import one_hour_wait

ROOT = Path(__file__).resolve().parent.parent
RUN_ID = uuid.uuid4().hex[:8]

# Consumer groups on the local broker: Tansu answers a group join after half the session
# timeout, so the default 10 s costs every worker and trainer start (and every kill -9 test's
# wait for the dead member) 5 s. The tests, and the CLIs they start, run with 3 s.
os.environ.setdefault("ADSTREAM_KAFKA__SESSION_TIMEOUT_MS", "3000")
os.environ.setdefault("ADSTREAM_KAFKA__HEARTBEAT_INTERVAL_MS", "500")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """A test marked `one_hour` compares pCTRs across requests, and the ranker reads the UTC hour:
    it starts where its window (the marker's seconds, else its timeout) fits in one UTC hour,
    waiting for the next hour where it would not (outside its timeout: this wrapper runs first)."""
    marker = item.get_closest_marker("one_hour")
    if marker is not None:
        limit = item.get_closest_marker("timeout")
        window = float(
            marker.args[0] if marker.args else limit.args[0] if limit else item.config.getini("timeout")
        )
        wait = one_hour_wait(datetime.now(UTC), window)
        if wait:
            sys.stderr.write(f"\n{item.nodeid}: waiting {wait:.0f} s for the next UTC hour\n")
            time.sleep(wait)
    yield


@pytest.fixture(scope="session")
def settings() -> Settings:
    """Settings isolated for this test session: own topic prefix, Redis prefix and ClickHouse db."""
    state_dir = ROOT / ".adstream" / "test"
    return Settings(
        topic_prefix=f"t{RUN_ID}.",
        redis_prefix=f"adstream-test:{RUN_ID}:",
        clickhouse={
            "url": urlunparse(
                urlparse(os.environ.get("ADSTREAM_CLICKHOUSE__URL", Settings().clickhouse.url))._replace(
                    path=f"/adstream_test_{RUN_ID}"
                )
            )
        },
        state_dir=state_dir,
        model_dir=state_dir / "models",
    )


@pytest.fixture(scope="session")
def stack(settings: Settings) -> Iterator[Settings]:
    """The real broker, Redis and ClickHouse (started if not running, stopped after if we started them)."""
    from deploy import stack as stack_mod

    logging.getLogger("clickhouse_driver").setLevel(logging.CRITICAL)
    started = stack_mod.up(settings)
    try:
        yield settings
    finally:
        _drop_test_database(settings)
        if started:
            stack_mod.down(settings)


def _drop_test_database(settings: Settings) -> None:
    from clickhouse_driver import Client

    from deploy.endpoints import url_endpoint
    from schemas.clients import clickhouse_database

    ep = url_endpoint(settings.clickhouse.url, "clickhouse.url", 9000)
    try:
        client = Client(host=ep.host, port=ep.port, connect_timeout=2)
        client.execute(f"DROP DATABASE IF EXISTS {clickhouse_database(settings.clickhouse.url)}")
        client.disconnect()
    except Exception:  # the server may be gone already (we stopped it)
        pass


@pytest.fixture
def redis_client(stack: Settings) -> Iterator[object]:
    """A Redis client; the keys under the session's prefix that appeared during the test are
    deleted afterwards. Keys that were there before (a session-scoped replica's or trainer's
    snapshots and pins) stay: deleting the whole prefix broke tests that ran after it."""
    import redis

    client = redis.Redis.from_url(stack.redis.url)
    pattern = f"{stack.redis_prefix}*"
    before = set(client.scan_iter(match=pattern, count=1000))
    yield client
    new = [k for k in client.scan_iter(match=pattern, count=1000) if k not in before]
    if new:
        client.delete(*new)
    client.close()
