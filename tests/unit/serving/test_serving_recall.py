"""Catalog, exact index, recall filters, rank features (same as trainers.featurize) and the pipeline."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import torch

from schemas.api import AdRequest
from schemas.events import AdCreative
from schemas.ids import adapter_id_for
from schemas.settings import Settings
from serving.adapters import CANDIDATE, STABLE
from serving.catalog import Catalog
from serving.index import ExactIndex
from serving.pipeline import AdPipeline, RequestContext, UserView, content_vectorizer
from serving.ranking import RankModel, build_input
from trainers.models.features import featurize
from trainers.models.ranker import Ranker, RankerConfig

TS = datetime(2026, 1, 1, 12, tzinfo=UTC)
CFG = RankerConfig(state_dim=16, emb_dim=4, deep_hidden=16)


def ad(
    i: int, cat: str = "shoes", active: bool = True, budget: float = 100.0, adv: str | None = None
) -> AdCreative:
    return AdCreative(
        event_id=f"e{i}",
        ts=TS,
        ad_id=f"a{i}",
        campaign_id=f"c{i % 4}",
        advertiser_id=adv or f"v{i % 6}",
        category=cat,
        title=f"{cat} item {i}",
        bid=1.0 + i % 3,
        daily_budget=budget,
        active=active,
    )


def test_exact_index_returns_best_allowed_rows() -> None:
    rng = np.random.default_rng(0)
    vecs = rng.normal(size=(100, 8)).astype(np.float32)
    q = rng.normal(size=8).astype(np.float32)
    allowed = np.ones(100, dtype=bool)
    allowed[::2] = False
    rows, scores = ExactIndex(vecs, 100).search(q, 5, allowed)
    brute = np.argsort(-(vecs @ q) + np.where(allowed, 0, 1e9))[:5]
    assert rows.tolist() == brute.tolist() and np.all(np.diff(scores) <= 0)
    assert ExactIndex(vecs, 100).search(q, 5, np.zeros(100, dtype=bool))[0].shape == (0,)


def test_rank_features_match_trainers_featurize() -> None:
    cat = Catalog(16, CFG, content_vectorizer(16))
    for i in range(5):
        cat.upsert(ad(i, cat=["shoes", "tech"][i % 2]))
    rows = np.arange(5)
    user_vec = np.linspace(-1, 1, 16).astype(np.float32)
    intents = np.array([0.7, 1.3], dtype=np.float32)  # codes: shoes=0, tech=1
    inp = build_input(
        user_vec,
        intents,
        cat.ids[rows],
        cat.category[rows],
        "search",
        7,
        16,
        query_features=CFG.query_features,  # no query: the columns say absent
    )

    class Ex:
        def __init__(self, r: int) -> None:
            info = cat.rows[r]
            # as the streams join makes them: no recall score (impressions do not record it)
            self.user_vector, self.intent_score, self.recall_score = (
                user_vec.tolist(),
                float(intents[r % 2]),
                None,
            )
            self.ad_id, self.advertiser_id, self.campaign_id = (
                info.ad_id,
                info.advertiser_id,
                info.campaign_id,
            )
            self.category, self.slot, self.position, self.hour = info.category, "search", 0, 7

    ref = featurize([Ex(r) for r in rows], CFG)
    assert torch.equal(inp.ids, ref.ids)
    assert torch.allclose(inp.dense, ref.dense)


def _pipeline(n: int = 60) -> AdPipeline:
    torch.manual_seed(0)
    s = Settings(
        state_dim=16, recall={"k": 30}, serving={"adapter_capacity": 8}, rerank={"max_per_advertiser": 2}
    )
    pipe = AdPipeline(
        s,
        RankModel(Ranker(CFG).eval(), "v0", s, torch.device("cpu")),
        Catalog(16, CFG, content_vectorizer(16)),
    )
    for i in range(n):
        pipe.add_ad(ad(i, cat=["shoes", "tech", "food"][i % 3]))
    return pipe


def test_recall_filters_inactive_spent_and_capped_ads_and_new_ads_enter_live() -> None:
    pipe = _pipeline()
    pipe.add_ad(ad(3, cat="shoes", active=False))
    pipe.catalog.set_spend({"c1": 1e9})  # campaign c1 spent out
    req = AdRequest(user_id="u", slot="feed", k=5)
    user = UserView(np.asarray(content_vectorizer(16)(ad(0, cat="tech")), dtype=np.float32), {"tech": 2.0})
    rec = pipe.recall(req, user, capped=["a1", "a4"], hour=12)
    got = {pipe.catalog.rows[r].ad_id for r in rec.rows}
    assert got and not got & {"a3", "a1", "a4"}
    assert all(pipe.catalog.rows[r].campaign_id != "c1" for r in rec.rows)
    bank = pipe.rank.bank
    assert np.all(
        pipe.adapter_rows("feed", rec.rows, CANDIDATE) == bank.row(None, CANDIDATE)
    )  # none known yet
    aid = adapter_id_for(
        "feed", pipe.catalog.rows[int(rec.rows[0])].advertiser_id, pipe.settings.adapter_scheme
    )
    zero = {
        n: (torch.zeros(bank.rank, s.fan_in), torch.zeros(s.fan_out, bank.rank))
        for n, s in bank.shapes.items()
    }
    bank.put(aid, zero, version="seq-3", seq=3, base_version="v0")
    rows = pipe.adapter_rows("feed", rec.rows, CANDIDATE)
    assert rows[0] == bank.row(aid, CANDIDATE) and pipe.adapter_versions("feed", rec.rows[:1]) == ["seq-3"]
    # the slot scheme: every candidate of the slot has its adapter's row, said once for the request
    assert pipe.shared_adapter_row("feed", CANDIDATE) == bank.row(aid, CANDIDATE)
    assert pipe.shared_adapter_row("search", CANDIDATE) == bank.row(None, CANDIDATE)
    # the stable arm serves (and its impressions name) only what was promoted
    assert pipe.adapter_versions("feed", rec.rows[:1], STABLE) == [None]
    bank.promote()
    bank.put(aid, zero, version="seq-4", seq=4, base_version="v0")
    assert pipe.adapter_versions("feed", rec.rows[:1], STABLE) == ["seq-3"]
    assert pipe.adapter_versions("feed", rec.rows[:1], CANDIDATE) == ["seq-4"]
    pipe.add_ad(ad(999, cat="gadgets"))  # a new ad, of a category nobody had: recallable at once
    fan = UserView(np.asarray(content_vectorizer(16)(ad(999, cat="gadgets")), dtype=np.float32), {})
    rec2 = pipe.recall(req, fan, capped=[], hour=12)
    assert pipe.catalog.row_of["a999"] in rec2.rows.tolist()
    # tech user → recall prefers tech ads
    cats = [pipe.catalog.rows[r].category for r in rec.rows[:5]]
    assert cats.count("tech") >= 4


def test_cold_user_uses_context_and_finish_builds_response_and_impressions() -> None:
    pipe = _pipeline()
    req = AdRequest(user_id="cold", slot="splash", k=4, context={"category": "food"})
    rec = pipe.recall(req, None, capped=[], hour=12)
    assert [pipe.catalog.rows[r].category for r in rec.rows[:3]].count("food") >= 2
    assert rec.rank_input is not None
    pctr = pipe.rank.score([rec.rank_input], use_adapters=False)[0]
    stage = {"recall": 1.0, "rank": 2.0, "rerank": 0.0}
    ctx = RequestContext(req, "req1", TS, rung="base_model", rows=rec.rows, pctr=pctr, stage_ms=stage)
    served = pipe.finish(ctx)
    resp, imps, chosen, cost = pipe.respond(ctx, served), served.impressions, served.rows, served.spend
    assert len(resp.ads) == 4 and resp.degraded and resp.served_by == "base_model"
    assert [i.event_id for i in imps] == [f"req1/{p}" for p in range(4)]
    assert all(i.model_version == pipe.rank.version and i.request_id == "req1" for i in imps)
    assert len({a.ad_id for a in resp.ads}) == 4 and np.all(cost >= 0)
    advs = [pipe.catalog.rows[r].advertiser_id for r in chosen]
    assert max(advs.count(a) for a in advs) <= 2
    pipe.catalog.record_served(chosen, cost)
    assert pipe.catalog.impressions[chosen].sum() == 4
    assert len(pipe.popular(5)) == 5


def test_per_advertiser_adapters_have_no_shared_row() -> None:
    """Under the advertiser scheme the rows depend on the ad: no shared row until every
    advertiser has the same (none has an adapter of its own)."""
    pipe = _pipeline()
    pipe.settings = pipe.settings.model_copy(update={"adapter_scheme": "advertiser"})
    bank = pipe.rank.bank
    assert pipe.shared_adapter_row("feed", CANDIDATE) == bank.row(None, CANDIDATE)
    one = pipe.catalog.rows[0].advertiser_id
    zero = {
        n: (torch.zeros(bank.rank, s.fan_in), torch.zeros(s.fan_out, bank.rank))
        for n, s in bank.shapes.items()
    }
    bank.put(adapter_id_for("feed", one, "advertiser"), zero, version="seq-1", seq=1, base_version="v0")
    assert pipe.shared_adapter_row("feed", CANDIDATE) is None
    rows = pipe.adapter_rows("feed", np.arange(len(pipe.catalog.rows)), CANDIDATE)
    assert len(set(rows.tolist())) == 2


def test_at_positions_takes_the_picks_in_display_order_at_their_positions_and_keeps_the_rest() -> None:
    """The served ads as the ranker scores them where they are shown: the i-th pick at position
    i (capped as the training features cap it), its dense row, bank row and correction kept;
    the recalled input keeps position 0."""
    from serving.ranking import POSITION, RankInput, at_positions

    n = 20
    ids = torch.arange(n * 7, dtype=torch.int64).reshape(n, 7)
    ids[:, POSITION] = 0
    inp = RankInput(torch.randn(n, 5), ids, torch.arange(n) % 3, torch.linspace(-1, 1, n), row=2)
    picks = np.array([7, 3, 19, 0, 11])
    out = at_positions(inp, picks, max_position=4)
    assert out.ids[:, POSITION].tolist() == [0, 1, 2, 3, 3]
    keep = [c for c in range(7) if c != POSITION]
    assert torch.equal(out.ids[:, keep], ids[picks][:, keep]) and torch.equal(out.dense, inp.dense[picks])
    assert out.offset is not None and torch.equal(out.offset, inp.offset[picks])  # type: ignore[index]
    assert torch.equal(out.rows, inp.rows[picks]) and out.row == 2
    assert int(inp.ids[:, POSITION].abs().sum()) == 0
    no_offset = at_positions(RankInput(inp.dense, ids, inp.rows), picks[:2], max_position=16)
    assert no_offset.offset is None and no_offset.row is None
