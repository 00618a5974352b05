"""Every consumer of the loop fetches with `kafka.fetch_max_wait_ms`.

Faust hard-codes `fetch_max_wait_ms=1500` for its worker consumer, and aiokafka defaults to 500;
the local Tansu answers a fetch that has nothing new only after about half of it. A click sat in
the broker that long before the worker saw it, and the example and the delta waited again at
the trainer and the replica: the loop's freshness P99 read 2.2 s on a 2-vCPU EPYC (goal 2 s).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from schemas.clients import fetch_args
from schemas.settings import Settings


def test_fetch_args_carry_the_setting() -> None:
    assert fetch_args(Settings()) == {"fetch_max_wait_ms": 100}
    assert fetch_args(Settings(kafka={"fetch_max_wait_ms": 20}))["fetch_max_wait_ms"] == 20


def test_the_faust_worker_consumer_fetches_with_the_setting(tmp_path: Path) -> None:
    from streams.app import create_app
    from streams.engine_faust import BatchConsumer

    async def build() -> int:
        s = Settings(state_dir=tmp_path, topic_prefix="fetchwait.", kafka={"fetch_max_wait_ms": 40})
        app = create_app(s)
        consumer = app.consumer
        assert isinstance(consumer, BatchConsumer)
        client = consumer._thread._create_worker_consumer(app.transport)  # not started: no I/O
        return int(client._fetch_max_wait_ms)

    assert asyncio.run(build()) == 40  # Faust's own would be 1500
