"""Rerank's variant hook: each served ad with variants names the one to render, and its
impression records that variant with the probability it was chosen with (signed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from test_serving_recall import CFG, TS, ad

from schemas.api import AdRequest
from schemas.codec import decode, encode
from schemas.events import CreativeVariant, Impression
from schemas.settings import Settings
from schemas.signing import check_event
from serving.catalog import Catalog
from serving.pipeline import AdPipeline, RequestContext, content_vectorizer
from serving.ranking import RankModel
from trainers.models.ranker import Ranker

KEY = "s" * 40


def variant(i: int) -> CreativeVariant:
    return CreativeVariant(
        variant_id=f"zh-h{i}b0c0", locale="zh", headline=f"轻盈透气运动鞋 {i}", body="今日下单立减80！",
        cta="立即抢购", disclosure="广告", emphasis="benefit",
    )  # fmt: skip


def test_served_ads_with_variants_carry_the_chosen_variant_and_its_propensity(tmp_path: Path) -> None:
    torch.manual_seed(0)
    s = Settings(state_dim=16, recall={"k": 30}, state_dir=tmp_path, event_signing_key=KEY)
    pipe = AdPipeline(
        s,
        RankModel(Ranker(CFG).eval(), "v0", s, torch.device("cpu")),
        Catalog(16, CFG, content_vectorizer(16)),
    )
    for i in range(40):
        base = ad(i, cat=["shoes", "tech", "food"][i % 3])
        pipe.add_ad(
            base.model_copy(update={"variants": (variant(0), variant(1), variant(2))}) if i % 2 else base
        )
    req = AdRequest(user_id="u9", slot="feed", k=4)
    rec = pipe.recall(req, None, capped=[], hour=12)
    assert rec.rank_input is not None
    pctr = pipe.rank.score([rec.rank_input], use_adapters=False)[0]
    stage = {"recall": 1.0, "rank": 2.0, "rerank": 0.0}
    ctx = RequestContext(req, "req9", TS, rung="base_model", rows=rec.rows, pctr=pctr, stage_ms=stage)
    ctx.user_vector = np.full(16, 0.25)
    served = pipe.finish(ctx)
    resp, imps = pipe.respond(ctx, served), served.impressions
    assert len(imps) == 4
    with_variants = 0
    for imp, served in zip(imps, resp.ads, strict=True):
        has = int(imp.ad_id[1:]) % 2 == 1
        assert (imp.variant_id is not None) == has and served.variant_id == imp.variant_id
        if has:
            with_variants += 1
            assert imp.variant_id in {"zh-h0b0c0", "zh-h1b0c0", "zh-h2b0c0"}
            assert imp.variant_propensity is not None and 0.05 / 3 <= imp.variant_propensity <= 1
        else:
            assert imp.variant_propensity is None
        assert check_event(decode(Impression, encode(imp)), KEY.encode()) is None
    assert with_variants == sum(int(a.ad_id[1:]) % 2 for a in resp.ads)
