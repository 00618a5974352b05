"""Served, shown, billed through the worker's pipeline on the real broker, Redis and ClickHouse:
render beacons (`View` on ad.views) make served impressions shown, once each in ClickHouse's
`views`; the day's spend in Redis counts CPM showings and CPC clicks only, exactly once; a
duplicate, late or unserved beacon is counted and never stored or billed; a forged one is
dead-lettered."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import pytest
import redis
from test_streams_pipeline_cache import records_of, run_pipeline

from schemas import topics
from schemas.billing import spend_key
from schemas.clients import clickhouse_client, clickhouse_database
from schemas.codec import encode
from schemas.events import AdCreative, BidType, Click, Impression, Render, View
from schemas.settings import Settings
from schemas.signing import event_key, seal
from streams import metrics as m
from streams.pipeline import RawRecord

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.clickhouse, pytest.mark.timeout(120)]

TS = datetime(2026, 11, 1, 12, tzinfo=UTC)


def at(s: float) -> datetime:
    return TS + timedelta(seconds=s)


def test_views_and_clicks_are_shown_and_billed_once(deployment: Settings) -> None:
    s = deployment.model_copy(
        update={
            "streams": deployment.streams.model_copy(
                update={"attribution_window_s": 60.0, "watermark_window": 1}
            )
        }
    )
    key = event_key(s)

    def imp(eid: str, t: float, bid_type: BidType, render: Render) -> Impression:
        return seal(
            Impression(event_id=eid, ts=at(t), user_id="u1", request_id="r", ad_id="ad1",
                       campaign_id=f"c-{eid}", advertiser_id="adv", slot="feed", position=0, price=2.0,
                       pctr=0.05, bid_type=bid_type, render=render),
            key,
        )  # fmt: skip

    def view(eid: str, t: float, iid: str) -> View:
        return seal(View(event_id=eid, ts=at(t), user_id="u1", impression_id=iid, ad_id="ad1"), key)

    def click(eid: str, t: float, iid: str) -> Click:
        return seal(
            Click(
                event_id=eid, ts=at(t), user_id="u1", impression_id=iid, ad_id="ad1", campaign_id=f"c-{iid}"
            ),
            key,
        )

    ad = AdCreative(event_id="cat-ad1", ts=at(-86400), ad_id="ad1", campaign_id="c", advertiser_id="adv",
                    category="shoes", title="Shoes", bid=1.0, daily_budget=100.0, active=True)  # fmt: skip
    events = [
        imp("a", 0, "cpm", "client"),  # shown by its first view; the others repeat it
        imp("b", 1, "cpc", "client"),  # shown, then clicked twice: billed once, on the click
        imp("c", 2, "cpm", "server"),  # shown when served
        imp("d", 3, "cpm", "client"),  # never shown: nothing
        imp("e", 4, "cpm", "client"),  # its view comes after the window
        view("va", 5, "a"),
        view("va2", 6, "a"),  # a second beacon (another id) of the same impression
        view("vb", 7, "b"),
        click("kb", 8, "b"),
        click("kb2", 9, "b"),
        view("vx", 10, "never-served"),  # a valid token, but no impression ever came
        view("ve", 70, "e"),  # 66 s after its impression: late
        imp("z", 200, "cpc", "client"),  # stream time passes every window
    ]
    records = records_of(s, events)
    again = next(r for r in records if json.loads(r.value or b"{}")["event_id"] == "va")
    records.append(RawRecord(again.topic, again.partition, 99, again.value, 0))  # the same beacon, re-sent
    forged = {**json.loads(encode(view("vf", 11, "a"))), "click_token": "A" * 22}
    views_topic = topics.topic_name(topics.VIEWS, s.topic_prefix)
    records.append(RawRecord(views_topic, 0, 100, json.dumps(forged).encode(), 0))
    refused = m.INVALID.labels(topics.VIEWS, "bad_click_token")
    before = refused._value.get()

    pipe = asyncio.run(run_pipeline(s, [ad], records))

    assert refused._value.get() == before + 1  # dead-lettered, never joined
    client = clickhouse_client(s, clickhouse_database(s))
    try:
        rows = client.execute(
            "SELECT event_id, impression_id, toUInt32(ts) FROM views FINAL ORDER BY event_id"
        )
        stored = client.execute("SELECT event_id, bid_type, render FROM impressions FINAL ORDER BY event_id")
    finally:
        client.disconnect()
    assert rows == [("va", "a", int(at(5).timestamp())), ("vb", "b", int(at(7).timestamp()))]
    assert ("a", "cpm", "client") in stored and ("c", "cpm", "server") in stored
    r = redis.Redis.from_url(s.redis.url)
    try:
        spend = {k.decode(): float(v) for k, v in r.hgetall(spend_key(s.redis_prefix, "20261101")).items()}
        assert r.ttl(spend_key(s.redis_prefix, "20261101")) > 0
    finally:
        r.close()
    # CPM a and c: price / 1000 = 0.002 each (price per thousand shown), once; CPC b: its price,
    # once; d, e and z: nothing
    assert spend == {"c-a": pytest.approx(0.002), "c-b": pytest.approx(2.0), "c-c": pytest.approx(0.002)}
    counts = pipe.outcome_counts()
    assert counts["shown"] == 3 and counts["billed"] == 3
    # va2 repeats a; ve comes after its window, and so does the re-sent va (its topic's records
    # come in offset order: it follows ve, when stream time has passed a's window); vx expired
    assert counts["view_repeat"] == 1 and counts["view_late"] == 2 and counts["view_unserved"] == 1
    # training learns what billing bills: a, b (its view) and c (server) are shown, so examples;
    # d and e were never shown when their windows closed: no example, counted (z is still open)
    assert counts["unshown"] == 2
    learned = counts["negative"] + counts["fake_negative"]
    assert learned == 3 and counts["positive"] == 1, counts
