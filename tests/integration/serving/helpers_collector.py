"""Shared by the collector tests: read events of a topic by id, and Prometheus samples of a server."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from schemas import topics
from schemas.settings import Settings


def read_by_id(settings: Settings, base_topic: str, ids: Iterable[str], idle_s: float = 2.0) -> list[str]:
    """The `event_id` of every record of a topic whose id is in `ids` (repeats kept), read from the
    beginning until nothing arrived for `idle_s` (after the first wanted record, or 30 s)."""
    from aiokafka import AIOKafkaConsumer

    wanted = set(ids)

    async def go() -> list[str]:
        c = AIOKafkaConsumer(
            topics.topic_name(base_topic, settings.topic_prefix),
            bootstrap_servers=settings.kafka.bootstrap,
            auto_offset_reset="earliest",
            group_id=None,
        )
        await c.start()
        found: list[str] = []
        try:
            start = last = time.monotonic()
            while time.monotonic() - last < idle_s or (not found and time.monotonic() - start < 30):
                batch = await c.getmany(timeout_ms=300)
                for recs in batch.values():
                    last = time.monotonic()
                    found += [e for r in recs if (e := json.loads(r.value)["event_id"]) in wanted]
        finally:
            await c.stop()
        return found

    return asyncio.run(go())


def samples(client: httpx.Client, path: str = "/metrics") -> dict[str, float]:
    """`name{k=v,…}` → value of every adstream_serving_* sample a server exposes."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get(path).text):
        for s in family.samples:
            if s.name.startswith("adstream_serving_"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
    return out
