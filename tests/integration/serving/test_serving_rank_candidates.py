"""`/v1/rank` on the request path (`serving.request.RequestPath`, as the replica runs it, with
the real Redis): the caller's candidates are ranked by the same ranker, caps, pacing and
targeting as `/v1/ads`; unknown and ineligible ids are reported, never served (issue 34 item 5)."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from schemas.api import MAX_CANDIDATES, AdRequest, RankRequest, RankResponse
from schemas.events import AdCreative, Campaign, Impression, Targeting
from schemas.settings import Settings
from serving.catalog import Catalog
from serving.deadline import Deadline
from serving.io import RedisIO, UserRecordCodec
from serving.pipeline import AdPipeline, RequestContext, content_vectorizer, utcnow
from serving.ranking import RankModel
from serving.request import RequestPath
from trainers.models.ranker import Ranker, RankerConfig

pytestmark = [pytest.mark.redis]
CFG = RankerConfig(state_dim=16, emb_dim=4, deep_hidden=16)
TS = datetime(2026, 1, 1, tzinfo=UTC)


def _path(tmp_path: Path, emitted: list[Impression]) -> tuple[RequestPath, RedisIO]:
    torch.manual_seed(0)
    s = Settings(
        state_dim=16,
        recall={"k": 30},
        state_dir=tmp_path,
        redis_prefix=f"rank-test-{uuid.uuid4().hex[:8]}:",
        explore={"epsilon": 0.0},
    )
    pipe = AdPipeline(
        s,
        RankModel(Ranker(CFG).eval(), "v0", s, torch.device("cpu")),
        Catalog(16, CFG, content_vectorizer(16)),
    )
    pipe.catalog.upsert_campaign(
        Campaign(event_id="k", ts=TS, campaign_id="c-fr", advertiser_id="v0", daily_budget=1e6,
                 targeting=Targeting(geo=("FR",)))
    )  # fmt: skip
    for i in range(60):
        cat = ["shoes", "tech", "food"][i % 3]
        pipe.add_ad(
            AdCreative(event_id=f"e{i}", ts=TS, ad_id=f"a{i}", campaign_id="c-fr" if i == 7 else f"c{i % 4}",
                       advertiser_id=f"v{i % 6}", category=cat, title=f"{cat} item {i}", bid=1.0 + i % 3,
                       daily_budget=1e6, active=i != 5)
        )  # fmt: skip
    io = RedisIO(s, UserRecordCodec(s.state))

    async def score(items):  # type: ignore[no-untyped-def]
        return pipe.rank.score([i for i, _ in items], False) if items else []

    return RequestPath(pipe, io, score, emitted.extend), io


def _serve(path: RequestPath, io: RedisIO, reqs: list[AdRequest], deadline_ms: float = 5000.0) -> list:  # type: ignore[type-arg]
    async def run():  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        ctxs = [RequestContext(r, f"r{i}", utcnow(), deadline=Deadline(deadline_ms, start=t0))
                for i, r in enumerate(reqs)]  # fmt: skip
        out = await path.serve(ctxs)
        await io.close()
        return out

    return asyncio.run(run())


def test_the_callers_candidates_are_ranked_and_the_rest_reported(tmp_path: Path) -> None:
    emitted: list[Impression] = []
    path, io = _path(tmp_path, emitted)
    cands = ["a1", "a2", "nope", "a5", "a7", "a10", "a11", "a12", "a13", "also-nope"]
    rank = RankRequest(user_id="u1", slot="feed", k=4, candidates=cands)
    plain = AdRequest(user_id="u2", slot="feed", k=4)  # served in the same batch, by recall
    resp, other = _serve(path, io, [rank, plain])
    assert isinstance(resp, RankResponse) and not isinstance(other, RankResponse)
    assert resp.unknown == ["nope", "also-nope"]
    assert resp.ineligible == ["a5", "a7"]  # inactive; its campaign targets FR and the request says no geo
    served = [a.ad_id for a in resp.ads]
    assert len(served) == 4 and set(served) <= {"a1", "a2", "a10", "a11", "a12", "a13"}
    assert resp.served_by == "adapter" and not resp.degraded
    assert all(a.click_token for a in resp.ads)
    assert {i.ad_id for i in emitted if i.request_id == resp.request_id} == set(served)
    # ranked by the same model as /v1/ads: the order is the scores' (no exploration here)
    scores = [a.score for a in resp.ads]
    assert scores == sorted(scores, reverse=True)


def test_targeting_and_the_popular_rung_keep_to_the_candidates(tmp_path: Path) -> None:
    path, io = _path(tmp_path, [])
    fr = RankRequest(user_id="u3", slot="feed", k=2, candidates=["a7", "a8"], geo="FR")
    (resp,) = _serve(path, io, [fr])
    assert resp.ineligible == [] and {a.ad_id for a in resp.ads} <= {"a7", "a8"} and resp.ads
    path, io = _path(tmp_path, [])
    late = RankRequest(user_id="u4", slot="feed", k=3, candidates=["a9", "a3", "a4", "a6"])
    (resp,) = _serve(path, io, [late], deadline_ms=0.001)  # no time for anything: the last rung
    assert resp.served_by == "popular" and resp.degraded
    # the caller's candidates only, at the prior pCTR: rerank orders them by bid (a4 bids 2, the rest 1)
    assert resp.ads[0].ad_id == "a4" and {a.ad_id for a in resp.ads} <= {"a9", "a3", "a4", "a6"}


@pytest.mark.parametrize(
    ("candidates", "why"),
    [
        ([], "at least 1"),
        (["a1", "a1"], "more than once"),
        ([f"a{i}" for i in range(MAX_CANDIDATES + 1)], "at most"),
    ],
)
def test_bad_candidate_lists_are_refused(candidates: list[str], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        RankRequest(user_id="u", slot="feed", candidates=candidates)
