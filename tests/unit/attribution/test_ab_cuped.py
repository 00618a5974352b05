"""attribution.ab.cuped_lift: CUPED on a ratio metric against a case computed by hand, and its limits."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attribution.ab import ArmData, cuped_lift, lift
from attribution.ope import EstimationError


def _arm(name: str, clicks: list[int], imps: int = 10) -> ArmData:
    n = len(clicks)
    return ArmData.of(name, [1] * n, [imps] * n, clicks, [0] * n)


# every user 10 impressions in both periods, so the linearised CTR is the user's CTR minus the arm's
A, B = _arm("learning", [3, 5, 4]), _arm("control", [1, 3, 3])  # CTR .3 .5 .4 | .1 .3 .3
PA, PB = _arm("learning", [2, 4, 2]), _arm("control", [0, 2, 1])  # pre  .2 .4 .2 | 0 .2 .1


def test_cuped_lift_matches_the_hand_computed_case() -> None:
    # by hand: R_A = .4, R_B = 7/30; pooled pre CTR R0 = 11/60; m = pre CTR − R0, l = CTR − R_arm
    # θ = Σ l·(m − m̄) / Σ (m − m̄)² within arms = (.02 + .02) / (.08/3 + .02) = 6/7
    theta = 6 / 7
    # m̄_A = 4/15 − 11/60 = 1/12, m̄_B = 1/10 − 11/60 = −1/12
    ra, rb = 0.4 - theta / 12, 7 / 30 + theta / 12  # 23/70 and 32/105
    assert ra == pytest.approx(23 / 70) and rb == pytest.approx(32 / 105)
    # residuals l − θm per user: A (−.1 − θ/60, .1 − 13θ/60, −θ/60),
    # B (−2/15 + 11θ/60, 1/15 − θ/60, 1/15 + 5θ/60)
    res_a = np.array([-0.1 - theta / 60, 0.1 - 13 * theta / 60, -theta / 60])
    res_b = np.array([-2 / 15 + 11 * theta / 60, 1 / 15 - theta / 60, 1 / 15 + 5 * theta / 60])
    se = math.sqrt(res_a.var(ddof=1) / 3 / ra**2 + res_b.var(ddof=1) / 3 / rb**2)
    half = 1.959963984540054 * se
    c = cuped_lift(A, B, (PA, PB), "ctr", "delta")
    assert c.lift.estimate.value == pytest.approx(5 / 64, abs=1e-12)  # (23/70) / (32/105) − 1
    assert c.theta == pytest.approx(theta, abs=1e-12)
    assert c.lift.estimate.ci_low == pytest.approx(math.exp(math.log(69 / 64) - half) - 1, abs=1e-9)
    assert c.lift.estimate.ci_high == pytest.approx(math.exp(math.log(69 / 64) + half) - 1, abs=1e-9)
    assert (c.lift.estimate.ci_low, c.lift.estimate.ci_high) == pytest.approx((-0.1878, 0.4312), abs=1e-4)
    # the raw lift reads the arms' pre-existing difference as an effect: 5/7
    assert lift(A, B, "ctr", "delta").estimate.value == pytest.approx(5 / 7)
    assert 0 < c.variance_ratio < 0.25


def test_without_pre_period_data_cuped_is_the_raw_lift() -> None:
    none_a, none_b = _arm("learning", [0, 0, 0], imps=0), _arm("control", [0, 0, 0], imps=0)
    c = cuped_lift(A, B, (none_a, none_b), "ctr", "delta")
    raw = lift(A, B, "ctr", "delta").estimate
    assert c.theta == 0.0
    assert (c.lift.estimate.value, c.lift.estimate.ci_low, c.lift.estimate.ci_high) == pytest.approx(
        (raw.value, raw.ci_low, raw.ci_high)
    )


def test_cuped_bootstrap_narrows_the_interval_and_covers_the_truth() -> None:
    """Users with a persistent click propensity (Beta), seen before and during the test; the arm
    multiplies CTR by 1.10. CUPED's interval is narrower and both cover the truth."""
    rng = np.random.default_rng(3)

    def users(name: str, n: int, mult: float) -> tuple[ArmData, ArmData]:
        p = rng.beta(2, 14, n)
        imps, pre_imps = rng.integers(5, 40, n), rng.integers(5, 40, n)
        clicks, pre = rng.binomial(imps, np.minimum(p * mult, 1)), rng.binomial(pre_imps, p)
        return (ArmData.of(name, np.ones(n), imps, clicks, np.zeros(n)),
                ArmData.of(name, np.ones(n), pre_imps, pre, np.zeros(n)))  # fmt: skip

    (a, pa), (b, pb) = users("learning", 3000, 1.10), users("control", 3000, 1.0)
    c = cuped_lift(a, b, (pa, pb), "ctr", "bootstrap", n_boot=400, seed=1)
    raw = lift(a, b, "ctr", "bootstrap", n_boot=400, seed=1).estimate
    est = c.lift.estimate
    assert est.ci_low < 0.10 < est.ci_high and raw.ci_low < 0.10 < raw.ci_high
    assert est.ci_high - est.ci_low < 0.9 * (raw.ci_high - raw.ci_low)
    assert 0 < c.variance_ratio < 0.9 and c.theta > 0
    delta = cuped_lift(a, b, (pa, pb), "ctr", "delta").lift.estimate  # the two intervals agree
    assert delta.ci_high - delta.ci_low == pytest.approx(est.ci_high - est.ci_low, rel=0.2)


def test_bad_input_names_the_arm() -> None:
    with pytest.raises(EstimationError, match="'learning': the pre-period has 2 user rows"):
        cuped_lift(A, B, (_arm("learning", [1, 1]), PB))
    with pytest.raises(EstimationError, match="over arm 'control' is undefined"):
        cuped_lift(A, _arm("control", [0, 0, 0]), (PA, PB))
    with pytest.raises(EstimationError, match="'impressions'"):
        cuped_lift(A, B, (PA, PB), "impressions")
