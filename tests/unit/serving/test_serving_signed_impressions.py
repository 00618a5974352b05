"""Replicas sign every impression they serve and give each served ad its click token (M10)."""

from __future__ import annotations

from pathlib import Path

import torch
from test_serving_recall import CFG, TS, ad

from schemas.api import AdRequest, AdResponse
from schemas.codec import decode, encode
from schemas.events import Click, Impression
from schemas.settings import Settings
from schemas.signing import check_event, click_token, event_key
from serving.catalog import Catalog
from serving.pipeline import AdPipeline, RequestContext, content_vectorizer
from serving.ranking import RankModel
from trainers.models.ranker import Ranker

KEY = "s" * 40


def test_served_impressions_are_signed_and_ads_carry_their_click_tokens(tmp_path: Path) -> None:
    torch.manual_seed(0)
    s = Settings(state_dim=16, recall={"k": 30}, state_dir=tmp_path, event_signing_key=KEY)
    pipe = AdPipeline(
        s,
        RankModel(Ranker(CFG).eval(), "v0", s, torch.device("cpu")),
        Catalog(16, CFG, content_vectorizer(16)),
    )
    for i in range(40):
        pipe.add_ad(ad(i, cat=["shoes", "tech", "food"][i % 3]))
    req = AdRequest(user_id="u9", slot="feed", k=4)
    rec = pipe.recall(req, None, capped=[], hour=12)
    assert rec.rank_input is not None
    pctr = pipe.rank.score([rec.rank_input], use_adapters=False)[0]
    stage = {"recall": 1.0, "rank": 2.0, "rerank": 0.0}
    ctx = RequestContext(req, "req9", TS, rung="base_model", rows=rec.rows, pctr=pctr, stage_ms=stage)
    served = pipe.finish(ctx)
    resp, imps = pipe.respond(ctx, served), served.impressions
    key = KEY.encode()
    assert len(imps) == 4
    for imp, served in zip(imps, AdResponse.model_validate_json(resp.model_dump_json()).ads, strict=True):
        # the worker's check, after the impression's trip through Kafka
        assert imp.sig is not None and check_event(decode(Impression, encode(imp)), key) is None
        assert served.click_token == click_token(key, imp.event_id, "u9", imp.ad_id)
        click = Click(
            event_id=f"k-{imp.event_id}", ts=TS, user_id="u9", impression_id=imp.event_id,
            ad_id=served.ad_id, campaign_id=served.campaign_id, click_token=served.click_token,
        )  # fmt: skip
        assert check_event(click, key) is None  # a client echoing the token passes


def test_a_replica_without_a_configured_key_uses_the_stack_key_file(tmp_path: Path) -> None:
    s = Settings(state_dim=16, state_dir=tmp_path)
    pipe = AdPipeline(
        s,
        RankModel(Ranker(CFG).eval(), "v0", s, torch.device("cpu")),
        Catalog(16, CFG, content_vectorizer(16)),
    )
    assert pipe.event_key == event_key(s) and (tmp_path / "event-signing.key").exists()
