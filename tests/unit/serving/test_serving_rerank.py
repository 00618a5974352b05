"""Rerank: eCPM, pacing, long tail, diversity and GSP prices (pure functions)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.settings import RerankSettings
from serving.rerank import diversify, ecpm, gsp_prices, long_tail_factor, pacing_factor, rerank


def test_ecpm_is_pctr_times_bid() -> None:
    assert ecpm(np.array([0.1, 0.5]), np.array([2.0, 4.0])).tolist() == [0.2, 2.0]


def test_pacing_on_plan_is_unthrottled_and_overpacing_is_throttled_and_spent_out_is_zero() -> None:
    budget = np.full(4, 100.0)
    f = pacing_factor(np.array([0.0, 27.0, 60.0, 100.0]), budget, 0.25, 0.1)
    assert f[0] == 1.0 and f[1] == 1.0  # plan 25, slack 10 % → 27.5 allowed
    assert 0.0 < f[2] < 0.5
    assert f[3] == 0.0


def test_long_tail_boost_favours_rarely_shown_ads() -> None:
    f = long_tail_factor(np.array([0.0, 10.0, 10_000.0]), 0.2)
    assert f[0] == 1.2 and f[0] > f[1] > f[2] > 1.0


def test_diversify_caps_advertisers_and_spreads_categories() -> None:
    scores = np.array([10.0, 9.0, 8.0, 7.0, 6.0, 5.0])
    adv = np.array([0, 0, 0, 1, 2, 3])
    cat = np.array([0, 1, 2, 0, 0, 3])
    idx, adj = diversify(scores, adv, cat, k=4, max_per_advertiser=2, category_decay=0.5)
    assert np.bincount(adv[idx]).max() <= 2
    assert 2 not in idx.tolist()  # third ad of advertiser 0
    # category 0 was picked first: a second category-0 ad (7 → 3.5) loses to category 3 (5)
    assert idx.tolist()[:3] == [0, 1, 5]
    assert np.all(np.diff(adj) <= 0)


def test_gsp_pays_next_score_over_own_quality_capped_at_bid_with_reserve() -> None:
    prices = gsp_prices(
        np.array([3.0, 2.0, 0.5]), np.array([0.3, 0.2, 0.1]), np.array([10.0, 10.0, 5.0]), 0.0, 0.05
    )
    assert np.allclose(prices, [2.0 / 0.3, 0.5 / 0.2, 0.05])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 60), st.integers(1, 10), st.integers(0, 2**31))
def test_rerank_contract(n: int, k: int, seed: int) -> None:
    """At most k unique picks, advertiser cap held, prices in [reserve, bid], spent-out never shown."""
    rng = np.random.default_rng(seed)
    pctr = rng.uniform(0, 0.2, n)
    bid = rng.uniform(0.1, 5, n)
    adv = rng.integers(0, 5, n)
    cat = rng.integers(0, 4, n)
    pacing = np.where(rng.uniform(size=n) < 0.2, 0.0, rng.uniform(0.1, 1, n))
    imps = rng.integers(0, 1000, n).astype(float)
    p = RerankSettings(max_per_advertiser=2, reserve_price=0.01)
    before = pctr.copy()
    res = rerank(pctr, bid, adv, cat, pacing, imps, k, p)
    assert np.array_equal(before, pctr)  # inputs not mutated
    assert len(res.order) <= k and len(set(res.order.tolist())) == len(res.order)
    if len(res.order):
        assert np.bincount(adv[res.order]).max() <= 2
        assert np.all(pacing[res.order] > 0)
        assert np.all(res.prices <= bid[res.order] + 1e-9)
        assert np.all(res.prices >= np.minimum(0.01, bid[res.order]) - 1e-9)
        assert np.all(np.diff(res.scores) <= 1e-12)
    servable_advs = {a: min(2, int(((adv == a) & (pacing > 0)).sum())) for a in set(adv.tolist())}
    assert len(res.order) == min(k, sum(servable_advs.values()))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.sampled_from([0.0, 0.5, 1.0, float("-inf")]), st.floats(0, 100)),
            st.integers(0, 6),
            st.integers(0, 4),
        ),
        min_size=1,
        max_size=120,
    ),
    st.integers(1, 15),
    st.integers(1, 3),
    st.sampled_from([1.0, 0.8, 0.5, 0.01]),
)
def test_merged_diversify_picks_what_the_array_loop_picks(
    cands: list[tuple[float, int, int]], k: int, per_adv: int, decay: float
) -> None:
    """The merge of the categories (scores ≥ 0, decay ≤ 1) and the array loop agree pick for
    pick, ties included."""
    from serving.rerank import _diversify_arrays, _diversify_merged

    scores = np.array([c[0] for c in cands], dtype=np.float64)
    adv = np.array([c[1] for c in cands], dtype=np.int64)
    cat = np.array([c[2] for c in cands], dtype=np.int64)
    pool = np.argsort(-scores, kind="stable")[: max(k * per_adv * 4, 64)]
    args = (pool, scores[pool], adv[pool], cat[pool], k, per_adv, decay)
    merged, arrays = _diversify_merged(*args), _diversify_arrays(*args)
    assert merged[0].tolist() == arrays[0].tolist()
    assert merged[1].tolist() == arrays[1].tolist()


# -- bid types: CPM bids per thousand shown, CPC per click ----------------------------------------
FLAT = RerankSettings(
    max_per_advertiser=5, category_decay=1.0, long_tail_boost=0.0, reserve_price=0.01, reserve_cpm=0.5
)


def test_ecpm_of_a_cpm_bid_is_bid_per_thousand_whatever_its_pctr() -> None:
    cpm = np.array([False, True])
    assert ecpm(np.array([0.02, 0.5]), np.array([1.0, 30.0]), cpm).tolist() == [0.02, 0.03]


def test_mixed_auction_ranks_by_value_per_impression_and_prices_each_in_its_unit() -> None:
    """Hand-computed: A CPC pCTR 0.02 bid 1.0/click (0.02 per impression), B CPM bid 30/mille
    (0.03; its pCTR 0.5 plays no part), C CPC pCTR 0.1 bid 0.1 (0.01), D CPM bid 5 (0.005, pCTR
    0.9). Order B, A, C; D is the runner-up. B pays per thousand the CPM that keeps 0.02:
    0.02 × 1000 = 20; A per click 0.01 / 0.02 = 0.5; C per click 0.005 / 0.1 = 0.05."""
    pctr = np.array([0.02, 0.5, 0.1, 0.9])
    bid = np.array([1.0, 30.0, 0.1, 5.0])
    cpm = np.array([False, True, False, True])
    res = rerank(pctr, bid, np.arange(4), np.arange(4), np.ones(4), np.zeros(4), 3, FLAT, cpm)
    assert res.order.tolist() == [1, 0, 2]
    assert np.allclose(res.scores, [0.03, 0.02, 0.01])
    assert np.allclose(res.prices, [20.0, 0.5, 0.05])
    # what each winner is billed per impression (CPM price / 1000 when shown, CPC pCTR × price in
    # expectation) is what keeps its rank: the next value, never above its own
    per_imp = np.where(cpm[res.order], res.prices / 1000, pctr[res.order] * res.prices)
    assert np.allclose(per_imp, [0.02, 0.01, 0.005])
    # ranked as before (every bid per click: pCTR × bid), the CPM ads' pCTRs put both on top
    old = rerank(pctr, bid, np.arange(4), np.arange(4), np.ones(4), np.zeros(4), 3, FLAT)
    assert old.order.tolist() == [1, 3, 0]


def test_a_cpc_ad_outbidding_a_cpm_ad_pays_per_click_what_the_cpm_bid_is_worth() -> None:
    """CPC pCTR 0.05 bid 2 (0.1 per impression) over CPM bid 40 (0.04): the CPC ad pays
    0.04 / 0.05 = 0.8 per click; the CPM ad, last with nothing below, pays its floor 0.5 per
    thousand (reserve_cpm), a CPC ad alone pays reserve_price."""
    res = rerank(np.array([0.05, 0.2]), np.array([2.0, 40.0]), np.arange(2), np.arange(2),
                 np.ones(2), np.zeros(2), 2, FLAT, np.array([False, True]))  # fmt: skip
    assert res.order.tolist() == [0, 1]
    assert np.allclose(res.prices, [0.8, 0.5])
    alone = rerank(np.array([0.05]), np.array([2.0]), np.arange(1), np.arange(1), np.ones(1), np.zeros(1),
                   1, FLAT, np.array([False]))  # fmt: skip
    assert np.allclose(alone.prices, [0.01])


def test_a_cpm_price_is_capped_at_its_bid_and_pacing_scales_its_value() -> None:
    """CPM bid 0.3/mille under a 0.5 floor pays its bid; a CPM ad at pacing 0.5 (bid 60: 0.03
    effective) loses to CPC 0.02 × 2 = 0.04, which pays 0.03 / 0.02 = 1.5 per click, and the
    paced CPM ad pays, against the runner-up 0.01, 0.01 / (0.5 / 1000) = 20 per thousand."""
    capped = rerank(np.array([0.1]), np.array([0.3]), np.arange(1), np.arange(1), np.ones(1), np.zeros(1),
                    1, FLAT, np.array([True]))  # fmt: skip
    assert np.allclose(capped.prices, [0.3])
    pctr, bid = np.array([0.1, 0.02, 0.1]), np.array([60.0, 2.0, 0.1])
    cpm, pacing = np.array([True, False, False]), np.array([0.5, 1.0, 1.0])
    res = rerank(pctr, bid, np.arange(3), np.arange(3), pacing, np.zeros(3), 2, FLAT, cpm)
    assert res.order.tolist() == [1, 0]
    assert np.allclose(res.prices, [1.5, 20.0])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 8), st.integers(0, 2**31))
def test_all_cpc_bid_types_are_the_per_click_auction_bit_for_bit(n: int, k: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    args = (rng.uniform(0, 0.2, n), rng.uniform(0.1, 5, n), rng.integers(0, 5, n), rng.integers(0, 4, n),
            np.where(rng.uniform(size=n) < 0.2, 0.0, rng.uniform(0.1, 1, n)),
            rng.integers(0, 1000, n).astype(float), k, RerankSettings())  # fmt: skip
    a, b = rerank(*args), rerank(*args, np.zeros(n, dtype=bool))
    assert a.order.tolist() == b.order.tolist()
    assert a.scores.tolist() == b.scores.tolist() and a.prices.tolist() == b.prices.tolist()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 8), st.integers(0, 2**31))
def test_mixed_auction_contract(n: int, k: int, seed: int) -> None:
    """Prices within [floor of the ad's unit, bid]; each winner's cost per impression (CPM:
    price / 1000, CPC: pCTR × price) is at most its value per impression."""
    rng = np.random.default_rng(seed)
    cpm = rng.uniform(size=n) < 0.5
    pctr = rng.uniform(0.001, 0.2, n)
    bid = np.where(cpm, rng.uniform(0.1, 80, n), rng.uniform(0.1, 5, n))
    p = RerankSettings(max_per_advertiser=2)
    res = rerank(pctr, bid, rng.integers(0, 5, n), rng.integers(0, 4, n), rng.uniform(0.1, 1, n),
                 rng.integers(0, 100, n).astype(float), k, p, cpm)  # fmt: skip
    o = res.order
    floor = np.where(cpm[o], p.reserve_cpm, p.reserve_price)
    assert np.all(res.prices <= bid[o] + 1e-9) and np.all(res.prices >= np.minimum(floor, bid[o]) - 1e-9)
    value = ecpm(pctr[o], bid[o], cpm[o])
    cost = np.where(cpm[o], res.prices / 1000, pctr[o] * res.prices)
    assert np.all(cost <= value + 1e-12)
    assert np.all(np.diff(res.scores) <= 1e-12)
