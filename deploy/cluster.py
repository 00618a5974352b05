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
# the tables of attribution/migrations that carry events of a user (the path build reads them;
# `views`: the render beacons that make impressions shown, attribution's views)
USER_TABLES = ("impressions", "views", "clicks", "conversions", "touches")


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


# -- Ray: a head and a second node on this machine ---------------------------------------------
@dataclass(frozen=True)
class RayPorts:
    """The listening ports of one Ray node (two nodes on one machine must not share any)."""

    node_manager: int
    object_manager: int
    dashboard_agent_listen: int
    dashboard_agent_grpc: int
    runtime_env_agent: int
    metrics_export: int
    min_worker: int
    max_worker: int

    def args(self) -> list[str]:
        return [
            f"--node-manager-port={self.node_manager}",
            f"--object-manager-port={self.object_manager}",
            f"--dashboard-agent-listen-port={self.dashboard_agent_listen}",
            f"--dashboard-agent-grpc-port={self.dashboard_agent_grpc}",
            f"--runtime-env-agent-port={self.runtime_env_agent}",
            f"--metrics-export-port={self.metrics_export}",
            f"--min-worker-port={self.min_worker}",
            f"--max-worker-port={self.max_worker}",
        ]


HEAD_PORTS = RayPorts(18834, 18835, 18833, 18837, 18836, 18838, 18870, 18884)
WORKER_PORTS = RayPorts(18844, 18845, 18843, 18847, 18846, 18848, 18885, 18899)


@dataclass
class RayNode:
    """A `ray start --block` process and its session (raylet, agents and workers share it)."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def session_pids(self) -> list[int]:
        return session_pids(self.proc.pid)


def ray_node_argv(
    ray: str,
    ports: RayPorts,
    temp_dir: Path,
    *,
    head_port: int | None = None,
    address: str | None = None,
    dashboard_port: int = 18831,
    client_port: int = 18832,
    num_cpus: int = 2,
) -> list[str]:
    """`ray start` for a head (`head_port`) or a node joining `address`, loopback only."""
    if (head_port is None) == (address is None):
        raise StackError("ray_node_argv: give exactly one of head_port and address")
    argv = [ray, "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1"]
    argv += [f"--num-cpus={num_cpus}", f"--temp-dir={temp_dir}", *ports.args()]
    if head_port is not None:
        argv += ["--head", f"--port={head_port}", "--include-dashboard=false"]
        argv += [f"--dashboard-port={dashboard_port}", f"--ray-client-server-port={client_port}"]
    else:
        argv += [f"--address={address}"]
    return argv


def start_ray_node(name: str, argv: Sequence[str], env: dict[str, str], log_dir: Path) -> RayNode:
    """Start `ray start --block` in its own session (so the node can be killed as a whole)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            list(argv), env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    return RayNode(name, proc, log)


def session_pids(sid: int) -> list[int]:
    """The live processes of session `sid` (a `start_new_session` child's pid is its session id)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session
            pids.append(int(entry.name))
    return pids


def kill_ray_node(node: RayNode, sig: int = signal.SIGKILL) -> list[int]:
    """Kill every process of the node's session at once (a machine failing: no clean shutdown)."""
    pids = node.session_pids()
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    try:
        node.proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
    return pids


def start_ray_node_up(
    name: str,
    argv: Sequence[str],
    env: dict[str, str],
    log_dir: Path,
    tries: int = 3,
    timeout_s: float = 240.0,
) -> RayNode:
    """`start_ray_node` until the node says it runs: `ray start` gives its raylet a fixed 30 s to
    register with the GCS (ray/_private/node.py), which a loaded 2-core machine can miss; what a
    failed attempt left (its session) is killed before the next."""
    for attempt in range(1, tries + 1):
        node = start_ray_node(name, argv, env, log_dir)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and node.proc.poll() is None:
            if "Ray runtime started" in node.log.read_text(errors="replace"):
                return node
            time.sleep(1)
        kill_ray_node(node)
        if attempt == tries:
            tail = "\n".join(node.log.read_text(errors="replace").splitlines()[-15:])
            raise StackError(f"ray node {name} did not start in {tries} tries; last lines:\n{tail}")
        time.sleep(3)
    raise AssertionError("unreachable")


def spread_app(settings: Any) -> Any:
    """The ad server app as `serving.app.build_app` binds it, with at most one replica per node:
    its replicas ask for no CPU, so Serve would otherwise pack them onto one node, and losing that
    node would lose them all."""
    from ray import serve

    from serving.admin import api_key_digests, token_digest
    from serving.app import AdServer, deployment_options, settings_payload
    from serving.io import UserRecordCodec

    deployment = serve.deployment(
        AdServer, name="AdServer", **deployment_options(settings), max_replicas_per_node=1
    )
    return deployment.bind(  # type: ignore[attr-defined]
        settings_payload(settings),
        UserRecordCodec(settings.state),
        token_digest(settings.serving.admin_token),
        api_key_digests(settings.serving.api_keys),
    )


def deploy_spread(replicas: int, port: int) -> str:
    """`adstream serve --detach --replicas N --port P`, one replica per node: join the running
    cluster (RAY_ADDRESS), deploy, disconnect (the app keeps serving). Returns the balancer's URL."""
    import ray

    from deploy.cli_serving import connect_cluster, start
    from schemas.settings import Settings, nested

    settings = Settings(**nested({"serving.replicas": replicas, "serving.http_port": port}))
    connect_cluster()
    try:
        return start(settings, app=spread_app(settings)).proxy
    finally:
        ray.shutdown()
