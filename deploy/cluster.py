"""A ClickHouse cluster on one box: local shards behind a `Distributed` table sharded by user.

`start_shards` starts one clickhouse-server per shard (own ports, own data dir, the same config
template as `adstream up`'s server) with a `remote_servers` section naming every shard, so any
shard can hold a `Distributed` table over all of them. No replication, so no ZooKeeper.
`create_distributed` puts a `Distributed` table over each local table, sharded by
`cityHash64(user_id)`: every event of a user lands on one shard, so that shard can build that
user's attribution paths alone (`attribution.shards`). `stop_shards` stops what it started.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from schemas.errors import StackError

SHARD_KEY = "cityHash64(user_id)"
# the tables of attribution/migrations that carry events of a user (the path build reads them)
USER_TABLES = ("impressions", "clicks", "conversions", "touches")


@dataclass(frozen=True)
class Shard:
    """One local clickhouse-server of the cluster."""

    tcp_port: int
    http_port: int
    interserver_port: int
    base: Path

    @property
    def url(self) -> str:
        return f"clickhouse://127.0.0.1:{self.tcp_port}"


@dataclass
class LocalCluster:
    """Shards started by `start_shards` (their processes, to stop them)."""

    name: str
    shards: tuple[Shard, ...]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def client(self, shard: int, database: str = "default", **options: Any) -> Any:
        from clickhouse_driver import Client

        return Client(host="127.0.0.1", port=self.shards[shard].tcp_port, database=database, **options)


def remote_servers_xml(name: str, shards: Sequence[Shard]) -> str:
    """The `<remote_servers>` section naming each shard once (one replica each)."""
    if not name.replace("_", "").isalnum():
        raise StackError(f"cluster name {name!r} must be letters, digits or _")
    body = "".join(
        f"<shard><replica><host>127.0.0.1</host><port>{s.tcp_port}</port></replica></shard>" for s in shards
    )
    return f"<remote_servers><{name}>{body}</{name}></remote_servers>"


def shard_config(shard: Shard, users_path: Path, cluster_xml: str) -> str:
    """The server config of one shard: `adstream up`'s template, its ports and dirs, the cluster."""
    template = (resources.files("deploy") / "templates" / "clickhouse-config.xml").read_text()
    values = {
        "log_dir": shard.base / "logs",
        "http_port": shard.http_port,
        "tcp_port": shard.tcp_port,
        "interserver_port": shard.interserver_port,
        "data_dir": shard.base / "data",
        "users_path": users_path,
    }
    config = template.format(**{k: escape(str(v)) for k, v in values.items()})
    return config.replace("</yandex>", f"    {cluster_xml}\n</yandex>")


def _answers(port: int) -> bool:
    from clickhouse_driver import Client

    logging.getLogger("clickhouse_driver.connection").setLevel(logging.CRITICAL)  # refusals while starting
    client = Client(host="127.0.0.1", port=port, connect_timeout=1, send_receive_timeout=3)
    try:
        client.execute("SELECT 1")
        return True
    except Exception:  # a probe: any failure means "not up yet"
        return False
    finally:
        client.disconnect()


def start_shards(
    base: Path,
    tcp_ports: Sequence[int] = (18810, 18811),
    http_ports: Sequence[int] = (18820, 18821),
    interserver_ports: Sequence[int] = (18840, 18841),
    name: str = "adstream_local",
    timeout_s: float = 90.0,
) -> LocalCluster:
    """Start one clickhouse-server per port pair under `base` (wiped first); wait until each answers."""
    if not (len(tcp_ports) == len(http_ports) == len(interserver_ports)) or not tcp_ports:
        raise StackError("start_shards: give one tcp, http and interserver port per shard")
    binary = shutil.which("clickhouse-server")
    if binary is None:
        raise StackError("clickhouse-server is not on PATH")
    shards = tuple(
        Shard(t, h, i, (base / f"shard{n}").resolve())
        for n, (t, h, i) in enumerate(zip(tcp_ports, http_ports, interserver_ports, strict=True))
    )
    cluster = LocalCluster(name, shards)
    xml = remote_servers_xml(name, shards)
    users = (resources.files("deploy") / "templates" / "clickhouse-users.xml").read_text()
    try:
        for shard in shards:
            if _answers(shard.tcp_port):
                raise StackError(
                    f"port {shard.tcp_port} already answers as ClickHouse: stop that server first"
                )
            shutil.rmtree(shard.base, ignore_errors=True)
            for d in ("data/tmp", "data/user_files", "data/format_schemas", "logs"):
                (shard.base / d).mkdir(parents=True, exist_ok=True)
            users_path = shard.base / "users.xml"
            users_path.write_text(users)
            config_path = shard.base / "config.xml"
            config_path.write_text(shard_config(shard, users_path, xml))
            with open(shard.base / "logs" / "stdout.log", "ab") as out:
                cluster.procs.append(
                    subprocess.Popen(
                        [binary, f"--config-file={config_path}"],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout_s
        for shard, proc in zip(shards, cluster.procs, strict=True):
            while not _answers(shard.tcp_port):
                if proc.poll() is not None:
                    raise StackError(f"clickhouse-server on {shard.tcp_port} exited with {proc.returncode}")
                if time.monotonic() > deadline:
                    raise StackError(
                        f"clickhouse-server on {shard.tcp_port} did not answer in {timeout_s:.0f}s"
                    )
                time.sleep(0.3)
    except BaseException:
        stop_shards(cluster)
        raise
    return cluster


def stop_shards(cluster: LocalCluster, timeout_s: float = 20.0) -> None:
    """Stop the servers `start_shards` started (their own process groups only)."""
    for proc in cluster.procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in cluster.procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    cluster.procs.clear()


def create_distributed(
    client: Any,
    cluster: str,
    local_db: str,
    dist_db: str,
    tables: Sequence[str] = USER_TABLES,
    key: str = SHARD_KEY,
) -> None:
    """On the server of `client`: a `Distributed` table `dist_db.t` over `local_db.t` of every
    shard, for each table in `tables` (same columns), rows placed by `key`."""
    client.execute(f"CREATE DATABASE IF NOT EXISTS {dist_db}")
    for t in tables:
        client.execute(
            f"CREATE TABLE IF NOT EXISTS {dist_db}.{t} AS {local_db}.{t} "
            f"ENGINE = Distributed({cluster}, {local_db}, {t}, {key})"
        )
