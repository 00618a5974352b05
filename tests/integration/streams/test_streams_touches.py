"""Outside touchpoints (`Touch` on ad.touches) through the worker's pipeline: a valid one lands in
ClickHouse's `touches` table as the sink writes every raw event, a bad one is dead-lettered with
its reason (counted), and neither changes any user's served state."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import pytest
from test_streams_pipeline_cache import records_of, run_pipeline

from schemas import topics
from schemas.clients import clickhouse_client, clickhouse_database
from schemas.codec import encode
from schemas.events import Conversion, Touch
from schemas.settings import Settings
from streams import metrics as m
from streams.pipeline import RawRecord

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.clickhouse, pytest.mark.timeout(120)]

TS = datetime(2026, 11, 1, 12, tzinfo=UTC)


def test_a_touch_is_sunk_and_a_bad_one_dead_lettered(deployment: Settings) -> None:
    good = Touch(
        event_id="tch1", ts=TS, user_id="u1", advertiser_id="adv", source="google", medium="cpc",
        campaign="brand", cost=0.42,
    )  # fmt: skip
    conv = Conversion(event_id="cv1", ts=TS, user_id="u1", campaign_id="c", advertiser_id="adv", value=3.0)
    records = records_of(deployment, [good, conv])
    bad = {**json.loads(encode(good)), "event_id": "tch2", "medium": ""}  # an empty utm_medium
    name = topics.topic_name(topics.TOUCHES, deployment.topic_prefix)
    records.append(RawRecord(name, 0, 5, json.dumps(bad).encode(), 0))
    invalid = m.INVALID.labels(topics.TOUCHES, "out_of_range")  # counted under the contract topic
    before = invalid._value.get()
    pipe = asyncio.run(run_pipeline(deployment, [], records))
    assert invalid._value.get() == before + 1
    client = clickhouse_client(deployment, clickhouse_database(deployment))
    try:
        rows = client.execute(
            "SELECT event_id, user_id, advertiser_id, source, medium, campaign, interaction, cost "
            "FROM touches FINAL"
        )
    finally:
        client.disconnect()
    assert rows == [("tch1", "u1", "adv", "google", "cpc", "brand", "click", 0.42)]
    # a touch on another channel says nothing about the user's interests here: no state from it
    assert all(s.events <= 1 for part in pipe.parts.values() for s in part.proc.states.values())
