"""Pure parts of the local stack: address parsing and the missing-binary message."""

from __future__ import annotations

import pytest

from deploy.endpoints import kafka_endpoint, url_endpoint
from deploy.services import _which
from schemas.clients import clickhouse_database
from schemas.errors import ConfigError, StackError


def test_kafka_bootstrap_takes_the_first_broker() -> None:
    ep = kafka_endpoint("127.0.0.1:9092,other:9093")
    assert (ep.host, ep.port, ep.local) == ("127.0.0.1", 9092, True)
    with pytest.raises(ConfigError, match=r"kafka\.bootstrap"):
        kafka_endpoint("no-port")


def test_urls() -> None:
    assert url_endpoint("redis://localhost/0", "redis_url", 6379).port == 6379
    assert not url_endpoint("redis://cache.internal:7000/0", "redis_url", 6379).local
    assert clickhouse_database("clickhouse://default@h:9000/ads_db") == "ads_db"
    assert clickhouse_database("clickhouse://h:9000") == "adstream"
    with pytest.raises(ConfigError, match="database name"):
        clickhouse_database("clickhouse://h:9000/drop table")


def test_missing_binary_names_the_apt_package() -> None:
    with pytest.raises(StackError, match="apt-get install some-package"):
        _which("definitely-not-a-binary-xyz", "some-package")
