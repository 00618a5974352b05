"""The market simulator: determinism, contract validity, time order and its ground truth."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest

from schemas.codec import decode_any, encode
from schemas.events import SLOTS, Click, Conversion, Dwell, Impression
from workloads import Market, MarketConfig, UnknownEntityError
from workloads.truth import BOUNCE_MS, auc, sigmoid


def _bytes(cfg: MarketConfig, n: int) -> bytes:
    return b"".join(encode(m) + b"\n" for m in Market(cfg).open_loop(n))


def test_same_seed_gives_identical_bytes_and_other_seed_differs() -> None:
    cfg = MarketConfig(seed=7, n_users=200, n_ads=50)
    a, b = _bytes(cfg, 5000), _bytes(cfg, 5000)
    assert a == b
    assert a != _bytes(MarketConfig(seed=8, n_users=200, n_ads=50), 5000)


def test_every_event_round_trips_through_the_contract_in_time_order() -> None:
    market = Market(MarketConfig(seed=1, n_users=100, n_ads=40, n_new_ads=5))
    msgs = list(market.open_loop(4000))
    kinds = Counter(m.kind for m in msgs)
    assert set(kinds) == {"ad", "impression", "click", "dwell", "conversion"}
    assert kinds["impression"] == 4000
    assert kinds == Counter(market.summary().events)
    for m in msgs:
        assert decode_any(encode(m)) == m
    ts = [m.ts for m in msgs]
    assert all(a <= b for a, b in itertools.pairwise(ts))
    assert all(t.utcoffset() is not None for t in ts)
    assert len({m.event_id for m in msgs}) == len(msgs)


def test_labels_reference_their_impression_and_follow_it() -> None:
    market = Market(MarketConfig(seed=2, n_users=100, n_ads=40))
    msgs = list(market.open_loop(5000))
    imps = {m.event_id: m for m in msgs if isinstance(m, Impression)}
    clicks = [m for m in msgs if isinstance(m, Click)]
    dwells = [m for m in msgs if isinstance(m, Dwell)]
    assert len(clicks) == len(dwells) > 0
    for c in clicks:
        imp = imps[c.impression_id]
        assert (c.user_id, c.ad_id, c.campaign_id) == (imp.user_id, imp.ad_id, imp.campaign_id)
        assert c.ts > imp.ts
    assert any(d.dwell_ms < BOUNCE_MS for d in dwells)  # some quick bounces
    assert any(d.dwell_ms >= BOUNCE_MS for d in dwells)


def test_default_market_is_learnable_with_a_realistic_ctr() -> None:
    market = Market(MarketConfig(seed=3))
    for _ in market.open_loop(60_000):
        pass
    s = market.summary()
    assert 0.01 <= s.ctr <= 0.10
    assert s.oracle_auc > 0.75
    # the oracle is calibrated: mean pCTR matches the realised CTR within sampling error
    se = math.sqrt(s.ctr * (1 - s.ctr) / s.impressions)
    assert abs(s.mean_oracle_pctr - s.ctr) < 4 * se


def test_closed_form_ctr_without_user_or_ad_effects() -> None:
    # no interest, quality or advertiser terms: p = σ(bias + slot_effect[feed] + position_bias[0])
    cfg = MarketConfig(
        seed=4, n_users=1, n_ads=2, n_categories=2, n_advertisers=1, favorite_categories=0,
        interest_noise=0.0, ad_quality_sd=0.0, advertiser_sd=0.0, bias=-2.0,
        slot_share={"feed": 1.0, "search": 0.0, "splash": 0.0}, slot_k={"feed": 1, "search": 1, "splash": 1},
        drift_at=None, new_ads_at=None, n_new_ads=0,
    )  # fmt: skip
    market = Market(cfg)
    n = 40_000
    for _ in market.open_loop(n):
        pass
    p = sigmoid(-2.0 + cfg.slot_effect["feed"] + cfg.position_bias[0])
    s = market.summary()
    assert s.mean_oracle_pctr == pytest.approx(p)
    assert abs(s.ctr - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_one_user_two_ads_ctr_is_the_mean_of_their_true_probabilities() -> None:
    cfg = MarketConfig(
        seed=5, n_users=1, n_ads=2, n_categories=2, n_advertisers=2, favorite_categories=1,
        interest_noise=0.0, favorite_boost=3.0, bias=-3.0,
        slot_share={"feed": 1.0, "search": 0.0, "splash": 0.0}, slot_k={"feed": 1, "search": 1, "splash": 1},
        drift_at=None, new_ads_at=None, n_new_ads=0,
    )  # fmt: skip
    market = Market(cfg)
    w = market.world
    probs = []
    for ad in range(2):
        cat, adv = int(w.ads.category[ad]), int(w.ads.advertiser[ad])
        logit = (
            cfg.interest_scale * w.interests[0, cat] + w.ads.quality[ad] + w.advertiser_effect[adv]
            + cfg.slot_effect["feed"] + cfg.position_bias[0] + cfg.bias
        )  # fmt: skip
        probs.append(sigmoid(float(logit)))
        assert market.true_pctr("u000000", w.ads.ad_ids[ad], "feed", 0) == pytest.approx(probs[-1])
    n = 40_000
    shown = Counter()
    clicked = Counter()
    msgs = list(market.open_loop(n))
    by_id = {m.event_id: m for m in msgs if isinstance(m, Impression)}
    for m in msgs:
        if isinstance(m, Impression):
            shown[m.ad_id] += 1
            assert market.oracle_pctr(m) == pytest.approx(probs[int(m.ad_id[2:])])
        elif isinstance(m, Click):
            clicked[by_id[m.impression_id].ad_id] += 1
    expected = sum(probs) / 2  # the random policy shows each ad half the time
    var = sum(p * (1 - p) for p in probs) / 2 / n + (probs[0] - probs[1]) ** 2 / 4 / n
    assert abs(market.summary().ctr - expected) < 4 * math.sqrt(var)
    for ad in range(2):
        k, p = shown[w.ads.ad_ids[ad]], probs[ad]
        assert abs(clicked[w.ads.ad_ids[ad]] / k - p) < 4 * math.sqrt(p * (1 - p) / k)


def test_channel_credit_matches_the_analytic_lift_share() -> None:
    lift = {"feed": 0.01, "search": 0.03, "splash": 0.06}
    share = {"feed": 0.5, "search": 0.3, "splash": 0.2}
    k = {"feed": 2, "search": 1, "splash": 1}
    cfg = MarketConfig(seed=6, n_users=300, n_ads=30, channel_lift=lift, slot_share=share, slot_k=k,
                       base_conversion=0.0, drift_at=None, new_ads_at=None)  # fmt: skip
    market = Market(cfg)
    msgs = list(market.open_loop(60_000))
    s = market.summary()
    weight = {c: lift[c] * share[c] * k[c] for c in SLOTS}
    analytic = {c: weight[c] / sum(weight.values()) for c in SLOTS}
    for c in SLOTS:
        assert s.true_channel_credit[c] == pytest.approx(analytic[c], abs=0.02)
        exp = s.expected_caused_conversions[c]
        assert abs(s.realised_caused_conversions[c] - exp) < 4 * math.sqrt(exp) + 1
    assert s.organic_conversions == 0
    assert sum(isinstance(m, Conversion) for m in msgs) == sum(s.realised_caused_conversions.values())
    assert sum(s.true_channel_credit.values()) == pytest.approx(1.0)


def test_drift_changes_a_share_of_users_and_hurts_a_frozen_model() -> None:
    cfg = MarketConfig(seed=8, n_users=400, n_ads=60, drift_at=0.5, drift_share=0.5, new_ads_at=None)
    market = Market(cfg)
    msgs = list(market.open_loop(40_000))
    s = market.summary()
    assert s.drift_impression == 20_000
    drifted = market.world.drift_users
    assert 0.4 < drifted.mean() < 0.6
    assert not np.allclose(market.world.interests[drifted], market.world.interests_after[drifted])
    assert np.array_equal(market.world.interests[~drifted], market.world.interests_after[~drifted])
    imps = [m for m in msgs if isinstance(m, Impression)]
    clicks = {m.impression_id for m in msgs if isinstance(m, Click)}
    after = [m for m in imps[20_000:] if drifted[int(m.user_id[1:])]]
    labels = [m.event_id in clicks for m in after]
    oracle = [market.oracle_pctr(m) for m in after]
    w = market.world
    frozen = [float(w.interests[int(m.user_id[1:]), int(w.ads.category[int(m.ad_id[2:])])]) for m in after]
    assert auc(oracle, labels) > auc(frozen, labels) + 0.15
    # the summary reports the same drop over all post-drift impressions
    assert s.oracle_auc_after_drift > s.frozen_auc_after_drift + 0.05
    assert len(market.frozen_pctr_after_drift()) == 20_000


def test_new_ads_arrive_mid_stream_and_get_shown() -> None:
    cfg = MarketConfig(seed=9, n_users=100, n_ads=30, n_new_ads=10, new_ads_at=0.5, drift_at=None)
    market = Market(cfg)
    msgs = list(market.open_loop(6000))
    ads = [i for i, m in enumerate(msgs) if m.kind == "ad"]
    assert len(ads) == 40
    first_imp = next(i for i, m in enumerate(msgs) if m.kind == "impression")
    late = [i for i in ads if i > first_imp]
    assert len(late) == 10
    new_ids = {msgs[i].ad_id for i in late}  # type: ignore[attr-defined]
    shown = [i for i, m in enumerate(msgs) if isinstance(m, Impression) and m.ad_id in new_ids]
    assert shown and min(shown) > min(late)
    assert len(market.catalog()) == 30 and len(market.catalog(include_new=True)) == 40


def test_oracle_rejects_unknown_ids_and_respond_rejects_foreign_ads() -> None:
    market = Market(MarketConfig(seed=1, n_users=10, n_ads=5))
    with pytest.raises(UnknownEntityError):
        market.oracle_pctr("nope")
    with pytest.raises(UnknownEntityError):
        market.true_pctr("u000000", "ad99999", "feed", 0)


def test_a_market_runs_once_and_gives_ads_their_shared_vectors() -> None:
    from schemas.errors import AdstreamError
    from schemas.vectors import content_vector

    market = Market(MarketConfig(seed=1, n_users=10, n_ads=5))
    list(market.open_loop(10))
    with pytest.raises(AdstreamError, match="runs once"):
        list(market.open_loop(10))
    ad = market.catalog()[0]
    assert market.ad_vector(ad.ad_id, 16) == content_vector(ad.category, ad.title, 16)


def test_requests_come_in_sessions_at_the_configured_rate() -> None:
    cfg = MarketConfig(seed=2, n_users=1000, rate=50.0, session_requests=5.0, session_gap_s=4.0)
    market = Market(cfg)
    reqs = [market.next_request() for _ in range(30_000)]
    t = np.array([(r.ts - reqs[0].ts).total_seconds() for r in reqs])
    assert np.all(np.diff(t) >= 0)
    steady = t > 60
    assert steady.sum() / (t[-1] - 60) == pytest.approx(50.0, rel=0.05)
    last: dict[int, float] = {}
    gaps = []
    for r, ts in zip(reqs, t, strict=True):
        if r.user in last:
            gaps.append(ts - last[r.user])
        last[r.user] = ts
    assert np.mean(np.asarray(gaps) < 30) > 0.6  # most revisits continue a session
    assert np.mean(np.asarray(gaps) > 60) > 0.02  # and users come back in later sessions


def test_population_pctr_is_the_oracle_without_the_users_taste() -> None:
    m = Market(MarketConfig(seed=3, n_users=50, n_ads=20, interest_scale=0.0, drift_at=None))
    # with no interest term every user is the average user: the two must agree exactly
    for ad in ("ad0", "ad7"):
        assert m.population_pctr(ad, "feed", 1) == pytest.approx(m.true_pctr("u3", ad, "feed", 1))
    m2 = Market(MarketConfig(seed=3, n_users=50, n_ads=20, drift_at=None))
    users = [f"u{i}" for i in range(50)]
    # taste matters: users differ, and the population score sits inside their range
    spread = [m2.true_pctr(u, "ad7", "search", 0) for u in users]
    assert min(spread) < m2.population_pctr("ad7", "search", 0) < max(spread)


def test_a_market_with_the_stack_key_signs_its_history_and_is_otherwise_the_same() -> None:
    from schemas.signing import check_event

    key = b"m" * 32
    cfg = MarketConfig(seed=4, n_users=60, n_ads=15, drift_at=None, new_ads_at=None)
    plain = list(Market(cfg).open_loop(400))
    signed = list(Market(cfg, signing_key=key).open_loop(400))
    assert len(plain) == len(signed)
    vouched = [e for e in signed if isinstance(e, Impression | Click | Dwell)]
    assert vouched and all(check_event(e, key) is None for e in vouched)  # the worker takes each
    # the signature and tokens are all that differ: the same stream, the same truth
    strip = {"sig": None, "click_token": None}
    assert [
        e.model_copy(update={k: v for k, v in strip.items() if k in type(e).model_fields}) for e in signed
    ] == plain
    assert all(getattr(e, "sig", None) is None and getattr(e, "click_token", None) is None for e in plain)
