"""Helpers of the streams integration tests: a worker child process, produce/consume, waiting."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from schemas import topics
from schemas.settings import Settings

ROOT = Path(__file__).resolve().parents[3]


def worker_env(s: Settings) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "ADSTREAM_KAFKA__BOOTSTRAP": s.kafka.bootstrap,
            "ADSTREAM_REDIS__URL": s.redis.url,
            "ADSTREAM_CLICKHOUSE__URL": s.clickhouse.url,
            "ADSTREAM_TOPIC_PREFIX": s.topic_prefix,
            "ADSTREAM_REDIS_PREFIX": s.redis_prefix,
            "ADSTREAM_STATE_DIR": str(s.state_dir),
            "ADSTREAM_SINK__FLUSH_S": str(s.sink.flush_s),
            "ADSTREAM_SINK__BATCH_SIZE": str(s.sink.batch_size),
            "ADSTREAM_METRICS__PORT": str(s.metrics.port),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


class Worker:
    """`adstream worker` as a child process (log in a file) that tests can kill -9."""

    def __init__(self, s: Settings, log: Path, engine: str = "faust") -> None:
        self.s = s
        self.log = log
        self.engine = engine
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        fh = self.log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "worker", "--loglevel", "warn", "--engine", self.engine],
            cwd=ROOT,
            env=worker_env(self.s),
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def produce(s: Settings, records: list[tuple[str, bytes | None, bytes]]) -> None:
    """Produce (contract topic, key, value) records in order, waiting for every delivery."""
    from aiokafka import AIOKafkaProducer

    async def go() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=s.kafka.bootstrap, linger_ms=5, acks=1)
        await producer.start()
        try:
            futs = [
                await producer.send(topics.topic_name(t, s.topic_prefix), value=v, key=k)
                for t, k, v in records
            ]
            await asyncio.gather(*futs)
        finally:
            await producer.stop()

    asyncio.run(go())


def consume_all(
    s: Settings,
    base_topic: str,
    expect: int | None = None,
    idle_s: float = 3.0,
    expect_within_s: float = 60.0,
) -> list[Any]:
    """Every record of a topic (all partitions, from the beginning) until idle; while fewer than
    `expect` arrived, until `expect_within_s` passed (a worker still starting on a loaded
    machine writes nothing for longer than `idle_s`)."""
    from aiokafka import AIOKafkaConsumer

    async def go() -> list[Any]:
        c = AIOKafkaConsumer(
            topics.topic_name(base_topic, s.topic_prefix),
            bootstrap_servers=s.kafka.bootstrap,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
        )
        await c.start()
        out: list[Any] = []
        try:
            last = time.monotonic()
            while time.monotonic() - last < (
                expect_within_s if expect is not None and len(out) < expect else idle_s
            ):
                batch = await c.getmany(timeout_ms=300)
                for recs in batch.values():
                    out += recs
                    last = time.monotonic()
                if expect is not None and len(out) >= expect:
                    break
        finally:
            await c.stop()
        return out

    return asyncio.run(go())


def wait_for(
    check: Callable[[], bool], timeout_s: float, what: str, worker: Worker | None = None, every: float = 0.5
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        if worker is not None and not worker.alive():
            raise AssertionError(f"worker died while waiting for {what}:\n{worker.tail()}")
        time.sleep(every)
    tail = worker.tail() if worker is not None else ""
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{tail}")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    """`name{labels}` → value of every adstream_streams_* sample on a worker's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("adstream_streams_"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out
