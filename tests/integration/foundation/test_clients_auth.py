"""Connecting with credentials, for real: a Redis with `--requirepass` and a ClickHouse with a
password-protected user, each our own server on free ports (the shared stack is never touched).

ClickHouse 18.16 (the Debian server here) has no `CREATE USER`, so its users come from a
users.xml written for the test, as a real deployment's would.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest

from deploy.services import Probe, stack_services
from schemas.clients import clickhouse_args, redis_args
from schemas.settings import Settings

PASSWORD = "pa55-w0rd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
            raise RuntimeError(f"server exited with {proc.returncode}: {tail}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {port} after {timeout_s}s")


def probe(settings: Settings, name: str) -> Probe:
    """What `adstream up`/`status` see of one service under these settings."""
    return next(svc for svc in stack_services(settings) if svc.name == name).probe()


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@pytest.fixture(scope="module")
def secured_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """redis://127.0.0.1:<port>/0 of our own redis-server that requires a password."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    data = tmp_path_factory.mktemp("redis")
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", PASSWORD]
    argv += ["--save", "", "--appendonly", "no", "--dir", str(data)]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_port(port, proc, 20)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop(proc)


@pytest.mark.redis
@pytest.mark.timeout(60)
def test_redis_password_from_the_settings(secured_redis: str) -> None:
    import redis
    import redis.asyncio as aredis

    from deploy.demo import redis_user_count

    with pytest.raises(redis.AuthenticationError):  # the server really wants the password
        redis.Redis.from_url(**redis_args(Settings(redis={"url": secured_redis}))).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(**redis_args(Settings(redis={"url": secured_redis, "password": "wrong"}))).ping()
    s = Settings(redis={"url": secured_redis, "password": PASSWORD}, redis_prefix="adstream-clients-test:")
    sync = redis.Redis.from_url(**redis_args(s))
    sync.set(f"{s.redis_prefix}a", b"1")
    assert redis_user_count(s) == 1  # a room's own code path (deploy.demo), through redis_args
    assert (
        probe(s, "redis").up and not probe(Settings(redis={"url": secured_redis}), "redis").up
    )  # `adstream up`

    async def roundtrip() -> bytes | None:
        client = aredis.Redis.from_url(**redis_args(s), socket_timeout=1.0)  # as serving.io builds it
        try:
            return await client.get(f"{s.redis_prefix}a")  # type: ignore[no-any-return]
        finally:
            await client.aclose()

    assert asyncio.run(roundtrip()) == b"1"
    # the URL's own password works too, and the settings' password wins over a wrong one in the URL
    in_url = secured_redis.replace("redis://", f"redis://:{PASSWORD}@")
    assert (
        redis.Redis.from_url(**redis_args(Settings(redis={"url": in_url}))).get(f"{s.redis_prefix}a") == b"1"
    )
    wrong_url = secured_redis.replace("redis://", "redis://:nope@")
    overridden = Settings(redis={"url": wrong_url, "password": PASSWORD})
    assert redis.Redis.from_url(**redis_args(overridden)).get(f"{s.redis_prefix}a") == b"1"
    sync.close()


USERS_XML = """<?xml version="1.0"?>
<yandex>
    <profiles><default><max_memory_usage>1000000000</max_memory_usage></default></profiles>
    <users>
        <ads_writer>
            <password_sha256_hex>{sha}</password_sha256_hex>
            <networks><ip>127.0.0.1</ip><ip>::1</ip></networks>
            <profile>default</profile>
            <quota>default</quota>
        </ads_writer>
    </users>
    <quotas><default><interval><duration>3600</duration><queries>0</queries><errors>0</errors>
        <result_rows>0</result_rows><read_rows>0</read_rows><execution_time>0</execution_time>
    </interval></default></quotas>
</yandex>
"""


@pytest.fixture(scope="module")
def secured_clickhouse(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The native port of our own clickhouse-server whose only user is `ads_writer` (password)."""
    binary = shutil.which("clickhouse-server")
    if binary is None:
        pytest.skip("clickhouse-server is not installed")
    base = tmp_path_factory.mktemp("clickhouse")
    for d in ("data/tmp", "data/user_files", "data/format_schemas", "logs"):
        (base / d).mkdir(parents=True, exist_ok=True)
    users = base / "users.xml"
    users.write_text(USERS_XML.format(sha=hashlib.sha256(PASSWORD.encode()).hexdigest()))
    tcp, http = free_port(), free_port()
    config = (resources.files("deploy") / "templates" / "clickhouse-config.xml").read_text()
    (base / "config.xml").write_text(
        config.format(
            log_dir=base / "logs",
            http_port=http,
            tcp_port=tcp,
            interserver_port=free_port(),
            data_dir=base / "data",
            users_path=users,
        )
    )
    proc = subprocess.Popen(
        [binary, f"--config-file={base / 'config.xml'}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_port(tcp, proc, 60, base / "logs" / "clickhouse-server.err.log")
        yield tcp
    finally:
        stop(proc)


@pytest.mark.clickhouse
@pytest.mark.timeout(120)
def test_clickhouse_user_and_password_from_the_settings(secured_clickhouse: int) -> None:
    from clickhouse_driver import Client
    from clickhouse_driver.errors import ServerException

    from attribution.migrate import migrate

    url = f"clickhouse://127.0.0.1:{secured_clickhouse}/ads_secured"
    with pytest.raises(ServerException, match="default"):  # no `default` user on this server
        Client(**clickhouse_args(Settings(clickhouse={"url": url}))).execute("SELECT 1")
    with pytest.raises(ServerException, match=r"[Pp]assword"):
        wrong = Settings(clickhouse={"url": url, "user": "ads_writer", "password": "wrong"})
        Client(**clickhouse_args(wrong)).execute("SELECT 1")
    s = Settings(clickhouse={"url": url, "user": "ads_writer", "password": PASSWORD})
    assert probe(s, "clickhouse").up and not probe(Settings(clickhouse={"url": url}), "clickhouse").up
    client = Client(**clickhouse_args(s))
    assert client.execute("SELECT DISTINCT user FROM system.processes") == [("ads_writer",)]
    client.execute("CREATE DATABASE IF NOT EXISTS ads_secured")
    applied = migrate(s)  # attribution's migrations connect through the same settings
    assert "001_raw_events" in applied
    tables = {r[0] for r in Client(**clickhouse_args(s, "ads_secured")).execute("SHOW TABLES")}
    assert {"impressions", "clicks", "schema_migrations"} <= tables
    # the user and password may also come in the URL itself
    in_url = f"clickhouse://ads_writer:{PASSWORD}@127.0.0.1:{secured_clickhouse}/ads_secured"
    assert Client(**clickhouse_args(Settings(clickhouse={"url": in_url}))).execute("SELECT 1") == [(1,)]
