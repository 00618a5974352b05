"""`adstream up/status/down` on spare ports: starts all three services, stops exactly those."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.endpoints import Endpoint, port_open

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.clickhouse, pytest.mark.timeout(240)]

ADSTREAM = [sys.executable, "-m", "deploy.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def spare_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    ch = free_port()
    env = dict(os.environ)
    env.update(
        ADSTREAM_STATE_DIR=str(tmp_path / "state"),
        ADSTREAM_KAFKA__BOOTSTRAP=f"127.0.0.1:{free_port()}",
        ADSTREAM_REDIS__URL=f"redis://127.0.0.1:{free_port()}/0",
        ADSTREAM_CLICKHOUSE__URL=f"clickhouse://default@127.0.0.1:{ch}/adstream",
        ADSTREAM_CLICKHOUSE__HTTP_PORT=str(free_port()),
    )
    yield env
    subprocess.run([*ADSTREAM, "down"], env=env, capture_output=True, timeout=60)


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ADSTREAM, *args], env=env, capture_output=True, text=True, timeout=150)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def test_up_status_down_leaves_nothing_behind(spare_env: dict[str, str]) -> None:
    assert run(spare_env, "status").returncode == 1  # nothing there yet

    up = run(spare_env, "up")
    assert up.returncode == 0, up.stderr + up.stdout
    assert "started: kafka, redis, clickhouse" in up.stdout

    status = run(spare_env, "status")
    assert status.returncode == 0, status.stdout
    for word in ("Kafka API", "Redis", "ClickHouse"):
        assert word in status.stdout

    run_dir = Path(spare_env["ADSTREAM_STATE_DIR"]) / "run"
    pids = {p.stem: json.loads(p.read_text())["pid"] for p in run_dir.glob("*.pid")}
    assert set(pids) == {"kafka", "redis", "clickhouse"}
    assert all(alive(pid) for pid in pids.values())

    # `up` applied the ClickHouse migrations (event, rollup and attribution tables) once
    assert "ClickHouse migrations applied: 001_raw_events" in up.stdout, up.stdout
    again = run(spare_env, "up")  # idempotent: everything answers, nothing new is started
    assert "started: nothing" in again.stdout
    assert "ClickHouse migrations applied: none (up to date)" in again.stdout, again.stdout

    down = run(spare_env, "down")
    assert down.returncode == 0
    assert set(down.stdout.split("stopped:")[1].strip().split(", ")) == {"kafka", "redis", "clickhouse"}
    assert not any(alive(pid) for pid in pids.values())
    assert not list(run_dir.glob("*.pid"))
    assert run(spare_env, "status").returncode == 1


def test_down_does_not_touch_what_it_did_not_start(spare_env: dict[str, str]) -> None:
    # The machine's own Redis on 6379 must survive: `up` found it running, so `down` leaves it.
    env = dict(spare_env, ADSTREAM_REDIS__URL="redis://127.0.0.1:6379/0")
    up = run(env, "up", "--only", "redis")
    assert up.returncode == 0, up.stderr
    assert "started: nothing" in up.stdout
    assert "stopped: nothing" in run(env, "down").stdout
    assert port_open(Endpoint("127.0.0.1", 6379))


def test_taken_port_is_a_clear_error(spare_env: dict[str, str]) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        env = dict(spare_env, ADSTREAM_REDIS__URL=f"redis://127.0.0.1:{port}/0")
        up = run(env, "up", "--only", "redis")
    assert up.returncode == 2
    assert f"port {port} is taken" in up.stderr


def test_remote_address_is_not_started(spare_env: dict[str, str]) -> None:
    env = dict(spare_env, ADSTREAM_REDIS__URL="redis://192.0.2.1:6379/0")  # TEST-NET-1, never routable
    up = run(env, "up", "--only", "redis")
    assert up.returncode == 2
    assert "not a loopback address" in up.stderr
