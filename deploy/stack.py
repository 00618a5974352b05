"""`adstream up/down/status`: start what the settings point at and is not running, stop only that."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from deploy.endpoints import port_open
from deploy.services import Probe, Service, stack_services
from schemas import topics
from schemas.clients import clickhouse_client, clickhouse_database, kafka_args
from schemas.errors import StackError
from schemas.retry import kafka_errors
from schemas.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceState:
    """One row of `adstream status`."""

    name: str
    address: str
    probe: Probe
    started_by_us: bool


def _run_dir(settings: Settings) -> Path:
    return settings.state_dir / "run"


def _pid_file(settings: Settings, name: str) -> Path:
    return _run_dir(settings) / f"{name}.pid"


def _read_pid(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _start_ticks(pid: int) -> int | None:
    """When the process started (clock ticks since boot); with the pid, a unique identity."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie has exited already
        return None
    return int(fields[19])


def _ours_alive(record: Mapping[str, object]) -> bool:
    """The recorded process still runs: same pid AND same start time (pids get reused; and
    servers such as redis rewrite their command line, so that cannot identify them)."""
    pid = record.get("pid")
    return isinstance(pid, int) and _start_ticks(pid) is not None and _start_ticks(pid) == record.get("ticks")


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _start(service: Service, settings: Settings) -> None:
    if not service.endpoint.local:
        raise StackError(
            f"{service.name} at {service.endpoint} is not reachable and is not a loopback address, "
            "so `adstream up` will not start it: check the settings or the remote server"
        )
    if port_open(service.endpoint):
        raise StackError(
            f"{service.name}: port {service.endpoint.port} is taken by another program that does not "
            f"answer as {service.name}; free the port or point the settings at another one"
        )
    launch = service.launch(settings.state_dir)
    launch.log.parent.mkdir(parents=True, exist_ok=True)
    _run_dir(settings).mkdir(parents=True, exist_ok=True)
    with open(launch.log, "ab") as out:
        proc = subprocess.Popen(
            launch.argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    record = {
        "pid": proc.pid,
        "ticks": _start_ticks(proc.pid),
        "argv": launch.argv,
        "log": str(launch.log),
        "started": time.time(),
    }
    _pid_file(settings, service.name).write_text(json.dumps(record))
    deadline = time.monotonic() + settings.stack_timeout_s
    probe = Probe(False)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            _pid_file(settings, service.name).unlink(missing_ok=True)
            raise StackError(
                f"{service.name} exited with code {proc.returncode} while starting; "
                f"last lines of {launch.log}:\n{_tail(launch.log)}"
            )
        probe = service.probe()
        if probe.up:
            log.info("%s started on %s (pid %d)", service.name, service.endpoint, proc.pid)
            return
        time.sleep(0.3)
    _stop_record(record)
    _pid_file(settings, service.name).unlink(missing_ok=True)
    raise StackError(
        f"{service.name} did not answer on {service.endpoint} within {settings.stack_timeout_s:.0f}s "
        f"({probe.error}); last lines of {launch.log}:\n{_tail(launch.log)}"
    )


async def create_topics_async(settings: Settings) -> list[str]:
    """Create the contract topics that do not exist yet; return the names created."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(**kafka_args(settings))
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        wanted = [
            NewTopic(
                topics.topic_name(spec.name, settings.topic_prefix),
                settings.kafka.topic_partitions or spec.partitions,
                1,
            )
            for spec in topics.TOPICS
        ]
        missing = [t for t in wanted if t.name not in existing]
        if missing:
            await admin.create_topics(missing)
        return [t.name for t in missing]
    except kafka_errors() as exc:  # the broker's; a bug raises as itself
        raise StackError(f"could not create topics on {settings.kafka.bootstrap}: {exc}") from exc
    finally:
        await admin.close()


async def delete_topics_async(settings: Settings) -> list[str]:
    """Delete every topic under `settings.topic_prefix` (test and benchmark runs clean up with it;
    the embedded broker keeps everything in memory). Returns the names deleted."""
    from aiokafka.admin import AIOKafkaAdminClient

    if not settings.topic_prefix:
        raise StackError("refusing to delete topics without a topic_prefix: that would be every topic")
    admin = AIOKafkaAdminClient(**kafka_args(settings))
    await admin.start()
    try:
        names = [n for n in await admin.list_topics() if n.startswith(settings.topic_prefix)]
        if names:
            await admin.delete_topics(names)
        return names
    finally:
        await admin.close()


def create_topics(settings: Settings) -> list[str]:
    """Blocking form of `create_topics_async`, for code that runs no event loop."""
    return asyncio.run(create_topics_async(settings))


def create_database(settings: Settings) -> None:
    """Create the ClickHouse database named in the URL (tables belong to their rooms)."""
    client = clickhouse_client(settings, connect_timeout=3)
    try:
        client.execute(f"CREATE DATABASE IF NOT EXISTS {clickhouse_database(settings)}")
    finally:
        client.disconnect()


def up(settings: Settings, only: set[str] | None = None) -> list[str]:
    """Start every service not already reachable, create topics and the database; return started names."""
    started: list[str] = []
    for service in stack_services(settings):
        if only and service.name not in only:
            continue
        if service.probe().up:
            log.info("%s already answers on %s", service.name, service.endpoint)
            continue
        _start(service, settings)
        started.append(service.name)
    if not only or "kafka" in only:
        create_topics(settings)
    if not only or "clickhouse" in only:
        create_database(settings)
    return started


def _stop_record(record: Mapping[str, object], timeout_s: float = 15.0) -> bool:
    pid = record.get("pid")
    if not isinstance(pid, int) or not _ours_alive(record):
        return False
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return True
            except ChildProcessError:
                pass  # not our child (started by an earlier `up`): watch /proc instead
            if not _ours_alive(record):
                return True
            time.sleep(0.1)
    return not _ours_alive(record)


def down(settings: Settings) -> list[str]:
    """Stop exactly the services whose pid files `up` wrote and that still run our command."""
    stopped: list[str] = []
    run = _run_dir(settings)
    if not run.exists():
        return stopped
    for pid_file in sorted(run.glob("*.pid")):
        record = _read_pid(pid_file)
        if record is not None and _stop_record(record):
            stopped.append(pid_file.stem)
        pid_file.unlink(missing_ok=True)
    return stopped


def status(settings: Settings) -> list[ServiceState]:
    """Probe every service of the stack."""
    rows = []
    for service in stack_services(settings):
        record = _read_pid(_pid_file(settings, service.name))
        ours = record is not None and _ours_alive(record)
        rows.append(ServiceState(service.name, str(service.endpoint), service.probe(), ours))
    return rows
