"""Campaigns on the real ad server: a `Campaign` on `ad.campaigns` reaches the replica's catalog
live, and its geo and device targeting decide who is shown its ads (issue 34 item 4)."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime

import httpx
import pytest

from deploy.produce import produce_lines
from schemas import topics
from schemas.codec import encode
from schemas.events import AdCreative, Campaign, Targeting
from schemas.settings import Settings

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.kafka]

TS = datetime(2026, 1, 1, tzinfo=UTC)


def served(server: httpx.Client, **body: object) -> set[str]:
    user = f"camp-{uuid.uuid4().hex[:12]}"  # a new user: no state, no frequency caps
    req = {"user_id": user, "slot": "feed", "k": 20, "preview": True, "context": {"category": "kites"}}
    r = server.post("/v1/ads", json=req | body)
    assert r.status_code == 200, r.text
    return {a["ad_id"] for a in r.json()["ads"]}


def test_a_live_campaign_targets_its_audience(server: httpx.Client, serve_settings: Settings) -> None:
    cid = f"kites-{uuid.uuid4().hex[:6]}"
    camp = Campaign(event_id=f"k-{cid}", ts=TS, campaign_id=cid, advertiser_id="kite-co", daily_budget=1e5,
                    targeting=Targeting(geo=("DE", "AT"), devices=("mobile",)))  # fmt: skip
    ads = [
        AdCreative(event_id=f"e-{cid}-{i}", ts=TS, ad_id=f"{cid}-{i}", campaign_id=cid,
                   advertiser_id="kite-co", category="kites", title=f"kites for the beach {i}", bid=9.0,
                   daily_budget=1e5, active=True)
        for i in range(3)
    ]  # fmt: skip
    mine = {a.ad_id for a in ads}
    asyncio.run(produce_lines(serve_settings, topics.CAMPAIGNS, [encode(camp)], sign=False))
    asyncio.run(produce_lines(serve_settings, topics.CATALOG, [encode(a) for a in ads], sign=False))
    deadline = time.monotonic() + 30
    while not mine & served(server, geo="DE", device="mobile"):
        assert time.monotonic() < deadline, "the campaign's ads never reached the replica"
        time.sleep(0.3)
    assert mine & served(server, geo="AT", device="mobile")  # diversity may keep one per advertiser
    for outside in ({"geo": "FR", "device": "mobile"}, {"geo": "DE", "device": "desktop"}, {"geo": "DE"}, {}):
        assert not mine & served(server, **outside), outside
    r = server.post("/v1/ads", json={"user_id": "u", "slot": "feed", "geo": "Germany"})
    assert r.status_code == 422 and "geo" in r.text


def test_rank_route_over_http(server: httpx.Client, catalog: list[AdCreative]) -> None:
    """`POST /v1/rank` on the real ad server: the caller's candidates ranked and served (click
    tokens, as `/v1/ads`), unknown ids reported; bad lists are 422 naming the field."""
    ids = [a.ad_id for a in catalog[:30]] + ["not-in-the-catalog"]
    body = {
        "user_id": f"rank-{uuid.uuid4().hex[:8]}",
        "slot": "feed",
        "k": 5,
        "preview": True,
        "candidates": ids,
    }
    r = server.post("/v1/rank", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["unknown"] == ["not-in-the-catalog"] and out["ineligible"] == []
    assert len(out["ads"]) == 5 and {a["ad_id"] for a in out["ads"]} <= set(ids)
    assert all(a["click_token"] for a in out["ads"])
    for bad in ([], ["a", "a"], [1, 2]):
        r = server.post("/v1/rank", json=body | {"candidates": bad})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][0] == "candidates", r.text
    assert server.post("/v1/rank", content=b"x", headers={"content-type": "text/plain"}).status_code == 415
    from adstream_client import AdstreamClient  # the typed client says the same

    with AdstreamClient(str(server.base_url)) as client:
        got = client.rank(body["user_id"], ids, slot="feed", k=3, preview=True)
    assert got.unknown == ["not-in-the-catalog"] and len(got.ads) == 3
