"""The simulator's trend drift: a segment's interests shift toward shared categories."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.codec import encode
from schemas.errors import ConfigError
from schemas.events import Click, Impression
from workloads import Market, MarketConfig
from workloads.truth import auc, sigmoid

TREND = {"drift_mode": "trend", "trend_up": 2, "trend_down": 2, "trend_delta": 2.0}


def _bytes(cfg: MarketConfig, n: int) -> bytes:
    return b"".join(encode(m) + b"\n" for m in Market(cfg).open_loop(n))


def test_trend_shifts_the_same_categories_for_every_drifted_user() -> None:
    cfg = MarketConfig(seed=4, n_users=300, n_categories=12, drift_share=0.5, **TREND)  # type: ignore[arg-type]
    w = Market(cfg).world
    up, down = w.trend_up, w.trend_down
    assert len(up) == 2 and len(down) == 2 and not set(up) & set(down)
    diff = w.interests_after - w.interests
    expected = np.zeros(cfg.n_categories)
    expected[up], expected[down] = 2.0, -2.0
    assert np.allclose(diff[w.drift_users], expected)
    assert np.array_equal(diff[~w.drift_users], np.zeros_like(diff[~w.drift_users]))
    assert 0.4 < w.drift_users.mean() < 0.6


def test_trend_leaves_users_ads_and_segment_as_the_redraw_world_draws_them() -> None:
    redraw = Market(MarketConfig(seed=5, n_users=200)).world
    trend = Market(MarketConfig(seed=5, n_users=200, **TREND)).world  # type: ignore[arg-type]
    assert np.array_equal(redraw.interests, trend.interests)
    assert np.array_equal(redraw.drift_users, trend.drift_users)
    assert redraw.ads.ad_ids == trend.ads.ad_ids and np.array_equal(redraw.ads.quality, trend.ads.quality)
    assert len(redraw.trend_up) == 0  # redraw mode has no trend


def test_oracle_after_the_trend_follows_it() -> None:
    cfg = MarketConfig(seed=6, n_users=300, n_ads=60, drift_at=0.5, drift_share=1.0, new_ads_at=None, **TREND)  # type: ignore[arg-type]
    market = Market(cfg)
    msgs = list(market.open_loop(30_000))
    w, a = market.world, market.world.ads
    imps = [m for m in msgs if isinstance(m, Impression)]
    assert market.drift_impression == 15_000
    for m in imps[14_990:15_010]:  # the oracle is the closed-form truth before and after
        u, ad = int(m.user_id[1:]), int(m.ad_id[2:])
        interest = (w.interests if imps.index(m) < 15_000 else w.interests_after)[u, int(a.category[ad])]
        logit = (
            interest * cfg.interest_scale
            + a.quality[ad]
            + w.advertiser_effect[int(a.advertiser[ad])]
            + cfg.slot_effect[m.slot]
            + cfg.position_bias[m.position]
            + cfg.bias
        )
        assert market.oracle_pctr(m) == pytest.approx(sigmoid(float(logit)))
    # realised CTR per category moves the trend's way
    clicked = {m.impression_id for m in msgs if isinstance(m, Click)}

    def ctr(cats: np.ndarray, part: list[Impression]) -> float:
        rows = [m.event_id in clicked for m in part if int(a.category[int(m.ad_id[2:])]) in set(cats)]
        return float(np.mean(rows))

    before, after = imps[:15_000], imps[15_000:]
    assert ctr(w.trend_up, after) > 2 * ctr(w.trend_up, before)
    assert ctr(w.trend_down, after) < 0.6 * ctr(w.trend_down, before)
    # a model frozen at the drift loses AUC that the oracle keeps
    s = market.summary()
    assert s.oracle_auc_after_drift > s.frozen_auc_after_drift + 0.02
    labels = [m.event_id in clicked for m in after]
    assert auc([market.oracle_pctr(m) for m in after], labels) == pytest.approx(s.oracle_auc_after_drift)


def test_trend_market_is_deterministic_and_differs_from_redraw() -> None:
    cfg = MarketConfig(seed=7, n_users=200, n_ads=50, **TREND)  # type: ignore[arg-type]
    a = _bytes(cfg, 4000)
    assert a == _bytes(cfg, 4000)
    assert a != _bytes(MarketConfig(seed=7, n_users=200, n_ads=50), 4000)


@pytest.mark.parametrize(
    ("field", "value"),
    [("drift_mode", "shuffle"), ("trend_up", -1), ("trend_down", 13), ("trend_delta", float("nan"))],
)
def test_bad_trend_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field.split("_")[0]):
        MarketConfig(n_categories=12, **{"drift_mode": "trend", field: value})  # type: ignore[arg-type]


HANDOVER = {"drift_mode": "handover", "trend_up": 2, "trend_delta": 2.0}


def test_handover_moves_the_season_to_other_categories_with_the_same_spread() -> None:
    """Before the drift the segment's interest is raised in 2 categories, after it in 2 others by
    as much; the rest of the world is the redraw world's, and users outside the segment keep it."""
    cfg = MarketConfig(seed=4, n_users=300, n_categories=12, drift_share=0.5, **HANDOVER)  # type: ignore[arg-type]
    w = Market(cfg).world
    plain = Market(MarketConfig(seed=4, n_users=300, n_categories=12, drift_share=0.5)).world
    after, before = w.trend_up, w.trend_down
    assert len(after) == 2 and len(before) == 2 and not set(after) & set(before)
    seg = w.drift_users
    want_before, want_after = np.zeros(12), np.zeros(12)
    want_before[before], want_after[after] = 2.0, 2.0
    assert np.allclose((w.interests - plain.interests)[seg], want_before)
    assert np.allclose((w.interests_after - plain.interests)[seg], want_after)
    assert np.array_equal(w.interests[~seg], plain.interests[~seg])
    assert np.array_equal(w.interests_after[~seg], plain.interests[~seg])
    # as many hot categories, as hot, on both sides: sorted interest profiles have the same spread
    assert np.isclose(np.sort(w.interests, axis=1).std(), np.sort(w.interests_after, axis=1).std(), rtol=0.05)


def test_handover_needs_room_for_two_disjoint_seasons() -> None:
    with pytest.raises(ConfigError, match="trend_up"):
        MarketConfig(n_categories=3, **HANDOVER)  # type: ignore[arg-type]
