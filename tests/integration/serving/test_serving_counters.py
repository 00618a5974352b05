"""Frequency-cap and spend counters survive a failed Redis write and are not double counted."""

from __future__ import annotations

import asyncio
import socket
from datetime import UTC, datetime

import pytest

from schemas.events import Impression
from schemas.settings import Settings
from serving.io import RedisIO, day_of, fcap_key

pytestmark = [pytest.mark.redis]

NOW = datetime(2026, 11, 29, 12, tzinfo=UTC)


def imp(ad: str) -> Impression:
    return Impression(
        event_id=f"r/{ad}", ts=NOW, user_id="u1", request_id="r", ad_id=ad, campaign_id="c1",
        advertiser_id="v1", slot="feed", position=0, price=0.5,
    )  # fmt: skip


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_failed_flush_keeps_counts_and_retry_writes_them_once(stack: Settings, redis_client: object) -> None:
    settings = Settings(
        **{**stack.model_dump(), "serving": {**stack.serving.model_dump(), "frequency_cap": 2}}
    )
    io = RedisIO(settings, None)
    good = io.client
    io.record("u1", NOW, [imp("a1"), imp("a1"), imp("a2")], [0.5, 0.5, 0.25])

    async def scenario() -> tuple[list[str], dict[str, float]]:
        import redis.asyncio as aredis

        io.client = aredis.Redis.from_url(f"redis://127.0.0.1:{dead_port()}/0", socket_timeout=0.5)
        with pytest.raises(Exception):  # noqa: B017 - any connection error
            await io.flush()
        io.client = good
        _, capped = await io.read("u1", NOW)  # the cap still holds while the counts wait
        assert await io.flush() > 0
        assert await io.flush() == 0  # nothing left: written exactly once
        _, capped_after = await io.read("u1", NOW)
        assert capped_after == capped
        return capped, await io.spend(NOW)

    capped, spend = asyncio.run(scenario())
    assert capped == ["a1"]
    assert spend == {"c1": pytest.approx(1.25)}
    raw = redis_client.hgetall(fcap_key(settings.redis_prefix, day_of(NOW), "u1"))  # type: ignore[attr-defined]
    assert {k.decode(): int(v) for k, v in raw.items()} == {"a1": 2, "a2": 1}
