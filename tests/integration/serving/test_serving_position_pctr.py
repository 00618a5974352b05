"""The pCTR an impression logs is the ranker's at the position the ad is served at (issue 32).

Rank scores every candidate at position 0 (the order of a request's candidates does not depend
on where each will be shown), and impressions used to log that score. The per-user correction
(`streams.state`) learns from each impression's click minus its logged pCTR, so the lower
positions' lower click rates turned into a negative correction of the users' categories, which
the adapters then learned to undo (the live loop's control arm: served minus base logit 0.10 at
feed position 0, 1.37 at position 3). Served on the request path as the replica runs it, with
the real Redis; the ranker given a strong position effect."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_serving import add_ads, put_slot_adapter

from schemas.api import AdRequest
from schemas.events import Impression
from schemas.settings import Settings
from serving.catalog import Catalog
from serving.deadline import Deadline
from serving.io import RedisIO, UserRecordCodec
from serving.pipeline import AdPipeline, RequestContext, content_vectorizer, utcnow
from serving.ranking import RankInput, RankModel
from serving.request import RequestPath
from trainers.models.features import ID_COLUMNS
from trainers.models.ranker import Ranker, RankerConfig

pytestmark = [pytest.mark.redis]
CFG = RankerConfig(state_dim=16, emb_dim=4, deep_hidden=16)
POSITION = ID_COLUMNS.index("position")
TS = datetime(2026, 1, 1, tzinfo=UTC)


def _path(tmp_path: Path, emitted: list[Impression], epsilon: float) -> tuple[RequestPath, RedisIO]:
    s = Settings(
        state_dim=16, recall={"k": 30}, state_dir=tmp_path, redis_prefix=f"pos-test-{uuid.uuid4().hex[:8]}:",
        explore={"epsilon": epsilon}, ab={"control_share": 0.0, "correction_share": 0.0},
    )  # fmt: skip
    torch.manual_seed(0)
    ranker = Ranker(CFG).eval()
    with torch.no_grad():  # clicks fall with the position, as users' do
        table = ranker.wide["position"].weight
        table.copy_(-0.4 * torch.arange(table.shape[0], dtype=table.dtype).unsqueeze(1))
    pipe = AdPipeline(
        s, RankModel(ranker, "v0", s, torch.device("cpu")), Catalog(16, CFG, content_vectorizer(16))
    )
    add_ads(pipe, TS)
    put_slot_adapter(pipe, "feed")
    io = RedisIO(s, UserRecordCodec(s.state))

    async def score(items):  # type: ignore[no-untyped-def]
        return [pipe.rank.score([inp], use)[0] for inp, use in items]

    return RequestPath(pipe, io, score, emitted.extend), io


def _serve(path: RequestPath, io: RedisIO, reqs: list[AdRequest]) -> list[RequestContext]:
    async def run() -> list[RequestContext]:
        t0 = time.perf_counter()
        ctxs = [RequestContext(r, f"r{i}", utcnow(), deadline=Deadline(5000.0, start=t0))
                for i, r in enumerate(reqs)]  # fmt: skip
        await path.serve(ctxs)
        await io.close()
        return ctxs

    return asyncio.run(run())


@pytest.mark.parametrize("epsilon", [0.0, 0.5])
def test_each_impression_logs_the_rankers_pctr_at_its_position(tmp_path: Path, epsilon: float) -> None:
    emitted: list[Impression] = []
    path, io = _path(tmp_path, emitted, epsilon)
    reqs = [AdRequest(user_id="u1", slot="feed", k=6), AdRequest(user_id="u2", slot="search", k=4)]
    ctxs = _serve(path, io, reqs)
    assert [c.rung for c in ctxs] == ["adapter", "adapter"]
    pipe = path.pipe
    rank, row_of = pipe.rank, pipe.catalog.row_of
    checked = 0
    for ctx in ctxs:
        assert ctx.recalled is not None and ctx.recalled.rank_input is not None
        inp = ctx.recalled.rank_input  # as rank scored it: with the slot's adapter rows
        rows = torch.from_numpy(pipe.adapter_rows(ctx.req.slot, ctx.rows, ctx.arm))
        inp = RankInput(inp.dense, inp.ids, rows, inp.offset, pipe.shared_adapter_row(ctx.req.slot, ctx.arm))
        use = ctx.req.slot == "feed"  # the feed's adapter is in the bank; search has none
        for imp in (i for i in emitted if i.request_id == ctx.request_id):
            j = int(np.flatnonzero(ctx.rows == row_of[imp.ad_id])[0])
            ids = inp.ids[j : j + 1].clone()
            ids[0, POSITION] = imp.position
            offset = None if inp.offset is None else inp.offset[j : j + 1]
            one = RankInput(inp.dense[j : j + 1], ids, inp.rows[j : j + 1], offset, inp.row)
            (expected,) = rank.score([one], use)
            assert imp.pctr == pytest.approx(float(expected[0]), rel=1e-5)
            if imp.position > 0:  # not the position-0 score rank ordered them by
                assert imp.pctr < float(ctx.pctr[j]) * 0.9
            checked += 1
    assert checked == 10
