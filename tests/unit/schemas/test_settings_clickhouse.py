"""How every room connects to ClickHouse: one parse of `clickhouse.url`."""

from __future__ import annotations

import pytest

from schemas.clients import clickhouse_args, clickhouse_database
from schemas.errors import ConfigError
from schemas.settings import Settings


def test_connect_args_from_the_url() -> None:
    s = Settings(clickhouse={"url": "clickhouse://ads:pw@10.0.0.5:9440/prod_ads"})
    assert clickhouse_database(s) == "prod_ads"
    args = clickhouse_args(s, clickhouse_database(s))
    assert args == {
        "host": "10.0.0.5",
        "port": 9440,
        "user": "ads",
        "password": "pw",
        "database": "prod_ads",
        "connect_timeout": 5,
    }
    assert clickhouse_args(s)["database"] == "default"


def test_defaults_and_bad_database_name() -> None:
    s = Settings(clickhouse={"url": "clickhouse://127.0.0.1"})
    assert clickhouse_database(s) == "adstream"
    assert clickhouse_args(s)["port"] == 9000 and clickhouse_args(s)["user"] == "default"
    with pytest.raises(ConfigError, match="'ads;drop'"):
        clickhouse_database(Settings(clickhouse={"url": "clickhouse://127.0.0.1/ads;drop"}))


@pytest.mark.parametrize("name", ["ads\u0663", "caf\u00e9", "\u0430ds", "ads\u00b2", "_"])
def test_database_name_is_an_ascii_identifier(name: str) -> None:
    """Reliability L5: `str.isalnum` accepts non-ASCII letters and digits (Arabic-Indic three,
    Cyrillic a, superscript two); the name is spliced into DDL, so only ASCII letters, digits
    and underscores."""
    with pytest.raises(ConfigError, match="database name"):
        clickhouse_database(Settings(clickhouse={"url": f"clickhouse://127.0.0.1/{name}"}))


def test_database_names_in_use_stay_valid() -> None:
    for name in ("adstream", "demo_ab12cd", "prod_ads", "t_1", "_ads"):
        assert clickhouse_database(f"clickhouse://127.0.0.1/{name}") == name


def test_the_client_factory_passes_driver_options_through() -> None:
    """`settings=` is the driver's own option (query settings), not ours: the dashboard's
    read-only connections pass it (this call raised TypeError while the factory's first parameter
    could be named)."""
    from schemas.clients import clickhouse_client

    client = clickhouse_client(Settings(), "ads", settings={"readonly": 2}, connect_timeout=3)
    assert client.settings == {"readonly": 2}
    assert client.connection.database == "ads" and client.connection.connect_timeout == 3
