"""M10.a / M10.b on the real broker, Redis and ClickHouse: a forged twin of a served impression
(produced before and after the served one) and fabricated clicks never reach the join, the user
state or ClickHouse; they are dead-lettered with their reason and counted."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis
from streams_it import Worker, consume_all, free_port, produce, scrape, wait_for
from test_streams_worker import all_applied, end_offsets

from schemas import topics
from schemas.clients import clickhouse_client, clickhouse_database
from schemas.codec import decode, encode, key_of, topic_of
from schemas.events import Click, DeadLetter, Dwell, Impression, Message, TrainingExample
from schemas.ids import impression_event_id
from schemas.settings import Settings
from schemas.signing import click_token, event_key, seal, sign_impression
from schemas.user_record import read_user_state
from streams.in_memory import replay
from streams.state import same_state

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.clickhouse, pytest.mark.timeout(240)]


def records(events: list[Message]) -> list[tuple[str, bytes | None, bytes]]:
    return [(topic_of(e), key_of(e), encode(e)) for e in events]


@pytest.mark.parametrize("engine", ["faust", "aiokafka"])
def test_forged_impressions_and_fabricated_clicks_are_dead_lettered(
    deployment: Settings, tmp_path: Path, engine: str
) -> None:
    s = deployment
    key = event_key(s)  # the stack's key, as the worker resolves it
    assert key is not None
    now = datetime.now(UTC).replace(microsecond=0)
    iid = impression_event_id("req-m10", 0)
    served = sign_impression(
        Impression(
            event_id=iid, ts=now, user_id="u-m10", request_id="req-m10", ad_id="ad-real",
            campaign_id="camp-real", advertiser_id="adv-real", slot="feed", position=0, price=0.5,
            pctr=0.04, model_version="ranker-v1",
        ),
        key,
    )  # fmt: skip
    # twins with another price and campaign: signed with another key (before), unsigned (after)
    twin = served.model_copy(
        update={"price": 99.0, "campaign_id": "camp-evil", "ad_id": "ad-evil", "sig": None}
    )
    forged_before = sign_impression(twin, b"x" * 32)
    forged_after = twin
    click = seal(
        Click(
            event_id="k-real", ts=now + timedelta(seconds=2), user_id="u-m10", impression_id=iid,
            ad_id="ad-real", campaign_id="camp-real",
        ),
        key,
    )  # fmt: skip
    token = click_token(key, iid, "u-m10", "ad-real")
    assert click.click_token == token  # what the response's served ad carried
    fabricated = [
        # the served ad's token, replayed by another user
        click.model_copy(update={"event_id": "k-other-user", "user_id": "u-other"}),
        # no token at all
        click.model_copy(update={"event_id": "k-no-token", "click_token": None}),
        # a dwell on an ad that was not served at that position
        Dwell(
            event_id="d-forged", ts=now + timedelta(seconds=3), user_id="u-m10", impression_id=iid,
            ad_id="ad-evil", dwell_ms=90_000, click_token=token,
        ),
    ]  # fmt: skip
    port = free_port()
    worker = Worker(
        s.model_copy(update={"metrics": s.metrics.model_copy(update={"port": port})}),
        tmp_path / "worker.log",
        engine,
    )
    try:
        # the forged twin is first on the partition: it would win the first-wins join
        produce(s, records([forged_before]))
        produce(s, records([served, forged_after]))
        produce(s, records([click, *fabricated]))
        ends = end_offsets(s)
        worker.start()
        r = redis.Redis.from_url(s.redis.url)
        wait_for(lambda: all_applied(r, s, ends), 120, "every record applied", worker)

        db = clickhouse_client(s, clickhouse_database(s))
        try:
            final = db.execute(
                "SELECT ad_id, campaign_id, price FROM impressions FINAL WHERE event_id = %(id)s", {"id": iid}
            )
            raw = db.execute("SELECT count() FROM impressions WHERE event_id = %(id)s", {"id": iid})
            clicks = db.execute("SELECT event_id FROM clicks FINAL")
            dwells = db.execute("SELECT count() FROM dwell")
        finally:
            db.disconnect()
        assert final == [("ad-real", "camp-real", 0.5)]
        assert raw == [(1,)]  # the forged rows never reached ClickHouse
        assert clicks == [("k-real",)] and dwells == [(0,)]

        state = read_user_state(r, s.redis_prefix, "u-m10")
        assert state is not None
        expected = replay([served, click], s).states["u-m10"]
        assert same_state(state, expected), (state, expected)
        assert read_user_state(r, s.redis_prefix, "u-other") is None

        letters = [decode(DeadLetter, rec.value) for rec in consume_all(s, topics.DLQ, expect=5)]
        errors = sorted(d.error for d in letters)
        assert len(letters) == 5, errors
        assert sum("bad impression signature" in e for e in errors) == 1, errors
        assert sum("unsigned impression" in e for e in errors) == 1, errors
        assert sum("click_token' does not match" in e for e in errors) == 2, errors
        assert sum("without a click token" in e for e in errors) == 1, errors
        forged_raws = {json.loads(d.raw)["event_id"] for d in letters}
        assert forged_raws == {iid, "k-other-user", "k-no-token", "d-forged"}

        examples = [decode(TrainingExample, rec.value) for rec in consume_all(s, topics.TRAINING_EXAMPLES)]
        assert examples and all(e.impression_id == iid for e in examples)
        assert all(e.ad_id == "ad-real" for e in examples)  # the join saw the served impression only

        metrics = scrape(port)
        invalid = {k: v for k, v in metrics.items() if k.startswith("adstream_streams_invalid_events_total")}
        imp_topic = topics.IMPRESSIONS
        assert invalid.get(f"adstream_streams_invalid_events_total{{reason=unsigned,topic={imp_topic}}}") == 1
        assert (
            invalid.get(f"adstream_streams_invalid_events_total{{reason=bad_signature,topic={imp_topic}}}")
            == 1
        )
        clicks_topic = topics.CLICKS
        assert (
            invalid.get(
                f"adstream_streams_invalid_events_total{{reason=bad_click_token,topic={clicks_topic}}}"
            )
            == 1
        )
        assert (
            invalid.get(
                f"adstream_streams_invalid_events_total{{reason=no_click_token,topic={clicks_topic}}}"
            )
            == 1
        )
        r.close()
    finally:
        worker.stop()
