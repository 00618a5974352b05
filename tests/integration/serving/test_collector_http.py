"""`POST /v1/events` on the real Serve app and broker, through `adstream_client`: a batch with
good and forged events (207, each refusal by index/field/reason, the good ones on Kafka once,
forged ones counted), bad bodies never a 5xx, and the stand-alone collector deployment with
publisher keys and its rate limit (401, 429 + Retry-After)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import pytest
from helpers_collector import read_by_id, samples

from adstream_client import (
    AdstreamClient,
    AdstreamHTTPError,
    AsyncAdstreamClient,
    RetryPolicy,
    click_for,
    view_for,
)
from schemas import topics
from schemas.events import Conversion, Impression
from schemas.settings import Settings

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.kafka, pytest.mark.timeout(180)]
KEYS = ("pub-test-key-0001", "pub-test-key-0002")
ONCE = RetryPolicy(attempts=1)


def test_a_mixed_batch_is_answered_per_event_and_produced_once(
    server: httpx.Client, serve_settings: Settings
) -> None:
    user, now = f"u-col-{uuid.uuid4().hex[:8]}", datetime.now(UTC)
    forged_before = samples(server).get("adstream_serving_forged_events_total{field=click_token}", 0.0)
    with AdstreamClient(str(server.base_url), retry=ONCE) as client:
        resp = client.ads(user, slot="feed", k=3)
        assert len(resp.ads) == 3
        click, view = click_for(resp, 0, user), view_for(resp, 1, user)
        stolen = click_for(resp, 2, user).model_copy(update={"user_id": "u-thief", "event_id": f"x-{user}"})
        unsigned = Impression(
            event_id=f"imp-{user}", ts=now, user_id=user, request_id="r-pub", ad_id="ad0001",
            campaign_id="c1", advertiser_id="v1", slot="feed", position=0, price=9.0,
        )  # fmt: skip
        conv = Conversion(
            event_id=f"cv-{user}", ts=now, user_id=user, campaign_id="c1", advertiser_id="v1", value=3.0
        )
        result = client.events([click, stolen, unsigned, conv, view])
    assert result.accepted == 3
    assert [(r.index, r.field, r.reason) for r in result.rejected] == [
        (1, "click_token", "bad_click_token"),
        (2, "sig", "unsigned"),
    ]
    # the same batch by hand: 207 is the status of a batch with refusals and productions
    again = server.post("/v1/events", json={"events": [json.loads(click.model_dump_json()), {"kind": "x"}]})
    assert again.status_code == 207, again.text
    # the broker holds what was accepted (twice the click: sent twice, one event id for the stores)
    assert (
        read_by_id(serve_settings, topics.CLICKS, [click.event_id, stolen.event_id]) == [click.event_id] * 2
    )
    assert read_by_id(serve_settings, topics.VIEWS, [view.event_id]) == [view.event_id]
    assert read_by_id(serve_settings, topics.CONVERSIONS, [conv.event_id]) == [conv.event_id]
    assert read_by_id(serve_settings, topics.IMPRESSIONS, [unsigned.event_id], idle_s=1.0) == []
    after = samples(server)
    assert after["adstream_serving_forged_events_total{field=click_token}"] == forged_before + 1
    assert after["adstream_serving_collector_batches_total{status=207}"] >= 2


BAD: list[tuple[bytes, dict[str, str]]] = [
    (b"", {}),
    (b"null", {}),
    (b"{", {}),
    (b'{"events": 5}', {}),
    (b'{"events": [], "x": 1}', {}),
    (b'{"events": [1, "a", null, {}]}', {}),
    (b'{"events": [{"kind": "adapter_delta"}]}', {}),
    (b'{"events": [{"kind": "click", "ts": "2026-01-01T00:00:00"}]}', {}),
    ('{"events": [{"kind": "click", "user_id": "\ud800"}]}'.encode("utf-8", "surrogatepass"), {}),
    (b"\xff" * 10, {}),
    (b'{"events": []}', {"content-type": "text/plain"}),
    (b'{"events": [' + b"{}," * 600 + b"{}]}", {}),
    (b"[" * 50_000, {}),
    (b" " * 300_000, {}),
]


@pytest.mark.parametrize(("body", "headers"), BAD)
def test_bad_input_is_refused_never_a_5xx(server: httpx.Client, body: bytes, headers: dict[str, str]) -> None:
    r = server.post("/v1/events", content=body, headers={"content-type": "application/json", **headers})
    assert r.status_code in (413, 415, 422), (r.status_code, r.text)
    answer = r.json()
    if "rejected" in answer:  # per-event refusals: every one named
        assert answer["accepted"] == 0 and answer["rejected"]
        assert all({"index", "field", "reason", "message"} <= set(x) for x in answer["rejected"])
    else:
        assert answer["detail"]


async def test_async_client_round_trip(server: httpx.Client) -> None:
    user = f"u-col-a-{uuid.uuid4().hex[:8]}"
    async with AsyncAdstreamClient(str(server.base_url), retry=ONCE) as client:
        resp = await client.ads(user, slot="search", k=2)
        result = await client.events([click_for(resp, 1, user)])
    assert (result.accepted, result.rejected) == (1, [])


@pytest.fixture(scope="module")
def collector(server: httpx.Client, serve_settings: Settings) -> Iterator[httpx.Client]:
    """The stand-alone collector deployment beside the ad server (route prefix /collector), with
    publisher keys and a small bucket: 5 events, then 1 every 10 s."""
    from ray import serve

    from serving.collector_app import build_collector_app

    s = Settings(
        **{
            **serve_settings.model_dump(),
            "serving": {**serve_settings.serving.model_dump(), "api_keys": ",".join(KEYS), "replicas": 1},
            "collector": {**serve_settings.collector.model_dump(), "burst": 5, "rate_per_s": 0.1},
        }
    )
    serve.run(build_collector_app(s), name="test-collector", route_prefix="/collector", blocking=False)
    proxy = f"http://{s.serving.http_host}:{s.serving.http_port}/collector"
    client = httpx.Client(base_url=proxy, timeout=30)
    deadline = time.monotonic() + 60
    while True:
        try:
            if client.get("/healthz").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the collector did not get ready"
        time.sleep(0.5)
    try:
        yield client
    finally:
        client.close()
        serve.delete("test-collector")


def test_standalone_collector_keys_and_rate_limit(server: httpx.Client, collector: httpx.Client) -> None:
    user = f"u-col-s-{uuid.uuid4().hex[:8]}"
    with AdstreamClient(str(server.base_url), retry=ONCE) as ads:
        resp = ads.ads(user, slot="feed", k=3)
    events = [click_for(resp, i, user) for i in range(3)] + [view_for(resp, i, user) for i in range(2)]
    base = str(collector.base_url)
    for key in (None, "not-a-key"):
        with AdstreamClient(base, api_key=key, retry=ONCE) as c, pytest.raises(AdstreamHTTPError) as info:
            c.events(events[:1])
        assert info.value.status == 401
    with AdstreamClient(base, api_key=KEYS[0], retry=ONCE) as c:
        assert c.events(events).accepted == 5  # the whole bucket
        with pytest.raises(AdstreamHTTPError) as info:
            c.events(events[:1])
    assert info.value.status == 429 and info.value.retry_after is not None and info.value.retry_after >= 1
    with AdstreamClient(base, api_key=KEYS[1], retry=ONCE) as c:  # another key: its own bucket
        assert c.events(events[:1]).accepted == 1
    js = collector.get("/adstream.js")
    assert js.status_code == 200 and "AdStream" in js.text
    assert samples(collector)["adstream_serving_collector_batches_total{status=429}"] == 1


def test_a_large_batch_is_produced_whole(server: httpx.Client, serve_settings: Settings) -> None:
    """200 events (judged off the replica's loop) all on the broker once acknowledged."""
    user, now = f"u-col-l-{uuid.uuid4().hex[:8]}", datetime.now(UTC)
    convs = [
        Conversion(
            event_id=f"cv-{user}-{i}", ts=now, user_id=user, campaign_id="c1", advertiser_id="v1", value=i
        )
        for i in range(200)
    ]
    with AdstreamClient(str(server.base_url), retry=ONCE) as client:
        result = client.events(convs)
    assert (result.accepted, result.rejected) == (200, [])
    ids = [c.event_id for c in convs]
    assert sorted(read_by_id(serve_settings, topics.CONVERSIONS, ids)) == sorted(ids)
