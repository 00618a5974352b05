"""The closed loop on the new paths end to end (issue 34 items 5 and 6): a simulated market with
CPM and CPC campaigns asks the request path (`serving.request.RequestPath`, as a replica runs it,
with the real Redis) for ads over the HTTP contract, its users render, click and convert, and the
worker's pipeline on the real broker, Redis and ClickHouse bills CPM campaigns on their render
beacons (price / 1000 per shown impression) and CPC campaigns on their clicks (price per first
click), each exactly what the served impressions say; search requests' impressions carry their
query match into ClickHouse."""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
import redis
import torch
from test_streams_pipeline_cache import records_of, run_pipeline

from schemas.api import AdRequest
from schemas.billing import PER_MILLE
from schemas.clients import clickhouse_client, clickhouse_database
from schemas.events import Click, Impression, Message, View
from schemas.settings import Settings
from serving.catalog import Catalog
from serving.io import RedisIO, UserRecordCodec
from serving.pipeline import AdPipeline, RequestContext, content_vectorizer, utcnow
from serving.ranking import RankModel
from serving.request import RequestPath
from trainers.models.ranker import Ranker, RankerConfig
from workloads import Market, MarketConfig
from workloads.closed_loop import run_closed_loop

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.clickhouse, pytest.mark.timeout(180)]


async def _closed_loop(s: Settings, market: Market, n: int) -> tuple[list[Impression], list[Message]]:
    """(the impressions serving emitted, the events the simulated users sent) of a closed loop."""
    torch.manual_seed(0)
    cfg = RankerConfig(state_dim=s.state_dim)
    pipe = AdPipeline(
        s, RankModel(Ranker(cfg).eval(), "v0", s, torch.device("cpu")),
        Catalog(s.state_dim, cfg, content_vectorizer(s.state_dim), text_dim=s.recall.text_dim),
    )  # fmt: skip
    for ad in market.catalog():
        pipe.add_ad(ad)
    for campaign in market.campaigns():
        pipe.catalog.upsert_campaign(campaign)
    io = RedisIO(s, UserRecordCodec(s.state))
    served: list[Impression] = []

    async def score(items):  # type: ignore[no-untyped-def]
        return pipe.rank.score([i for i, _ in items], False) if items else []

    path = RequestPath(pipe, io, score, served.extend)
    numbers = itertools.count()

    async def ads(request: httpx.Request) -> httpx.Response:
        req = AdRequest.model_validate_json(request.content)
        (resp,) = await path.serve([RequestContext(req, f"loop-{next(numbers)}", utcnow())])
        body = resp.model_dump_json()
        return httpx.Response(200, content=body, headers={"content-type": "application/json"})

    sent: list[Message] = []

    async def sink(batch: list[Message]) -> None:
        sent.extend(batch)

    client = httpx.AsyncClient(base_url="http://serving", transport=httpx.MockTransport(ads))
    try:
        report = await run_closed_loop(market, "http://serving", n, sink, client=client)
    finally:
        await client.aclose()
        await io.close()
    assert report.requests == n and not report.errors
    return served, sent


def test_a_closed_loop_bills_cpm_on_views_and_cpc_on_clicks(deployment: Settings, tmp_path: Path) -> None:
    s = deployment.model_copy(update={"state_dir": tmp_path})
    market = Market(
        MarketConfig(seed=21, n_users=80, n_ads=60, n_advertisers=10, cpm_share=0.5, bias=-1.5,
                     drift_at=None, new_ads_at=None)
    )  # fmt: skip
    served, sent = asyncio.run(_closed_loop(s, market, 60))
    assert {i.bid_type for i in served} == {"cpm", "cpc"} and all(i.render == "client" for i in served)
    clicked = {e.impression_id for e in sent if isinstance(e, Click)}
    views = [e for e in sent if isinstance(e, View)]
    assert clicked and len(views) == len(served)  # the simulated page shows every served ad

    events: list[Message] = sorted([*served, *sent], key=lambda m: m.ts)
    asyncio.run(run_pipeline(s, market.catalog(), records_of(s, events)))

    want: dict[str, float] = defaultdict(float)
    for imp in served:
        if imp.bid_type == "cpm":  # shown (its view came a second later): price per thousand / 1000
            want[imp.campaign_id] += imp.price / PER_MILLE
        elif imp.event_id in clicked:  # its first click: the price per click
            want[imp.campaign_id] += imp.price
    r = redis.Redis.from_url(s.redis.url)
    try:
        billed: dict[str, float] = defaultdict(float)
        for key in r.scan_iter(match=f"{s.redis_prefix}spend:*"):
            for campaign, spend in r.hgetall(key).items():
                billed[campaign.decode()] += float(spend)
    finally:
        r.close()
    assert billed.keys() == {c for c, v in want.items() if v > 0}
    assert all(billed[c] == pytest.approx(v) for c, v in want.items() if v > 0)
    kinds = {c.campaign_id: c.bid_type for c in market.campaigns()}
    assert {kinds[c] for c in billed} == {"cpm", "cpc"}  # both kinds billed, each on its event

    client = clickhouse_client(s, clickhouse_database(s))
    try:
        (shown,) = client.execute("SELECT count() FROM views FINAL")[0]
        stored = client.execute("SELECT event_id, bid_type, query_match FROM impressions FINAL")
    finally:
        client.disconnect()
    assert shown == len(served)
    by_id = {i.event_id: i for i in served}
    assert {e: (b, q) for e, b, q in stored} == {e: (i.bid_type, i.query_match) for e, i in by_id.items()}
    search = [i for i in served if i.slot == "search"]
    assert search and all(i.query_match is not None for i in search)  # the market's searches carry a query
    assert all(i.query_match is None for i in served if i.slot != "search")
