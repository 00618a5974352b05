"""attribution.ab: per-arm metrics and lifts against hand-computed cases, errors, and coverage."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest

from attribution import ab
from attribution.ab import ArmData, arm_metrics, compare, lift, ratio
from attribution.ope import EstimationError

Z = 1.959963984540054


def control() -> ArmData:
    # two users: 2 requests each; 4 and 6 impressions; 1 and 0 clicks; the click paid 0.5
    return ArmData.of("control", requests=[2, 2], impressions=[4, 6], clicks=[1, 0], revenue=[0.5, 0])


def test_doctests() -> None:
    assert doctest.testmod(ab).failed == 0


def test_point_values_by_hand() -> None:
    m = arm_metrics(control(), "delta")
    assert (m.users, m.requests) == (2, 4)
    assert m.impressions.value == 10
    assert m.ctr.value == pytest.approx(1 / 10)
    assert m.clicks_per_request.value == pytest.approx(1 / 4)
    assert m.revenue_per_request.value == pytest.approx(0.5 / 4)


def test_delta_intervals_by_hand() -> None:
    m = arm_metrics(control(), "delta")
    # CTR: y − R·x = [1 − 0.4, 0 − 0.6]; var(ddof 1) = 0.72; n·x̄² = 2·25 → se = √(0.72/50) = 0.12
    assert (m.ctr.ci_low, m.ctr.ci_high) == pytest.approx((0.1 - Z * 0.12, 0.1 + Z * 0.12))
    # clicks/request: y − R·x = [0.5, −0.5]; var 0.5; n·x̄² = 8 → se 0.25
    cpr = m.clicks_per_request
    assert (cpr.ci_low, cpr.ci_high) == pytest.approx((0.25 - Z * 0.25, 0.25 + Z * 0.25))
    # revenue/request: [0.5 − 0.25, 0 − 0.25]: var 0.125; /8 → se 0.125
    rpr = m.revenue_per_request
    assert (rpr.ci_low, rpr.ci_high) == pytest.approx((0.125 - Z * 0.125, 0.125 + Z * 0.125))
    # impressions: the sum 10 ± z·sd·√n, sd([4, 6]) = √2
    assert m.impressions.ci_high == pytest.approx(10 + Z * math.sqrt(2) * math.sqrt(2))


def test_bootstrap_interval_by_enumeration() -> None:
    # resamples of two users: {A,A} p=1/4 → CTR 2/8, {A,B} p=1/2 → 1/10, {B,B} p=1/4 → 0/12;
    # so the 2.5 % quantile is 0 and the 97.5 % quantile is 0.25
    m = arm_metrics(control(), "bootstrap", n_boot=4000, seed=3)
    assert m.ctr.value == pytest.approx(0.1)
    assert (m.ctr.ci_low, m.ctr.ci_high) == (0.0, 0.25)
    # impressions: sums 8, 10, 12
    assert (m.impressions.ci_low, m.impressions.ci_high) == (8.0, 12.0)


def test_bootstrap_is_seeded() -> None:
    rng = np.random.default_rng(0)
    imps = rng.integers(1, 20, 500)
    d = ArmData.of("learning", imps // 2 + 1, imps, rng.binomial(imps, 0.1), rng.random(500))
    a, b = arm_metrics(d, n_boot=300, seed=7), arm_metrics(d, n_boot=300, seed=7)
    assert a == b
    assert arm_metrics(d, n_boot=300, seed=8).ctr != a.ctr


def test_lift_by_hand() -> None:
    learning = ArmData.of("learning", [2, 2], [5, 5], [1, 2], [1.0, 2.0])  # CTR 0.3
    base = control()  # CTR 0.1
    d = lift(learning, base, "ctr", "delta")
    assert d.estimate.value == pytest.approx(2.0)
    # var(R_A): y − 0.3x = [−0.5, 0.5] → 0.5 / (2·25) = 0.01; var(R_B) = 0.0144
    se_log = math.sqrt(0.01 / 0.09 + 0.0144 / 0.01)
    lo, hi = math.exp(math.log(3) - Z * se_log) - 1, math.exp(math.log(3) + Z * se_log) - 1
    assert (d.estimate.ci_low, d.estimate.ci_high) == pytest.approx((lo, hi))
    assert d.estimate.ci_low > -1


def test_compare_lists_every_arm_and_pair() -> None:
    arms = {
        "learning": ArmData.of("learning", [2, 2], [5, 5], [1, 2], [1.0, 2.0]),
        "correction": ArmData.of("correction", [1, 3], [4, 4], [1, 1], [1.0, 1.0]),
        "control": control(),
    }
    r = compare(arms, method="delta")
    assert set(r.arms) == {"learning", "correction", "control"}
    assert {(x.arm, x.baseline, x.metric) for x in r.lifts} == {
        (a, b, m) for a, b in ab.DEFAULT_PAIRS for m in ab.RATIOS
    }
    assert r.as_dict()["method"] == "delta"
    partial = compare({k: arms[k] for k in ("learning", "control")}, method="delta")
    assert len(partial.lifts) == 3 and partial.skipped_pairs == [
        "learning vs correction: arm 'correction' has no traffic in the range"
    ]
    with pytest.raises(EstimationError, match="learning vs correction: arm 'correction' has no traffic"):
        compare({k: arms[k] for k in ("learning", "control")}, method="delta", strict=True)
    no_clicks = {**arms, "control": ArmData.of("control", [1], [5], [0], [0])}
    r = compare(no_clicks, method="delta")
    assert [x.baseline for x in r.lifts] == ["correction"] * 3
    assert r.skipped_pairs == [
        "learning vs control: lift over arm 'control' is undefined: its ctr is 0 (no clicks or revenue)"
    ]


@pytest.mark.parametrize("method", ["bootstrap", "delta"])
def test_arm_without_traffic_is_named(method: str) -> None:
    empty = ArmData.of("control", [], [], [], [])
    with pytest.raises(EstimationError, match="arm 'control' has no traffic"):
        arm_metrics(empty, method)  # type: ignore[arg-type]
    with pytest.raises(EstimationError, match="arm 'control' has no traffic"):
        compare({"learning": control(), "control": empty}, method=method)  # type: ignore[arg-type]


def test_zero_denominators_are_named() -> None:
    no_imps = ArmData.of("correction", [3, 1], [0, 0], [0, 0], [0, 0])
    with pytest.raises(
        EstimationError, match="arm 'correction': ctr is undefined, the arm has no shown impressions"
    ):
        arm_metrics(no_imps, "delta")
    no_clicks = ArmData.of("control", [1], [5], [0], [0])
    with pytest.raises(EstimationError, match="lift over arm 'control' is undefined: its ctr is 0"):
        lift(control(), no_clicks, "ctr")
    assert ratio(no_clicks, "ctr") == 0.0


def test_bad_rows_are_named() -> None:
    with pytest.raises(EstimationError, match=r"arm 'x': clicks\[1\] = -1.0"):
        ArmData.of("x", [1, 1], [1, 1], [0, -1], [0, 0])
    with pytest.raises(EstimationError, match="user 0 has more clicks than impressions"):
        ArmData.of("x", [1], [1], [2], [0])
    with pytest.raises(EstimationError, match="columns differ in length"):
        ArmData.of("x", [1, 1], [1], [0], [0])
    with pytest.raises(EstimationError, match="'jackknife' is not one of"):
        arm_metrics(control(), "jackknife")  # type: ignore[arg-type]


def _simulated_arm(rng: np.random.Generator, name: str, ctr: float, n: int) -> ArmData:
    """Users with Poisson requests, 1–4 impressions per request, a user-level CTR ~ Beta around
    `ctr` (so clicks are over-dispersed as real users' are); price 0.2–2 per click."""
    requests = rng.poisson(4, n) + 1
    imps = rng.binomial(requests * 4, 0.6)
    p = rng.beta(2.0, 2.0 * (1 - ctr) / ctr, n)
    clicks = rng.binomial(imps, p)
    revenue = clicks * rng.uniform(0.2, 2.0, n)
    return ArmData.of(name, requests, imps, clicks, revenue)


@pytest.mark.parametrize(("method", "trials", "n_boot"), [("delta", 400, 0), ("bootstrap", 150, 400)])
def test_intervals_cover_the_truth_near_the_nominal_rate(method: str, trials: int, n_boot: int) -> None:
    rng = np.random.default_rng(11)
    hits_ctr = hits_lift = 0
    for _ in range(trials):
        a = _simulated_arm(rng, "learning", 0.06, 400)
        b = _simulated_arm(rng, "control", 0.05, 400)
        # CTR truth = E[p] (p independent of impressions); the lift's truth is 0.06 / 0.05 − 1
        m = arm_metrics(a, method, n_boot=n_boot, seed=int(rng.integers(1 << 30)))  # type: ignore[arg-type]
        hits_ctr += m.ctr.ci_low <= 0.06 <= m.ctr.ci_high
        d = lift(a, b, "ctr", method, n_boot=n_boot, seed=int(rng.integers(1 << 30)))  # type: ignore[arg-type]
        hits_lift += d.estimate.ci_low <= 0.2 <= d.estimate.ci_high
    # a correct 95 % interval lands in [0.89, 0.99] over these trials with near certainty
    assert 0.89 <= hits_ctr / trials <= 0.99, hits_ctr
    assert 0.89 <= hits_lift / trials <= 0.99, hits_lift


def test_ctr_is_clicks_over_shown_impressions() -> None:
    """CTR's denominator is the shown impressions (schemas.billing); without a shown count every
    impression is shown. A click whose render beacon was lost may leave a user with more clicks
    than shown impressions; more shown than served is refused, naming the user."""
    served_only = ArmData.of("learning", [2, 2], [10, 10], [2, 1], [0, 0])
    shown = ArmData.of("learning", [2, 2], [10, 10], [2, 1], [0, 0], shown=[4, 2])
    assert ratio(served_only, "ctr") == pytest.approx(3 / 20)
    assert ratio(shown, "ctr") == pytest.approx(3 / 6)
    assert arm_metrics(shown, "delta").impressions.value == 20.0  # impressions stay served
    lost_beacon = ArmData.of("learning", [1], [3], [2], [0], shown=[1])
    assert ratio(lost_beacon, "ctr") == 2.0
    with pytest.raises(EstimationError, match="arm 'learning': user 1 has more shown than served"):
        ArmData.of("learning", [1, 1], [3, 3], [0, 0], [0, 0], shown=[3, 4])
