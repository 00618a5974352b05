"""A migration that cannot reach ClickHouse says where, without the password of the URL."""

from __future__ import annotations

import socket

import pytest

from attribution.migrate import migrate
from schemas.errors import StoreError
from schemas.settings import Settings


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends: nothing listens there


def test_an_unreachable_clickhouse_is_named_without_its_password() -> None:
    port = _closed_port()
    s = Settings(clickhouse={"url": f"clickhouse://ads:s3cret-pw@127.0.0.1:{port}/adstream"})
    with pytest.raises(StoreError) as err:
        migrate(s)
    message = str(err.value)
    assert f"127.0.0.1:{port}" in message and "ads:***@" in message
    assert "s3cret-pw" not in message
