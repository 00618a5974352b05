"""Query text in recall (issue 34 item 5, `serving.text`): a request's `query` adds each ad's
match with it to the recall score, so an ad whose words it names is recalled, and first, where
the query vector alone leaves it out; in the batched, the per-request and the `/v1/rank` paths
alike, and with an approximate index."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import torch

from schemas.api import AdRequest, RankRequest
from schemas.events import AdCreative
from schemas.settings import Settings
from serving.catalog import Catalog
from serving.pipeline import AdPipeline, content_vectorizer
from serving.ranking import RankModel
from serving.text import join_matches, query_match
from trainers.models.ranker import Ranker, RankerConfig

CFG = RankerConfig(state_dim=16, emb_dim=4, deep_hidden=16)
TS = datetime(2026, 1, 1, tzinfo=UTC)
TITLES = {17: "Vintage leather satchel", 41: "Trail running shoes with grip"}


def _pipeline(**recall: object) -> AdPipeline:
    torch.manual_seed(0)
    s = Settings(state_dim=16, recall={"k": 5, **recall})
    pipe = AdPipeline(
        s,
        RankModel(Ranker(CFG).eval(), "v0", s, torch.device("cpu")),
        Catalog(16, CFG, content_vectorizer(16)),
    )
    for i in range(80):
        cat = ["bags", "shoes", "tech", "food"][i % 4]
        title = TITLES.get(i, f"{cat} deal number {i}")
        pipe.add_ad(AdCreative(event_id=f"e{i}", ts=TS, ad_id=f"a{i}", campaign_id=f"c{i}",
                               advertiser_id=f"v{i}", category=cat, title=title, bid=1.0, daily_budget=1e6,
                               active=True))  # fmt: skip
    return pipe


def _ids(pipe: AdPipeline, rows: np.ndarray) -> list[str]:
    return [pipe.catalog.rows[int(r)].ad_id for r in rows]


def test_a_query_naming_an_ads_words_recalls_it_first() -> None:
    pipe = _pipeline()
    plain = pipe.recall(AdRequest(user_id="u", slot="search"), None, [], 12)
    assert "a17" not in _ids(pipe, plain.rows)  # the query vector alone leaves it out
    found = pipe.recall(AdRequest(user_id="u", slot="search", query="leather satchel"), None, [], 12)
    assert _ids(pipe, found.rows)[0] == "a17"
    # any case, any order, one of its words, punctuation
    for q in ("SATCHEL", "satchel leather", "Leather, satchel!"):
        rows = pipe.recall(AdRequest(user_id="u", slot="search", query=q), None, [], 12).rows
        assert _ids(pipe, rows)[0] == "a17", q
    # a query without words changes nothing; a paused ad is not recalled by its words
    same = pipe.recall(AdRequest(user_id="u", slot="search", query="?! -- ..."), None, [], 12)
    assert set(_ids(pipe, same.rows)) == set(_ids(pipe, plain.rows))
    pipe.add_ad(AdCreative(event_id="p", ts=TS, ad_id="a17", campaign_id="c17", advertiser_id="v17",
                           category="bags", title=TITLES[17], bid=1.0, daily_budget=1e6,
                           active=False))  # fmt: skip
    gone = pipe.recall(AdRequest(user_id="u", slot="search", query="leather satchel"), None, [], 12)
    assert "a17" not in _ids(pipe, gone.rows)


def test_the_batch_and_rank_paths_match_the_query_too() -> None:
    pipe = _pipeline()
    reqs = [
        AdRequest(user_id="u1", slot="search", query="trail running shoes"),
        AdRequest(user_id="u2", slot="feed"),
        AdRequest(user_id="u3", slot="search", query="leather satchel"),
    ]
    many = pipe.recall_many(reqs, [None] * 3, [[], [], []], 12)
    for req, got in zip(reqs, many, strict=True):
        one = pipe.recall(req, None, [], 12)
        assert _ids(pipe, got.rows) == _ids(pipe, one.rows)
        assert np.allclose(got.scores, one.scores, atol=1e-5)
    assert _ids(pipe, many[0].rows)[0] == "a41" and _ids(pipe, many[2].rows)[0] == "a17"
    # /v1/rank: the caller's candidates get the same recall scores as recall gives them
    rows = np.array([pipe.catalog.row_of[a] for a in ("a3", "a17", "a41")])
    cands = ["a3", "a17", "a41"]
    asked = pipe.recall_candidates(RankRequest(user_id="u", slot="search", query="satchel", candidates=cands),
                                   None, rows, 12)  # fmt: skip
    plain = pipe.recall_candidates(RankRequest(user_id="u", slot="search", candidates=cands), None, rows, 12)
    gain = asked.scores - plain.scores
    assert gain[1] > 0.3 and abs(gain[0]) < 1e-6 and abs(gain[2]) < 1e-6


def test_queries_can_be_turned_off_and_approximate_indexes_join_the_matches() -> None:
    off = _pipeline(text_dim=0)
    assert off.match(AdRequest(user_id="u", slot="search", query="leather satchel")) is None
    assert Catalog(16, CFG, content_vectorizer(16), text_dim=0).text.shape[1] == 0
    pipe = _pipeline()
    cat = pipe.catalog
    match = query_match(cat.text, cat.n, "leather satchel", 1.0)
    assert match is not None and int(np.argmax(match)) == cat.row_of["a17"]
    query = np.zeros(16, dtype=np.float32)
    found = (np.arange(5, dtype=np.int64), np.zeros(5, dtype=np.float32))  # an index that missed it
    rows, scores = join_matches(found, match, cat.vectors, query, 5, cat.servable())
    assert int(rows[0]) == cat.row_of["a17"] and len(rows) == 5 and scores[0] == scores.max()
