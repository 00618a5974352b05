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
def test_lazy_diversify_picks_what_the_array_loop_picks(
    cands: list[tuple[float, int, int]], k: int, per_adv: int, decay: float
) -> None:
    """The heap (scores ≥ 0, decay ≤ 1) and the array loop agree pick for pick, ties included."""
    from serving.rerank import _diversify_arrays, _diversify_lazy

    scores = np.array([c[0] for c in cands], dtype=np.float64)
    adv = np.array([c[1] for c in cands], dtype=np.int64)
    cat = np.array([c[2] for c in cands], dtype=np.int64)
    pool = np.argsort(-scores, kind="stable")[: max(k * per_adv * 4, 64)]
    args = (pool, scores[pool], adv[pool], cat[pool], k, per_adv, decay)
    lazy, arrays = _diversify_lazy(*args), _diversify_arrays(*args)
    assert lazy[0].tolist() == arrays[0].tolist()
    assert lazy[1].tolist() == arrays[1].tolist()
