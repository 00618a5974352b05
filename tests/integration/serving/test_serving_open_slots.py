"""Slots from settings on the request path (`serving.request.RequestPath`, as the replica runs
it, with the real Redis): a fourth configured slot is served end to end with its own slot
adapter (folded, as the defaults' are), and the request edge refuses a slot not configured with
a 422 naming `slot` (issue 34 item 5)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from helpers_serving import add_ads, put_slot_adapter
from starlette.requests import Request

from schemas.api import AdRequest, AdResponse
from schemas.events import Impression
from schemas.settings import Settings
from serving.adapters import CANDIDATE
from serving.catalog import Catalog
from serving.deadline import Deadline
from serving.http import BodyAdmission
from serving.io import RedisIO, UserRecordCodec
from serving.pipeline import AdPipeline, RequestContext, content_vectorizer, utcnow
from serving.ranking import RankModel
from serving.request import RequestPath
from trainers.models.ranker import Ranker, RankerConfig, slot_buckets_for

pytestmark = [pytest.mark.redis]
SLOTS = ("feed", "search", "splash", "news")
# a ranker trained while `news` is configured: hashed rows for slots beyond the defaults
CFG = RankerConfig(state_dim=16, emb_dim=4, deep_hidden=16, slot_buckets=slot_buckets_for(SLOTS))
TS = datetime(2026, 1, 1, tzinfo=UTC)


def _settings(tmp_path: Path) -> Settings:
    return Settings(
        state_dim=16,
        recall={"k": 30},
        state_dir=tmp_path,
        redis_prefix=f"slots-test-{uuid.uuid4().hex[:8]}:",
        explore={"epsilon": 0.0},
        ab={"control_share": 0.0, "correction_share": 0.0},
        slots={"names": list(SLOTS)},
    )


def _path(s: Settings, emitted: list[Impression]) -> tuple[RequestPath, RedisIO, AdPipeline]:
    torch.manual_seed(0)
    pipe = AdPipeline(
        s,
        RankModel(Ranker(CFG).eval(), "v0", s, torch.device("cpu")),
        Catalog(16, CFG, content_vectorizer(16)),
    )
    add_ads(pipe, TS)
    io = RedisIO(s, UserRecordCodec(s.state))

    async def score(items):  # type: ignore[no-untyped-def]
        return [pipe.rank.score([inp], use)[0] for inp, use in items]

    return RequestPath(pipe, io, score, emitted.extend), io, pipe


def _serve(path: RequestPath, io: RedisIO, reqs: list[AdRequest]) -> list[AdResponse]:
    async def run() -> list[AdResponse]:
        t0 = time.perf_counter()
        ctxs = [RequestContext(r, f"r{i}", utcnow(), deadline=Deadline(5000.0, start=t0))
                for i, r in enumerate(reqs)]  # fmt: skip
        out = await path.serve(ctxs)
        await io.close()
        return list(out)

    return asyncio.run(run())


def test_a_configured_fourth_slot_is_served_with_its_own_adapter(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    emitted: list[Impression] = []
    path, io, pipe = _path(s, emitted)
    put_slot_adapter(pipe, "news")
    # the slot adapter is folded into a copy of the base, as the default slots' adapters are
    assert pipe.rank.bank.row("news", CANDIDATE) in pipe.rank.folded.rows()
    news, feed = _serve(
        path, io, [AdRequest(user_id="u1", slot="news", k=4), AdRequest(user_id="u1", slot="feed", k=4)]
    )
    assert len(news.ads) == 4 and news.served_by == "adapter" and not news.degraded
    assert news.adapter_version == "seq-1" and feed.adapter_version is None
    imps = [i for i in emitted if i.request_id == news.request_id]
    assert {i.slot for i in imps} == {"news"} and {i.ad_id for i in imps} == {a.ad_id for a in news.ads}
    assert all(i.sig for i in imps)  # signed as every impression is
    # the slot reaches the model: its hashed row (and adapter) give other scores than feed's
    assert {a.ad_id: a.pctr for a in news.ads} != {a.ad_id: a.pctr for a in feed.ads}


def _request(body: bytes) -> Request:
    sent = [False]

    async def receive() -> dict[str, object]:
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/ads",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "query_string": b"",
    }
    return Request(scope, receive)


def test_a_slot_not_configured_is_refused_naming_the_field(tmp_path: Path) -> None:
    edge = BodyAdmission(8, _settings(tmp_path).slots.names)
    defaults = BodyAdmission(8, Settings().slots.names)

    async def run() -> None:
        ok = await edge.parse(_request(b'{"user_id": "u", "slot": "news"}'), 65536)
        assert isinstance(ok, AdRequest) and ok.slot == "news"
        for gate, body in (
            (defaults, b'{"user_id": "u", "slot": "news"}'),
            (edge, b'{"user_id": "u", "slot": "sidebar"}'),
        ):
            r = await gate.parse(_request(body), 65536)
            assert not isinstance(r, AdRequest) and r.status_code == 422
            detail = json.loads(bytes(r.body))["detail"]
            assert [d["loc"] for d in detail] == [["slot"]] and "not a configured slot" in detail[0]["msg"]
        # a name that is no slot identifier at all is refused by the contract itself
        r = await edge.parse(_request(b'{"user_id": "u", "slot": "News Feed"}'), 65536)
        assert not isinstance(r, AdRequest) and r.status_code == 422

    asyncio.run(run())
