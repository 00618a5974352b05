"""A fresh, empty ClickHouse database per test on either engine (the 18.16 server or chDB), and
the migrations a release that ended at some migration had: what the migration tests start from."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import pytest

from attribution.migrate import migration_files
from attribution.sql import Backend, ChdbBackend, DriverBackend
from schemas.clients import clickhouse_client
from schemas.settings import Settings


@contextmanager
def fresh_database(engine: str, request: pytest.FixtureRequest, prefix: str) -> Iterator[Backend]:
    """An empty database named `prefix` + a random suffix on `engine` ("clickhouse": the stack's
    server, through the `stack` fixture; "chdb": in process), dropped (or closed) afterwards."""
    suffix = uuid.uuid4().hex[:6]
    if engine == "chdb":
        chdb = ChdbBackend(f"{prefix}_{suffix}")
        try:
            yield chdb
        finally:
            chdb.close()
        return
    if engine != "clickhouse":
        raise ValueError(f"unknown engine {engine!r} (clickhouse, chdb)")
    stack: Settings = request.getfixturevalue("stack")
    name = f"{urlparse(stack.clickhouse.url).path.lstrip('/')}_{prefix}{suffix}"
    admin = clickhouse_client(stack)
    admin.execute(f"CREATE DATABASE {name}")
    admin.disconnect()
    url = urlunparse(urlparse(stack.clickhouse.url)._replace(path=f"/{name}"))
    client = clickhouse_client(
        stack.model_copy(update={"clickhouse": stack.clickhouse.model_copy(update={"url": url})}), name
    )
    try:
        yield DriverBackend(client)
    finally:
        client.execute(f"DROP DATABASE IF EXISTS {name}")
        client.disconnect()


def migrations_upto(tmp: Path, last: str, *, inclusive: bool = True) -> Path:
    """A folder under `tmp` with the migrations up to `last` (or before it: `inclusive=False`),
    as a release that ended there had them."""
    folder = tmp / f"{'upto' if inclusive else 'before'}_{last}"
    folder.mkdir(exist_ok=True)
    for path in migration_files():
        if path.stem < last or (inclusive and path.stem == last):
            shutil.copy(path, folder / path.name)
    return folder
