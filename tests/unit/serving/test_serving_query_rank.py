"""The request's query in the ranker (issue 34 item 5, `serving.text.text_match`): a search
request's query match with each candidate is a rank feature of its own, logged on every impression
served (`Impression.query_match`, signed), carried by the label join into the TrainingExample, and
featurized in training as serving built it; without a query the columns say "absent" and the
impressions carry none; a ranker saved before the query columns is served as it was trained."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import numpy as np
import torch

from schemas.api import AdRequest
from schemas.events import AdCreative, View
from schemas.settings import Settings
from schemas.signing import check_event, event_key
from serving.catalog import Catalog
from serving.pipeline import AdPipeline, RequestContext, Served, content_vectorizer
from serving.ranking import RankModel
from serving.text import text_match
from streams.join import LabelJoin
from trainers.models.features import N_EXTRA_DENSE, featurize
from trainers.models.ranker import Ranker, RankerConfig

CFG = RankerConfig(state_dim=16, emb_dim=4, deep_hidden=16)
TS = datetime(2026, 1, 1, 12, tzinfo=UTC)
Q = CFG.state_dim + N_EXTRA_DENSE  # the query match column; its flag follows


def _pipeline(cfg: RankerConfig = CFG) -> AdPipeline:
    torch.manual_seed(0)
    s = Settings(state_dim=16, recall={"k": 20}, explore={"epsilon": 0.0})
    model = RankModel(Ranker(cfg).eval(), "v0", s, torch.device("cpu"))
    pipe = AdPipeline(s, model, Catalog(16, cfg, content_vectorizer(16)))
    for i in range(40):
        cat = ["bags", "shoes", "tech", "food"][i % 4]
        title = "Trail running shoes with grip" if i == 9 else f"{cat} deal number {i}"
        pipe.add_ad(AdCreative(event_id=f"e{i}", ts=TS, ad_id=f"a{i}", campaign_id=f"c{i}",
                               advertiser_id=f"v{i}", category=cat, title=title, bid=1.0, daily_budget=1e6,
                               active=True))  # fmt: skip
    return pipe


def _serve(pipe: AdPipeline, req: AdRequest) -> tuple[torch.Tensor, np.ndarray, Served]:
    """(the rank input's dense rows, the candidates' rows, what was served) of one request."""
    rec = pipe.recall(req, None, capped=[], hour=12)
    assert rec.rank_input is not None
    pctr = pipe.rank.score([rec.rank_input], use_adapters=False)[0]
    ctx = RequestContext(req, "req1", TS, rung="base_model", rows=rec.rows, pctr=pctr, stage_ms={})
    return rec.rank_input.dense, rec.rows, pipe.finish(ctx)


def test_a_search_querys_match_is_ranked_on_and_logged_on_each_impression() -> None:
    pipe = _pipeline()
    dense, rows, served = _serve(pipe, AdRequest(user_id="u", slot="search", k=5, query="running shoes"))
    cat = pipe.catalog
    want = text_match(cat.text, "running shoes", rows)
    assert want is not None and dense.shape[1] == CFG.dense_dim == CFG.state_dim + 5
    assert torch.equal(dense[:, Q], torch.from_numpy(want)) and bool((dense[:, Q + 1] == 1).all())
    # a9 names both words: the best match of all, > 0.5; ads of other categories name neither
    best = int(np.argmax(want))
    assert cat.rows[int(rows[best])].ad_id == "a9" and want[best] > 0.5
    imps = served.impressions
    assert imps and all(i.query_match is not None for i in imps)
    by_ad = {cat.rows[int(r)].ad_id: float(m) for r, m in zip(rows, want, strict=True)}
    assert all(i.query_match == by_ad[i.ad_id] for i in imps)  # exactly the value ranked with
    assert "a9" in {i.ad_id for i in imps}
    key = event_key(pipe.settings)
    assert all(check_event(i, key) is None for i in imps)
    forged = imps[0].model_copy(update={"query_match": 0.0 if imps[0].query_match else 1.0})
    assert check_event(forged, key) is not None  # the signature covers it


def test_without_a_query_the_columns_say_absent_and_impressions_carry_none() -> None:
    pipe = _pipeline()
    dense, _, served = _serve(pipe, AdRequest(user_id="u", slot="feed", k=5))
    assert not bool(dense[:, Q:].any())
    assert all(i.query_match is None for i in served.impressions)
    # a query without words is still a search: the flag says so, it names nothing
    dense, _, served = _serve(pipe, AdRequest(user_id="u", slot="search", k=5, query="?! --"))
    assert bool((dense[:, Q] == 0).all()) and bool((dense[:, Q + 1] == 1).all())
    assert all(i.query_match == 0.0 for i in served.impressions)


def test_training_featurizes_the_served_impression_as_serving_ranked_it() -> None:
    """Impression → label join → TrainingExample → featurize gives the dense row serving built
    for that candidate (the user's columns broadcast; no user here: zeros)."""
    pipe = _pipeline()
    dense, rows, served = _serve(pipe, AdRequest(user_id="u", slot="search", k=5, query="shoes grip"))
    join = LabelJoin(window_s=60.0, label_mode="fn_weighted")  # every impression learned at once
    cat = pipe.catalog
    for imp in served.impressions:
        category = cat.rows[cat.row_of[imp.ad_id]].category
        out = join.on_impression(imp, category, np.zeros(16, np.float32), 0.0)
        if imp.render == "client":  # learned once shown: its render beacon comes
            view = View(event_id=f"v/{imp.event_id}", ts=TS, user_id=imp.user_id,
                        impression_id=imp.event_id, ad_id=imp.ad_id)  # fmt: skip
            out += join.on_view(view)
        (ex,) = out
        assert ex.query_match == imp.query_match
        row = int(np.flatnonzero(rows == cat.row_of[imp.ad_id])[0])
        torch.testing.assert_close(featurize([ex], CFG).dense[0], dense[row], rtol=0, atol=0)


def test_a_ranker_saved_before_the_query_columns_is_served_as_trained() -> None:
    old = dataclasses.replace(CFG, query_features=False)
    pipe = _pipeline(old)
    dense, _, served = _serve(pipe, AdRequest(user_id="u", slot="search", k=5, query="running shoes"))
    assert dense.shape[1] == old.dense_dim == old.state_dim + N_EXTRA_DENSE
    # the impressions log the match all the same: a model trained from them can use it
    assert all(i.query_match is not None for i in served.impressions)
