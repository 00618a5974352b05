"""The per-user correction each example was served with, read from a real Redis (trainers.corrections)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest

from schemas.events import TrainingExample
from schemas.settings import Settings, StateSettings
from schemas.user_record import UserState, encode_state, user_key
from trainers.corrections import CorrectionReader

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]
T0 = datetime(2026, 12, 1, tzinfo=UTC)


def _example(
    imp: str, user: str, category: str, at: datetime, kind: str = "fake_negative"
) -> TrainingExample:
    return TrainingExample(
        event_id=f"te-{imp}-{kind}", ts=at, adapter_id="feed", impression_id=imp, impression_ts=at,
        user_id=user, ad_id="ad1", campaign_id="c1", advertiser_id="v1", category=category, slot="feed",
        position=0, hour=at.hour, user_vector=[0.0] * 4, intent_score=0.0, click=kind == "click",
        label_kind=kind,
    )  # fmt: skip


def _record(user: str, bias: dict[str, float]) -> bytes:
    state = UserState(user, 4, np.zeros(4, np.float32), last_ts=T0.timestamp(), events=5, bias=bias)
    return encode_state(state)


def test_corrections_are_the_served_bias_decayed_to_the_impression_and_read_once(stack: Settings) -> None:
    import redis.asyncio as aredis

    prefix = f"{stack.redis_prefix}corr-{uuid.uuid4().hex[:6]}:"
    params = StateSettings(half_life_s=3600.0)

    async def scenario() -> tuple[Any, ...]:
        client = aredis.Redis.from_url(stack.redis.url)
        try:
            await client.set(user_key(prefix, "u1"), _record("u1", {"a": 1.0, "b": -0.5}))
            reader = CorrectionReader(client, prefix, params, remember=100)
            first = await reader.read(
                [
                    _example("i1", "u1", "a", T0 + timedelta(hours=1)),  # one half-life later
                    _example("i2", "u1", "b", T0),
                    _example("i3", "u2", "a", T0),  # no record
                    _example("i4", "u1", "c", T0),  # no bias for that category
                ]
            )
            # the worker folds i1's click into the record (+lr): its click row keeps the offset
            # its impression was learned with; a new impression reads the record as it is now
            await client.set(user_key(prefix, "u1"), _record("u1", {"a": 3.0}))
            later = await reader.read(
                [_example("i1", "u1", "a", T0 + timedelta(hours=1), "click"), _example("i5", "u1", "a", T0)]
            )
            return first, later
        finally:
            await client.delete(user_key(prefix, "u1"))
            await client.aclose()

    first, later = asyncio.run(scenario())
    assert first.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert later.tolist() == pytest.approx([0.5, 3.0])


def test_the_reader_forgets_the_oldest_impressions_first() -> None:
    reader = CorrectionReader(None, "p:", StateSettings(), remember=2)
    reader.remembered({"i1": 1.0, "i2": 2.0})
    reader.remembered({"i3": 3.0})
    assert [reader.known(i) for i in ("i1", "i2", "i3")] == [None, 2.0, 3.0]
