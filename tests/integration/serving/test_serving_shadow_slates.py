"""`ab.shadow_slates`: a learning-arm request ranked with adapters is ranked without them too, and
its shadow slate is what the same request would have been served without the adapters (the
correction-only arm's policy, exploration's draw included) — checked against a replica that has
no adapters at all, serving the same requests on the request path as the replica runs it."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from helpers_serving import add_ads, put_slot_adapter

from schemas.api import AdRequest
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
AB = {"control_share": 0.3, "correction_share": 0.3}


def _path(tmp_path: Path, shadow: bool, adapter: bool) -> tuple[RequestPath, RedisIO]:
    s = Settings(
        state_dim=16, recall={"k": 30}, state_dir=tmp_path, explore={"epsilon": 0.3},
        redis_prefix=f"shadow-test-{uuid.uuid4().hex[:8]}:", ab=AB | {"shadow_slates": shadow},
    )  # fmt: skip
    torch.manual_seed(0)
    model = RankModel(Ranker(CFG).eval(), "v0", s, torch.device("cpu"))
    pipe = AdPipeline(s, model, Catalog(16, CFG, content_vectorizer(16)))
    add_ads(pipe, TS)
    if adapter:
        put_slot_adapter(pipe, "feed")
    io = RedisIO(s, UserRecordCodec(s.state))

    async def score(items):  # type: ignore[no-untyped-def]
        return [pipe.rank.score([inp], use)[0] for inp, use in items]

    return RequestPath(pipe, io, score, lambda imps: None), io


def _serve(path: RequestPath, io: RedisIO, reqs: list[AdRequest]) -> list[tuple[RequestContext, list[str]]]:
    """The requests as one batch (every slate chosen on the same catalog counts), ids r0, r1, …:
    each request's context and the ads it was served."""

    async def run() -> list[tuple[RequestContext, list[str]]]:
        t0 = time.perf_counter()
        ctxs = [RequestContext(r, f"r{i}", utcnow(), deadline=Deadline(5000.0, start=t0))
                for i, r in enumerate(reqs)]  # fmt: skip
        from serving.arms import ab_arm_for

        for c in ctxs:
            c.ab_arm = ab_arm_for(c.req.user_id, path.pipe.settings.ab)
        resps = await path.serve(ctxs)
        await io.close()
        return [(c, [a.ad_id for a in r.ads]) for c, r in zip(ctxs, resps, strict=True)]

    return asyncio.run(run())


def test_the_shadow_slate_is_what_a_replica_without_adapters_serves(tmp_path: Path) -> None:
    reqs = [AdRequest(user_id=f"u{i}", slot="feed" if i % 4 else "search", k=5) for i in range(40)]
    path, io = _path(tmp_path, shadow=True, adapter=True)
    with_shadow = _serve(path, io, reqs)
    bare_path, bare_io = _path(tmp_path, shadow=False, adapter=False)
    bare = _serve(bare_path, bare_io, reqs)
    arms = {c.ab_arm for c, _ in with_shadow}
    assert arms == {"control", "correction", "learning"}
    differ = 0
    for (ctx, served), (ref, ref_served) in zip(with_shadow, bare, strict=True):
        assert ctx.rung == ref.rung == "adapter"
        if ctx.ab_arm != "learning":  # served without adapters already: no shadow
            assert ctx.shadow_ads is None
            assert served == ref_served
            continue
        assert ctx.shadow_ads == ref_served, ctx.request_id
        differ += ctx.shadow_ads != served
        if ctx.req.slot == "search":  # no adapter for search: both slates are the same
            assert ctx.shadow_ads == served
    assert differ > 0, "the feed adapter moves the scores: some learning-arm slates must change"
    assert all(c.shadow_ads is None for c, _ in bare)


def test_without_the_setting_no_request_is_ranked_twice(tmp_path: Path) -> None:
    path, io = _path(tmp_path, shadow=False, adapter=True)
    calls: list[int] = []
    score = path.score

    async def counted(items):  # type: ignore[no-untyped-def]
        calls.append(len(items))
        return await score(items)

    path.score = counted
    reqs = [AdRequest(user_id=f"u{i}", slot="feed", k=3) for i in range(12)]
    ctxs = _serve(path, io, reqs)
    assert all(c.shadow_ads is None and c.shadow_pctr is None for c, _ in ctxs)
    assert calls[0] == 12  # rank: one input per request (the positions' pass follows)
