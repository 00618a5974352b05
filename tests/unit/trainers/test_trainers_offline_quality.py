"""Offline-quality choices behind the ranker's holdout AUC: LR baseline scaling, state weights."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
from helpers_trainers import make_examples

from schemas.events import AdCreative, Click, Impression
from schemas.settings import StateSettings
from schemas.user_record import UserState
from streams.state import AdInfo, apply_event
from trainers.baseline import logistic_probs
from trainers.models.features import RankerBatch, featurize
from trainers.models.ranker import RankerConfig

CFG = RankerConfig(
    state_dim=8, ad_buckets=64, advertiser_buckets=16, campaign_buckets=16, category_buckets=8, deep_hidden=16
)


def test_logistic_baseline_does_not_depend_on_dense_scale() -> None:
    # user-state sums grow with a user's history; LR standardises them, so a unit change of a
    # dense column (here ×1000 on the column that carries the signal) changes nothing
    exs = make_examples(800, dim=8, seed=3)
    train, hold = featurize(exs[:600], CFG), featurize(exs[600:], CFG)
    scale = np.ones(train.dense.shape[1], dtype=np.float32)
    scale[0] = 1000.0
    scaled = [RankerBatch(b.dense * scale, b.ids, b.label) for b in (train, hold)]
    p = logistic_probs(train, hold)
    q = logistic_probs(*scaled)
    assert np.allclose(p, q, atol=1e-4)


def _ad(category: str) -> AdInfo:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    creative = AdCreative(
        event_id=f"cat-{category}", ts=t0, ad_id=f"ad-{category}", campaign_id="c", advertiser_id="v",
        category=category, title=f"{category} deal", bid=1.0, daily_budget=10.0, active=True,
    )  # fmt: skip
    return AdInfo.from_creative(creative, 8)


def test_user_intent_follows_clicks_not_exposure() -> None:
    # The ranker's intent feature: a random logging policy showing a user 300 ads of one
    # category says nothing of their taste, one click on another category does. At the old
    # impression weight (0.05) the exposure won (15 vs 1) and cost 0.010-0.015 holdout AUC.
    params = StateSettings()
    shown, clicked = _ad("travel"), _ad("shoes")
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    state = UserState.empty("u1", 8)
    for i in range(300):
        imp = Impression(
            event_id=f"i{i}", ts=t0 + timedelta(seconds=i), user_id="u1", request_id=f"r{i}",
            ad_id=shown.ad_id, campaign_id="c", advertiser_id="v", slot="feed", position=0, price=0.1,
        )  # fmt: skip
        state = apply_event(state, imp, shown, params)
    ts = t0 + timedelta(seconds=301)
    click = Click(event_id="k", ts=ts, user_id="u1", impression_id="i0", ad_id=clicked.ad_id, campaign_id="c")
    state = apply_event(state, click, clicked, params)
    assert 0 < state.intents["travel"] < state.intents["shoes"]  # exposure registers, clicks rule
