"""The Redis `adstream up` starts keeps what the worker committed through a kill -9 (append-only
file): user state and applied offsets are the worker's source of truth, and a Redis that forgot
them would make the worker replay from offset 0 into an empty state (M14)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import redis
from streams_it import free_port

from deploy.endpoints import Endpoint
from deploy.services import launch_redis

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(argv, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    return proc


def _client(port: int) -> redis.Redis:
    r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)
    for _ in range(100):
        try:
            r.ping()
            return r
        except redis.ConnectionError:
            time.sleep(0.1)
    raise AssertionError("our Redis did not start")


def test_committed_state_survives_a_kill_9_of_the_redis_adstream_starts(tmp_path: Path) -> None:
    port = free_port()
    launch = launch_redis(Endpoint("127.0.0.1", port), tmp_path)
    (tmp_path / "logs").mkdir(exist_ok=True)
    proc = _start(launch.argv, launch.log)
    try:
        r = _client(port)
        pipe = r.pipeline(transaction=True)  # what a batch commit writes, in one MULTI/EXEC
        pipe.set("t:user:u1", b"state").hset("t:streams:offsets", mapping={"ad.clicks:0": "41"})
        pipe.execute()
        time.sleep(1.5)  # appendfsync everysec: at most the last second is at risk
        r.close()
        proc.kill()
        proc.wait(10)
        proc = _start(launch.argv, launch.log)
        r = _client(port)
        assert r.get("t:user:u1") == b"state"
        assert r.hget("t:streams:offsets", "ad.clicks:0") == b"41"
        r.close()
    finally:
        proc.kill()
        proc.wait(10)
